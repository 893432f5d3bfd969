"""How much device memory a model needs, estimated from its GGUF header.

Two halves, as everywhere in the agent: :func:`read_facts` is the only I/O --
it memory-maps the file and reads the header and the tensor table (with
its own table of ggml's block sizes, :data:`GGML_BLOCK_SIZES`), never the
weights, so it is instant even for a 100 GB file -- and :func:`estimate` is a pure function of those facts, the model's
config and the kind of device, so hypothesis and recorded headers can hammer
it.

The estimate mirrors what llama-server (llama.cpp) allocates when it loads:

- **weights**: the tensors placed on the device.  On a ``cpu`` device all of
  them.  On a GPU the last ``gpu_layers`` repeating layers plus the output
  head (llama.cpp offloads the output first, keeps the token embeddings in
  host memory); unset, ``auto`` and ``all`` mean every layer.
- **KV cache**: per layer ``key_length x kv_heads`` keys and
  ``value_length x kv_heads`` values per cell, in ``cache-type-k/v`` (f16 by
  default).  ``ctx_size`` is the total over all slots (llama-server divides
  it, padded to 256 cells); layers with a sliding window keep only
  ``window + ubatch`` cells -- per slot when the slots do not share one
  unified cache (``kv-unified`` not set).  The agent always gives
  llama-server ``--parallel`` (the model's ``parallel``, default 1:
  :mod:`rolemesh.children.llama_args`), so the slots estimated are the slots the
  child makes and the requests the agent admits at once.
- **compute buffer**: the scratch memory of the largest graph (one ubatch):
  logits, the attention scores when flash attention is off, activations.
- **runtime**: what a child takes on a GPU beyond those buffers, per
  device it uses: the CUDA context, cuBLAS's workspace, CUDA graphs
  (:data:`RUNTIME_BYTES`; measured on cuda only, 0 elsewhere).
- **draft**: a ``draft_model``'s weights, KV cache and compute buffer,
  sized as the target's (:func:`draft_bytes`).
- **LoRA adapters**: the tensors of a model's ``lora_adapters`` on the
  device -- llama.cpp puts each next to the weight it adapts, so on a GPU
  only those of the offloaded layers (:func:`lora_bytes`).
- **reserve**: ``device_memory_reserve_bytes``, headroom the node keeps free.

The figures are checked against the buffer sizes a real llama-server logs at
load (``tests/integration/test_estimate_real.py``): within 15% on the tiny
test models and on Gemma 3 270M.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

import attr

from rolemesh.config.file import ModelConfig

#: A GGUF file's bytes: the memory-mapped file, or the bytes themselves.
GGUFBytes = Union[bytes, bytearray, mmap.mmap]
_Facts = TypeVar("_Facts")

MIB = 1024 * 1024
#: llama.cpp pads the context (and the sliding-window cache) to this many cells.
CTX_PAD = 256
#: llama-server's defaults, used where the model's config leaves them unset.
DEFAULT_UBATCH = 512
DEFAULT_BATCH = 2048
DEFAULT_CTX = 4096  # only when the GGUF has no context length either
#: Every ``n``-th layer attends to the full context, the others to a window;
#: llama.cpp's per-architecture defaults (a GGUF key may override them).
SWA_PATTERNS = {"gemma2": 2, "gemma3": 6, "cohere2": 4}

#: Bytes per element of the KV cache types llama-server accepts, as
#: (block size, bytes per block).
CACHE_TYPES: Dict[str, Tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "iq4_nl": (32, 18),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
}


class EstimateError(Exception):
    """The file is not a GGUF the estimate can read; ``str()`` is one line."""


@attr.s(auto_attribs=True, frozen=True)
class GGUFFacts:
    """What the estimate needs from a GGUF header (no weights)."""

    architecture: str
    n_layer: int
    n_embd: int
    n_head: Tuple[int, ...]
    n_head_kv: Tuple[int, ...]
    key_length: int
    value_length: int
    n_vocab: int
    n_ctx_train: int = 0
    #: Sliding-window size (0: none) and which layers use it.
    n_swa: int = 0
    swa_layers: Tuple[bool, ...] = ()
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff: int = 0
    #: Tensor bytes per repeating layer, the output head (``output*``) and
    #: everything else (token embeddings, ...).
    layer_bytes: Tuple[int, ...] = ()
    output_bytes: int = 0
    other_bytes: int = 0

    @property
    def weight_bytes(self) -> int:
        return sum(self.layer_bytes) + self.output_bytes + self.other_bytes

    def is_swa(self, layer: int) -> bool:
        return self.n_swa > 0 and layer < len(self.swa_layers) and self.swa_layers[layer]


@attr.s(auto_attribs=True, frozen=True)
class AdapterFacts:
    """What the estimate needs from a LoRA adapter's GGUF header: its tensor
    bytes by the base model's layer they adapt (``blk.N.*``), the output
    head's (``output*``) and the rest's (token embeddings, ...)."""

    layer_bytes: Tuple[int, ...] = ()
    output_bytes: int = 0
    other_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_bytes) + self.output_bytes + self.other_bytes


@attr.s(auto_attribs=True, frozen=True)
class MemoryEstimate:
    """Bytes one child needs on its device (or device group), by part."""

    weights_bytes: int
    kv_cache_bytes: int
    compute_bytes: int
    reserve_bytes: int = 0
    #: The context the KV cache was sized for (cells, after padding).
    ctx_cells: int = 0
    runtime_bytes: int = 0
    #: The slots the KV cache and compute buffer were sized for: the
    #: ``--parallel`` the child gets and the requests the agent runs at once.
    slots: int = 1
    #: The draft model's weights, KV cache and compute buffer (``draft_model``; 0 without).
    draft_bytes: int = 0
    #: The LoRA adapters' tensors on the device (``lora_adapters``; 0 without).
    lora_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.kv_cache_bytes + self.compute_bytes + self.runtime_bytes
                + self.reserve_bytes + self.draft_bytes + self.lora_bytes)

    def to_json(self) -> Dict[str, int]:
        return {
            "total_bytes": self.total_bytes,
            "weights_bytes": self.weights_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "compute_bytes": self.compute_bytes,
            "runtime_bytes": self.runtime_bytes,
            "reserve_bytes": self.reserve_bytes,
            "ctx_cells": self.ctx_cells,
            "slots": self.slots,
            "draft_bytes": self.draft_bytes,
            "lora_bytes": self.lora_bytes,
        }

    def describe(self) -> str:
        runtime = f", runtime {gib(self.runtime_bytes)}" if self.runtime_bytes else ""
        draft = f", draft model {gib(self.draft_bytes)}" if self.draft_bytes else ""
        lora = f", LoRA adapters {gib(self.lora_bytes)}" if self.lora_bytes else ""
        return (f"{gib(self.total_bytes)} (weights {gib(self.weights_bytes)}, KV cache {gib(self.kv_cache_bytes)}, "
                f"compute {gib(self.compute_bytes)}{runtime}{draft}{lora}, reserve {gib(self.reserve_bytes)})")


def gib(n: Optional[int]) -> str:
    """Bytes for people: ``1.50 GiB``, ``12.0 MiB``."""
    if n is None:
        return "unknown"
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / MIB:.1f} MiB"


# --------------------------------------------------------------------------
# Reading the header (the only I/O)


#: GGUF value types (``gguf.GGUFValueType``): struct format of the scalars.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
#: Numeric arrays longer than this are skipped, not kept (vocabularies, merges).
_KEEP_ARRAY = 65536


class _Header:
    """A cursor over a memory-mapped GGUF header."""

    def __init__(self, buf: GGUFBytes) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        if n > len(self.buf) - self.pos:
            raise EstimateError("truncated string in the GGUF header")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", "replace")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.take("I"), self.take("Q")
            if etype in _SCALARS and count > _KEEP_ARRAY:
                self.pos += count * struct.calcsize("<" + _SCALARS[etype])
                return _Skipped(count)
            if etype == _STRING and count > _KEEP_ARRAY:
                for _ in range(count):  # each string carries its own length
                    self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
                return _Skipped(count)
            return tuple(self.value(etype) for _ in range(count))
        raise EstimateError(f"unknown GGUF value type {vtype}")


@attr.s(auto_attribs=True, frozen=True)
class _Skipped:
    """A long array the estimate only needs the length of."""

    count: int

    def __len__(self) -> int:
        return self.count


def parse_header(buf: GGUFBytes) -> Tuple[Dict[str, Any], List[Tuple[str, Tuple[int, ...], int]]]:
    """(key/values, [(tensor name, ggml shape, ggml type)]) from a GGUF's bytes."""
    cursor = _Header(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise EstimateError("not a GGUF file (bad magic)")
    cursor.pos = 4
    version = cursor.take("I")
    if version not in (2, 3):
        raise EstimateError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = cursor.take("Q"), cursor.take("Q")
    kv: Dict[str, Any] = {}
    for _ in range(n_kv):
        key = cursor.string()
        kv[key] = cursor.value(cursor.take("I"))
    tensors = []
    for _ in range(n_tensors):
        name = cursor.string()
        dims = tuple(cursor.take("Q") for _ in range(cursor.take("I")))
        ttype = cursor.take("I")
        cursor.take("Q")  # offset
        tensors.append((name, dims, ttype))
    return kv, tensors


#: ggml tensor types as (elements per block, bytes per block), by the type's
#: number in a GGUF tensor table: ggml's own ``type_traits`` (``ggml.c``), as
#: the ``gguf`` package's ``GGML_QUANT_SIZES`` has them (a test in the test
#: extra checks every entry against it).  Kept here so that the agent needs
#: neither ``gguf`` nor numpy at run time: the header parser above is its own.
GGML_BLOCK_SIZES: Dict[int, Tuple[int, int]] = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    9: (32, 40),  # Q8_1
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    15: (256, 292),  # Q8_K
    16: (256, 66),  # IQ2_XXS
    17: (256, 74),  # IQ2_XS
    18: (256, 98),  # IQ3_XXS
    19: (256, 50),  # IQ1_S
    20: (32, 18),  # IQ4_NL
    21: (256, 110),  # IQ3_S
    22: (256, 82),  # IQ2_S
    23: (256, 136),  # IQ4_XS
    24: (1, 1),  # I8
    25: (1, 2),  # I16
    26: (1, 4),  # I32
    27: (1, 8),  # I64
    28: (1, 8),  # F64
    29: (256, 56),  # IQ1_M
    30: (1, 2),  # BF16
    34: (256, 54),  # TQ1_0
    35: (256, 66),  # TQ2_0
    39: (32, 17),  # MXFP4
    40: (64, 36),  # NVFP4
    41: (128, 18),  # Q1_0
}


def tensor_bytes(shape: Tuple[int, ...], ttype: int) -> int:
    """Bytes of a tensor of ggml ``shape`` and type (:data:`GGML_BLOCK_SIZES`)."""
    try:
        block, size = GGML_BLOCK_SIZES[ttype]
    except (KeyError, TypeError):
        raise EstimateError(f"unknown tensor type {ttype}") from None
    elements = 1
    for d in shape:
        elements *= int(d)
    return elements * size // block


def _per_layer(value: Any, n_layer: int, default: int) -> Tuple[int, ...]:
    if value is None:
        return (default,) * n_layer
    if isinstance(value, tuple):
        values = tuple(int(v) for v in value)[:n_layer]
        return values + (values[-1] if values else default,) * (n_layer - len(values))
    return (int(value),) * n_layer


def _swa_layers(arch: str, pattern: Any, n_layer: int) -> Tuple[bool, ...]:
    if isinstance(pattern, tuple):  # one flag per layer
        flags = tuple(bool(v) for v in pattern)[:n_layer]
        return flags + (False,) * (n_layer - len(flags))
    n = int(pattern) if pattern is not None else SWA_PATTERNS.get(arch, 0)
    # llama.cpp's set_swa_pattern: 0 = every layer; else the last of each n is full.
    return tuple(n == 0 or (il % n) < n - 1 for il in range(n_layer))


def facts_from_header(kv: Mapping[str, Any], tensors: Sequence[Tuple[str, Tuple[int, ...], int]]) -> GGUFFacts:
    """:class:`GGUFFacts` from a parsed header (see :func:`parse_header`)."""
    arch = kv.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise EstimateError("no general.architecture in the GGUF header")

    def key(name: str) -> Any:
        return kv.get(f"{arch}.{name}")

    n_layer = key("block_count")
    n_embd = key("embedding_length")
    if not isinstance(n_layer, int) or not isinstance(n_embd, int) or n_layer < 0 or n_embd <= 0:
        raise EstimateError(f"GGUF header lacks {arch}.block_count or {arch}.embedding_length")
    n_head = _per_layer(key("attention.head_count"), n_layer, 1)
    n_head_kv = _per_layer(key("attention.head_count_kv"), n_layer, max(n_head, default=1))
    head_dim = n_embd // max(1, max(n_head, default=1))
    layer_bytes = [0] * n_layer
    output_bytes = other_bytes = 0
    vocab_from_embd = 0
    for name, shape, ttype in tensors:
        size = tensor_bytes(shape, ttype)
        if name.startswith("blk."):
            index = name.split(".", 2)[1]
            if index.isdigit() and int(index) < n_layer:
                layer_bytes[int(index)] += size
            else:
                other_bytes += size
        elif name.startswith("output"):
            output_bytes += size
        else:
            if name == "token_embd.weight" and len(shape) > 1:
                vocab_from_embd = int(shape[1])
            other_bytes += size
    tokens = kv.get("tokenizer.ggml.tokens")
    n_vocab = key("vocab_size") or (len(tokens) if tokens is not None else 0) or vocab_from_embd
    n_swa = key("attention.sliding_window") or 0
    n_ff = key("feed_forward_length")
    return GGUFFacts(
        architecture=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        key_length=int(key("attention.key_length") or head_dim),
        value_length=int(key("attention.value_length") or head_dim),
        n_vocab=int(n_vocab),
        n_ctx_train=int(key("context_length") or 0),
        n_swa=int(n_swa) if isinstance(n_swa, int) else 0,
        swa_layers=_swa_layers(arch, key("attention.sliding_window_pattern"), n_layer) if n_swa else (),
        n_expert=int(key("expert_count") or 0),
        n_expert_used=int(key("expert_used_count") or 0),
        n_ff=int(max(n_ff) if isinstance(n_ff, tuple) else (n_ff or 0)),
        layer_bytes=tuple(layer_bytes),
        output_bytes=output_bytes,
        other_bytes=other_bytes,
    )


def adapter_facts_from_header(kv: Mapping[str, Any],
                              tensors: Sequence[Tuple[str, Tuple[int, ...], int]]) -> AdapterFacts:
    """:class:`AdapterFacts` from a parsed LoRA adapter header (``general.type``
    ``adapter``, ``adapter.type`` ``lora``: what llama.cpp loads with ``--lora``)."""
    if kv.get("general.type") != "adapter" or kv.get("adapter.type") != "lora":
        raise EstimateError("not a LoRA adapter (general.type is not adapter, or adapter.type is not lora)")
    layers: Dict[int, int] = {}
    output_bytes = other_bytes = 0
    for name, shape, ttype in tensors:
        size = tensor_bytes(shape, ttype)
        index = name.split(".", 2)[1] if name.startswith("blk.") and name.count(".") >= 2 else ""
        if index.isdigit():
            layers[int(index)] = layers.get(int(index), 0) + size
        elif name.startswith("output"):
            output_bytes += size
        else:
            other_bytes += size
    layer_bytes = tuple(layers.get(i, 0) for i in range(max(layers) + 1)) if layers else ()
    return AdapterFacts(layer_bytes, output_bytes, other_bytes)


def read_adapter_facts(path: str) -> AdapterFacts:
    """Read a LoRA adapter's GGUF header, memory-mapped, as :func:`read_facts` does."""
    return _read_header(path, adapter_facts_from_header)


def read_facts(path: str) -> GGUFFacts:
    """Read ``path``'s GGUF header, memory-mapped (the weights are never read).

    Raises :class:`EstimateError` with one line for a file that is missing,
    not a GGUF, or lacks the fields the estimate needs.
    """
    return _read_header(path, facts_from_header)


def _read_header(path: str, build: Callable[[Dict[str, Any], List[Tuple[str, Tuple[int, ...], int]]], _Facts]
                 ) -> _Facts:
    try:
        with open(path, "rb") as f:
            try:
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise EstimateError(f"{path}: not a GGUF file (empty)") from None
    except OSError as e:
        raise EstimateError(f"{path}: {e.strerror or e}") from None
    try:
        return build(*parse_header(buf))
    except EstimateError as e:
        raise EstimateError(f"{path}: {e}") from None
    except (struct.error, ValueError, TypeError, IndexError) as e:
        raise EstimateError(f"{path}: not a readable GGUF header ({e})") from None
    finally:
        buf.close()


# --------------------------------------------------------------------------
# The estimate (pure)


def _pad(n: int, to: int = CTX_PAD) -> int:
    return -(-n // to) * to


def _flag(model: ModelConfig, *names: str) -> Any:
    for flag, value in model.server_args:
        if flag in names:
            return value
    return None


def _type_bytes(cache_type: Any, elements: int) -> int:
    block, size = CACHE_TYPES.get(str(cache_type or "f16").lower(), CACHE_TYPES["f16"])
    return elements * size // block


def offloaded_layers(facts: GGUFFacts, gpu_layers: Any) -> int:
    """How many of ``n_layer + 1`` offloadable layers (the output head
    counts as one) a GPU gets for ``gpu_layers``."""
    total = facts.n_layer + 1
    if gpu_layers is None or gpu_layers in ("auto", "all"):
        return total
    return max(0, min(int(gpu_layers), total))


def _slots(model: ModelConfig) -> Tuple[int, bool]:
    """(slots, unified cache) as llama-server resolves them for the argv
    the agent builds: ``--parallel`` is always explicit, so the cache is
    per slot unless ``kv-unified`` is set."""
    unified = _flag(model, "kv-unified", "kvu")
    not_unified = _flag(model, "no-kv-unified", "no-kvu")
    slots, shared = max(1, model.parallel), False
    if unified is True:
        shared = True
    if not_unified is True:
        shared = False
    return slots, shared


def kv_cells(facts: GGUFFacts, model: ModelConfig) -> Tuple[int, int]:
    """(cells of a full-attention layer, cells of a sliding-window layer)."""
    ctx = model.ctx_size or facts.n_ctx_train or DEFAULT_CTX
    ctx = _pad(ctx)
    slots, shared = _slots(model)
    ubatch = min(model.ubatch_size or DEFAULT_UBATCH, model.batch_size or DEFAULT_BATCH)
    if shared:
        full = ctx
        swa = _pad(min(full, facts.n_swa * slots + ubatch)) if facts.n_swa else 0
    else:
        per_slot = _pad(max(1, ctx // slots))
        full = per_slot * slots
        swa = slots * _pad(min(per_slot, facts.n_swa + ubatch)) if facts.n_swa else 0
    if facts.n_swa and _flag(model, "swa-full") is True:
        swa = full
    return full, swa


def kv_cache_bytes(facts: GGUFFacts, model: ModelConfig, layers: Iterable[int]) -> int:
    full, swa = kv_cells(facts, model)
    type_k = _flag(model, "cache-type-k", "ctk")
    type_v = _flag(model, "cache-type-v", "ctv")
    total = 0
    for il in layers:
        cells = swa if facts.is_swa(il) else full
        heads = facts.n_head_kv[il]
        total += _type_bytes(type_k, facts.key_length * heads * cells)
        total += _type_bytes(type_v, facts.value_length * heads * cells)
    return total


def compute_bytes(facts: GGUFFacts, model: ModelConfig, flash_attn: bool) -> int:
    """The compute buffer llama.cpp reserves for its largest graph (one
    ubatch of ``min(ubatch, ctx)`` tokens) plus the output buffer (one row
    of logits per slot).

    Fitted to what llama-server logs (see the module docstring): the
    attention masks (f16 with flash attention, f32 without, one per cache:
    full and sliding window), the ``n_kv x tokens x heads`` scores when
    flash attention is off, and a layer's activations, about
    ``4 x n_ff + n_q`` floats per token.
    """
    full, swa = kv_cells(facts, model)
    slots, shared = _slots(model)
    streams = 1 if shared else slots
    n_kv, n_kv_swa = full // streams, swa // streams
    tokens = min(model.ubatch_size or DEFAULT_UBATCH, model.batch_size or DEFAULT_BATCH, full)
    heads = max(facts.n_head, default=1)
    n_q = heads * facts.key_length
    if flash_attn:
        attention = 2 * tokens * (n_kv + n_kv_swa)
    else:
        attention = 4 * tokens * (n_kv + n_kv_swa) + 4 * tokens * heads * n_kv
    activations = 4 * tokens * (4 * max(facts.n_ff, facts.n_embd) + n_q)
    output = 4 * facts.n_vocab * slots
    return attention + activations + output


def _flash_attn(model: ModelConfig, device_kind: str) -> bool:
    value = model.flash_attn
    if value is None:
        value = "auto"
    # ``auto`` turns flash attention on wherever the device supports it; the
    # CPU and the GPU backends all do for the architectures served here.
    return value in ("on", "auto")


def estimate(
    facts: GGUFFacts,
    model: ModelConfig,
    device_kind: str = "gpu",
    reserve_bytes: int = 0,
    draft: Optional[GGUFFacts] = None,
    adapters: Sequence[AdapterFacts] = (),
) -> MemoryEstimate:
    """Memory ``model`` needs on one device (or spread over a group) of
    ``device_kind`` (``cpu`` puts every tensor on the device; anything else
    offloads by ``gpu_layers``).  ``reserve_bytes`` is added once per
    device the model occupies -- the caller multiplies for a group.
    ``draft``: the header of the model's ``draft_model`` (:func:`draft_bytes`);
    ``adapters``: those of its ``lora_adapters`` that could be read (:func:`lora_bytes`)."""
    if device_kind == "cpu":
        weights = facts.weight_bytes
        kv_layers = range(facts.n_layer)
    else:
        offloaded = offloaded_layers(facts, model.gpu_layers)
        first = facts.n_layer + 1 - offloaded  # layers first..n_layer-1 go to the GPU
        weights = sum(facts.layer_bytes[max(0, first):]) + (facts.output_bytes if offloaded else 0)
        no_offload = _flag(model, "no-kv-offload", "nkvo") is True
        kv_layers = range(0) if no_offload else range(max(0, first), facts.n_layer)
    full, _ = kv_cells(facts, model)
    return MemoryEstimate(
        weights_bytes=weights,
        kv_cache_bytes=kv_cache_bytes(facts, model, kv_layers),
        compute_bytes=compute_bytes(facts, model, _flash_attn(model, device_kind)),
        reserve_bytes=max(0, reserve_bytes),
        ctx_cells=full,
        slots=_slots(model)[0],
        draft_bytes=draft_bytes(draft, model, device_kind, full) if draft is not None and model.draft_model else 0,
        lora_bytes=lora_bytes(adapters, facts, model, device_kind),
    )


def lora_bytes(adapters: Sequence[AdapterFacts], facts: GGUFFacts, model: ModelConfig, device_kind: str) -> int:
    """What the LoRA adapters add on the device.  llama.cpp allocates each
    adapter tensor in the buffer of the weight it adapts: every one on a
    cpu device; on a GPU those of the offloaded layers and of the output
    head when it is offloaded (the token embeddings' stay in host memory)."""
    if device_kind == "cpu":
        return sum(a.total_bytes for a in adapters)
    offloaded = offloaded_layers(facts, model.gpu_layers)
    first = max(0, facts.n_layer + 1 - offloaded)
    return sum(sum(a.layer_bytes[first:]) + (a.output_bytes if offloaded else 0) for a in adapters)


#: The draft's own KV cache types (``--spec-draft-type-k/v``), as the
#: target's flags they stand for in the draft's estimate.
_DRAFT_CACHE_FLAGS = {"spec-draft-type-k": "cache-type-k", "ctkd": "cache-type-k", "cache-type-k-draft": "cache-type-k",
                      "spec-draft-type-v": "cache-type-v", "ctvd": "cache-type-v", "cache-type-v-draft": "cache-type-v"}


def draft_bytes(draft: GGUFFacts, model: ModelConfig, device_kind: str, target_cells: int) -> int:
    """What the draft model adds: its weights on the device (all on a cpu;
    ``draft_gpu_layers`` of them on a GPU, default all), its KV cache and its
    compute buffer.  llama-server gives the draft's context the target's
    cells, slots and batch sizes (its log: the same ``n_ctx``,
    ``n_seq_max``, ``n_ubatch``), in f16 unless ``spec-draft-type-k/v``
    say otherwise."""
    cache_types = tuple((_DRAFT_CACHE_FLAGS[flag], value) for flag, value in model.server_args
                        if flag in _DRAFT_CACHE_FLAGS)
    others = tuple((flag, value) for flag, value in model.server_args
                   if flag not in ("cache-type-k", "ctk", "cache-type-v", "ctv") and flag not in _DRAFT_CACHE_FLAGS)
    as_model = attr.evolve(model, ctx_size=target_cells, gpu_layers=model.draft_gpu_layers,
                           server_args=others + cache_types, draft_model=None)
    part = estimate(draft, as_model, device_kind)
    return part.weights_bytes + part.kv_cache_bytes + part.compute_bytes


# --------------------------------------------------------------------------
# Where it fits (pure; the node and ``--check`` share these)


#: Device memory a llama-server child takes beyond the buffers llama.cpp
#: logs, per device it uses.  cuda: the CUDA context, cuBLAS's workspace and
#: CUDA graphs.  NVML's per-process figure on an H200 (CUDA 13.0, driver
#: 580.159) was 588-589 MiB over the logged buffers once loaded and 684-687
#: MiB once requests had run, the same for a 10 MiB and a 1.6 GB model
#: (``tests/integration/test_cuda_real.py``), so 768 MiB.
#: Not measured for the other GPU backends (0): set
#: ``device_memory_reserve_bytes`` there.
RUNTIME_BYTES: Dict[str, int] = {"cuda": 768 << 20}


def shared_memory(backend: str) -> bool:
    """cpu devices (and Apple's unified memory) all draw on one memory pool."""
    return backend in ("cpu", "metal")


def capacity_of(totals: Sequence[Optional[int]], backend: str) -> Optional[int]:
    """Total memory of a device or of a group's members (``totals``): their
    sum, or once for a shared pool; None when one is unknown."""
    if not totals or any(t is None for t in totals):
        return None
    known = [int(t) for t in totals if t is not None]
    return max(known) if shared_memory(backend) else sum(known)


def estimate_on(facts: GGUFFacts, model: ModelConfig, backend: str, members: int, reserve_bytes: int,
                draft: Optional[GGUFFacts] = None, adapters: Sequence[AdapterFacts] = ()) -> MemoryEstimate:
    """The estimate on a device (``members`` 1) or group of ``backend``: the
    reserve and the runtime count once per device, once in all for a shared pool."""
    per_device = 1 if shared_memory(backend) else max(1, members)
    need = estimate(facts, model, "cpu" if backend == "cpu" else "gpu", reserve_bytes * per_device, draft, adapters)
    return attr.evolve(need, runtime_bytes=RUNTIME_BYTES.get(backend, 0) * per_device)
