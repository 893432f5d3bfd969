"""The memory estimate, on GGUF headers the tests record themselves.

Each header is written with the ``gguf`` package in the shape of a real
model of its architecture (key names, per-layer tensors, quantization), but
only the header and the tensor table: no tensor data at all.  That the
estimate reads such a file proves it never touches the weights.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import gguf
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.children.llama_args import build_argv
from rolemesh.config.file import ModelConfig
from rolemesh.scheduling.estimate import (
    RUNTIME_BYTES,
    EstimateError,
    GGUFFacts,
    estimate,
    estimate_on,
    gib,
    kv_cells,
    offloaded_layers,
    read_facts,
    tensor_bytes,
)

Q = gguf.GGMLQuantizationType
MIB = 1 << 20

#: (name, numpy-order shape, ggml type)
Tensor = Tuple[str, Tuple[int, ...], Any]


def write_header(path: str, arch: str, keys: Dict[str, Any], tensors: Sequence[Tensor],
                 vocab: int = 0) -> int:
    """Write a header-only GGUF; return the tensor bytes it describes."""
    writer = gguf.GGUFWriter(path, arch)
    for key, value in keys.items():
        full = f"{arch}.{key}"
        if isinstance(value, list):
            writer.add_array(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_uint32(full, value)
    if vocab:
        writer.add_token_list([f"t{i}" for i in range(vocab)])
    total = 0
    for name, shape, qtype in tensors:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) * size // block
        total += nbytes
        writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return total


def dense_layers(n_layer: int, n_embd: int, n_q: int, n_kv: int, n_ff: int, qtype: Any,
                 qk_norm: int = 0, bias: bool = False) -> List[Tensor]:
    out: List[Tensor] = []
    for b in range(n_layer):
        p = f"blk.{b}."
        out += [
            (p + "attn_norm.weight", (n_embd,), Q.F32),
            (p + "attn_q.weight", (n_q, n_embd), qtype),
            (p + "attn_k.weight", (n_kv, n_embd), qtype),
            (p + "attn_v.weight", (n_kv, n_embd), qtype),
            (p + "attn_output.weight", (n_embd, n_q), qtype),
            (p + "ffn_norm.weight", (n_embd,), Q.F32),
            (p + "ffn_gate.weight", (n_ff, n_embd), qtype),
            (p + "ffn_up.weight", (n_ff, n_embd), qtype),
            (p + "ffn_down.weight", (n_embd, n_ff), qtype),
        ]
        if qk_norm:
            out += [(p + "attn_q_norm.weight", (qk_norm,), Q.F32), (p + "attn_k_norm.weight", (qk_norm,), Q.F32)]
        if bias:
            out += [(p + "attn_q.bias", (n_q,), Q.F32), (p + "attn_k.bias", (n_kv,), Q.F32),
                    (p + "attn_v.bias", (n_kv,), Q.F32)]
    return out


def model(**kw: Any) -> ModelConfig:
    server_args = tuple(kw.pop("server_args", {}).items())
    return ModelConfig("m", "/m.gguf", server_args=server_args, **kw)


class Recorded(SynchronousTestCase):
    """One recorded header per architecture."""

    def path(self, name: str) -> str:
        directory = self.mktemp()
        os.makedirs(directory)
        return os.path.join(directory, name + ".gguf")

    # Llama 3.2 1B: 16 layers, GQA 32/8 heads of 64, Q8_0, tied output absent.
    def llama(self) -> Tuple[GGUFFacts, int]:
        n_layer, n_embd, vocab = 16, 2048, 4096
        tensors = [("token_embd.weight", (vocab, n_embd), Q.Q8_0), ("output_norm.weight", (n_embd,), Q.F32),
                   ("output.weight", (vocab, n_embd), Q.Q8_0)]
        tensors += dense_layers(n_layer, n_embd, 2048, 512, 8192, Q.Q8_0)
        path = self.path("llama")
        total = write_header(path, "llama", {
            "block_count": n_layer, "embedding_length": n_embd, "feed_forward_length": 8192,
            "attention.head_count": 32, "attention.head_count_kv": 8, "context_length": 131072,
            "rope.dimension_count": 64,
        }, tensors, vocab=vocab)
        return read_facts(path), total

    def test_llama_facts(self) -> None:
        facts, total = self.llama()
        self.assertEqual((facts.architecture, facts.n_layer, facts.n_embd), ("llama", 16, 2048))
        self.assertEqual((facts.n_head[0], facts.n_head_kv[0], facts.key_length, facts.value_length), (32, 8, 64, 64))
        self.assertEqual((facts.n_vocab, facts.n_ctx_train, facts.n_swa), (4096, 131072, 0))
        self.assertEqual(facts.weight_bytes, total)
        self.assertEqual(facts.output_bytes, tensor_bytes((2048, 4096), Q.Q8_0) + 2048 * 4)

    def test_llama_kv_cache_for_ctx_size_and_cache_types(self) -> None:
        facts, total = self.llama()
        per_cell = 16 * 2 * 8 * 64  # layers x (K+V) x kv heads x head size
        e = estimate(facts, model(ctx_size=8192), "cpu")
        self.assertEqual(e.kv_cache_bytes, per_cell * 8192 * 2)  # f16: 256 MiB
        self.assertEqual(e.kv_cache_bytes, 256 * MIB)
        self.assertEqual(e.weights_bytes, total)
        q8 = estimate(facts, model(ctx_size=8192, server_args={"cache-type-k": "q8_0", "cache-type-v": "q8_0"}), "cpu")
        self.assertEqual(q8.kv_cache_bytes, per_cell * 8192 * 34 // 32)
        mixed = estimate(facts, model(ctx_size=8192, server_args={"ctk": "q4_0"}), "cpu")
        self.assertEqual(mixed.kv_cache_bytes, per_cell // 2 * 8192 * 18 // 32 + per_cell // 2 * 8192 * 2)
        # Unset: the context the model was trained with.
        self.assertEqual(estimate(facts, model(), "cpu").kv_cache_bytes, per_cell * 131072 * 2)
        # Padded to 256 cells, as llama.cpp does.
        self.assertEqual(estimate(facts, model(ctx_size=1000), "cpu").ctx_cells, 1024)

    def test_slots_are_the_ones_the_child_gets(self) -> None:
        """The estimate is sized for the ``--parallel`` the agent passes
        (1 unless the model sets it), not llama-server's own default of 4."""
        facts, _ = self.llama()
        for args, slots in (({}, 1), ({"parallel": 4}, 4), ({"np": 2}, 2)):
            m = model(ctx_size=8192, server_args=args)
            e = estimate(facts, m, "cpu")
            argv = build_argv("llama-server", m, 1)
            given = argv[argv.index("--parallel" if "np" not in args else "-np") + 1]
            self.assertEqual((e.slots, e.to_json()["slots"], int(given), m.parallel), (slots,) * 4, args)

    def test_ctx_size_is_the_total_over_slots(self) -> None:
        facts, _ = self.llama()
        one = estimate(facts, model(ctx_size=8192, server_args={"parallel": 1}), "cpu").kv_cache_bytes
        four = estimate(facts, model(ctx_size=8192, server_args={"parallel": 4}), "cpu").kv_cache_bytes
        self.assertEqual(one, four, "llama-server divides ctx_size among its slots")
        # 8192 / 3 slots is padded to 2816 cells per slot.
        self.assertEqual(kv_cells(facts, model(ctx_size=8192, server_args={"parallel": 3}))[0], 3 * 2816)

    def test_gpu_layers_place_the_last_layers_and_the_output_head(self) -> None:
        facts, total = self.llama()
        everything = estimate(facts, model(ctx_size=4096), "gpu")
        self.assertEqual(everything.weights_bytes, total - facts.other_bytes, "token embeddings stay on the host")
        three = estimate(facts, model(ctx_size=4096, gpu_layers=4), "gpu")
        self.assertEqual(three.weights_bytes, sum(facts.layer_bytes[13:]) + facts.output_bytes)
        self.assertEqual(three.kv_cache_bytes, everything.kv_cache_bytes * 3 // 16)
        none = estimate(facts, model(ctx_size=4096, gpu_layers=0), "gpu")
        self.assertEqual((none.weights_bytes, none.kv_cache_bytes), (0, 0))
        # A cpu device holds everything whatever gpu_layers says.
        self.assertEqual(estimate(facts, model(ctx_size=4096, gpu_layers=0), "cpu").weights_bytes, total)
        host_kv = estimate(facts, model(ctx_size=4096, server_args={"no-kv-offload": True}), "gpu")
        self.assertEqual(host_kv.kv_cache_bytes, 0)

    def test_reserve_is_added(self) -> None:
        facts, _ = self.llama()
        plain = estimate(facts, model(ctx_size=4096), "gpu")
        reserved = estimate(facts, model(ctx_size=4096), "gpu", reserve_bytes=512 * MIB)
        self.assertEqual(reserved.total_bytes - plain.total_bytes, 512 * MIB)
        self.assertEqual(reserved.to_json()["reserve_bytes"], 512 * MIB)
        self.assertEqual(
            plain.total_bytes, plain.weights_bytes + plain.kv_cache_bytes + plain.compute_bytes)

    def test_flash_attention_off_needs_the_score_matrix(self) -> None:
        facts, _ = self.llama()
        on = estimate(facts, model(ctx_size=32768, flash_attn="on"), "gpu").compute_bytes
        off = estimate(facts, model(ctx_size=32768, flash_attn="off"), "gpu").compute_bytes
        self.assertGreaterEqual(off, 4 * 512 * 32768 * 32)
        self.assertLess(on, off)

    # Gemma 3: sliding-window layers (5 of every 6), one KV head of 256.
    def gemma3(self, pattern: Optional[Any] = None) -> GGUFFacts:
        n_layer, n_embd, vocab = 18, 640, 8192
        tensors = [("token_embd.weight", (vocab, n_embd), Q.Q4_K), ("output_norm.weight", (n_embd,), Q.F32)]
        tensors += dense_layers(n_layer, n_embd, 1024, 256, 2048, Q.Q4_K, qk_norm=256)
        keys: Dict[str, Any] = {
            "block_count": n_layer, "embedding_length": n_embd, "feed_forward_length": 2048,
            "attention.head_count": 4, "attention.head_count_kv": 1, "attention.key_length": 256,
            "attention.value_length": 256, "attention.sliding_window": 512, "context_length": 32768,
        }
        if pattern is not None:
            keys["attention.sliding_window_pattern"] = pattern
        path = self.path("gemma3")
        write_header(path, "gemma3", keys, tensors, vocab=vocab)
        return read_facts(path)

    def test_gemma3_sliding_window_layers(self) -> None:
        facts = self.gemma3()
        self.assertEqual((facts.n_swa, facts.key_length, facts.n_head_kv[0]), (512, 256, 1))
        self.assertEqual([il for il in range(18) if not facts.is_swa(il)], [5, 11, 17])
        self.assertEqual(facts.output_bytes, 640 * 4, "tied embeddings: only the norm is an output tensor")
        # Default: the one slot the agent gives llama-server (--parallel 1);
        # the window layers keep window + ubatch cells.
        self.assertEqual(kv_cells(facts, model(ctx_size=32768)), (32768, 1024))
        per_cell = 2 * 256 * 2  # K+V, one head of 256, f16
        e = estimate(facts, model(ctx_size=32768), "cpu")
        self.assertEqual(e.kv_cache_bytes, per_cell * (3 * 32768 + 15 * 1024))
        # 4 slots over one unified cache: window x 4 + ubatch cells.
        self.assertEqual(
            kv_cells(facts, model(ctx_size=32768, server_args={"parallel": 4, "kv-unified": True})), (32768, 2560))
        # Explicit slots that do not share a cache: a window per slot.
        self.assertEqual(kv_cells(facts, model(ctx_size=32768, server_args={"parallel": 2})), (32768, 2 * 1024))
        self.assertEqual(
            kv_cells(facts, model(ctx_size=32768, server_args={"parallel": 2, "kv-unified": True})), (32768, 1536))
        # --swa-full keeps the whole context on every layer.
        self.assertEqual(kv_cells(facts, model(ctx_size=32768, server_args={"swa-full": True})), (32768, 32768))
        # A context smaller than the window: the window layers hold it all.
        self.assertEqual(kv_cells(facts, model(ctx_size=512)), (512, 512))

    def test_sliding_window_pattern_from_the_header(self) -> None:
        facts = self.gemma3(pattern=[True, False] * 9)
        self.assertEqual([il for il in range(18) if not facts.is_swa(il)], list(range(1, 18, 2)))

    # Qwen2 (biases on q/k/v) and Qwen3 (an explicit key_length that is not
    # n_embd / n_head, and q/k norms).
    def test_qwen2_and_qwen3(self) -> None:
        path = self.path("qwen2")
        total = write_header(path, "qwen2", {
            "block_count": 24, "embedding_length": 896, "feed_forward_length": 4864,
            "attention.head_count": 14, "attention.head_count_kv": 2, "context_length": 32768,
        }, [("token_embd.weight", (1024, 896), Q.Q8_0), ("output_norm.weight", (896,), Q.F32)]
            + dense_layers(24, 896, 896, 128, 4864, Q.Q8_0, bias=True), vocab=1024)
        qwen2 = read_facts(path)
        self.assertEqual((qwen2.key_length, qwen2.n_head_kv[0]), (64, 2))
        self.assertEqual(qwen2.weight_bytes, total)
        self.assertEqual(estimate(qwen2, model(ctx_size=4096), "cpu").kv_cache_bytes, 24 * 2 * 2 * 64 * 4096 * 2)

        path = self.path("qwen3")
        write_header(path, "qwen3", {
            "block_count": 28, "embedding_length": 1024, "feed_forward_length": 3072,
            "attention.head_count": 16, "attention.head_count_kv": 8, "attention.key_length": 128,
            "attention.value_length": 128, "context_length": 40960,
        }, [("token_embd.weight", (1024, 1024), Q.F16), ("output_norm.weight", (1024,), Q.F32)]
            + dense_layers(28, 1024, 2048, 1024, 3072, Q.F16, qk_norm=128), vocab=1024)
        qwen3 = read_facts(path)
        self.assertEqual((qwen3.key_length, qwen3.n_head_kv[0], qwen3.n_ctx_train), (128, 8, 40960))
        self.assertEqual(estimate(qwen3, model(ctx_size=4096), "cpu").kv_cache_bytes, 28 * 2 * 8 * 128 * 4096 * 2)

    # A mixture of experts (qwen3moe): the experts' tensors are weights like
    # any other; all of them are loaded, whatever expert_used_count says.
    def test_moe(self) -> None:
        n_layer, n_embd, n_expert, n_ff_exp = 4, 512, 16, 256
        tensors: List[Tensor] = [("token_embd.weight", (2048, n_embd), Q.Q4_K),
                                 ("output_norm.weight", (n_embd,), Q.F32), ("output.weight", (2048, n_embd), Q.Q6_K)]
        for b in range(n_layer):
            p = f"blk.{b}."
            tensors += [
                (p + "attn_norm.weight", (n_embd,), Q.F32),
                (p + "attn_q.weight", (1024, n_embd), Q.Q4_K),
                (p + "attn_k.weight", (256, n_embd), Q.Q4_K),
                (p + "attn_v.weight", (256, n_embd), Q.Q6_K),
                (p + "attn_output.weight", (n_embd, 1024), Q.Q4_K),
                (p + "ffn_norm.weight", (n_embd,), Q.F32),
                (p + "ffn_gate_inp.weight", (n_expert, n_embd), Q.F32),
                (p + "ffn_gate_exps.weight", (n_expert, n_ff_exp, n_embd), Q.Q4_K),
                (p + "ffn_up_exps.weight", (n_expert, n_ff_exp, n_embd), Q.Q4_K),
                (p + "ffn_down_exps.weight", (n_expert, n_embd, n_ff_exp), Q.Q6_K),
            ]
        path = self.path("moe")
        total = write_header(path, "qwen3moe", {
            "block_count": n_layer, "embedding_length": n_embd, "expert_count": n_expert,
            "expert_used_count": 4, "expert_feed_forward_length": n_ff_exp, "attention.head_count": 8,
            "attention.head_count_kv": 2, "attention.key_length": 128, "attention.value_length": 128,
            "context_length": 32768,
        }, tensors, vocab=2048)
        facts = read_facts(path)
        self.assertEqual((facts.n_expert, facts.n_expert_used), (n_expert, 4))
        self.assertEqual(facts.weight_bytes, total)
        experts = 3 * n_expert * n_ff_exp * n_embd
        self.assertGreater(facts.layer_bytes[0], experts * 144 // 256, "every expert counts")
        e = estimate(facts, model(ctx_size=2048), "gpu", reserve_bytes=MIB)
        self.assertEqual(e.weights_bytes, total - facts.other_bytes)
        self.assertEqual(e.kv_cache_bytes, n_layer * 2 * 2 * 128 * 2048 * 2)

    def test_per_layer_head_counts(self) -> None:
        path = self.path("perlayer")
        write_header(path, "llama", {
            "block_count": 3, "embedding_length": 256, "attention.head_count": 4,
            "attention.head_count_kv": [4, 0, 2],  # a layer without attention (hybrid models)
        }, dense_layers(3, 256, 256, 256, 512, Q.F16))
        facts = read_facts(path)
        self.assertEqual(facts.n_head_kv, (4, 0, 2))
        self.assertEqual(estimate(facts, model(ctx_size=256), "cpu").kv_cache_bytes, (4 + 2) * 64 * 2 * 256 * 2)


class Failures(SynchronousTestCase):
    def test_unreadable_files_are_one_line_errors(self) -> None:
        directory = self.mktemp()
        os.makedirs(directory)
        empty = os.path.join(directory, "empty.gguf")
        open(empty, "wb").close()
        garbage = os.path.join(directory, "garbage.gguf")
        with open(garbage, "wb") as f:
            f.write(b"not a gguf at all" * 10)
        truncated = os.path.join(directory, "truncated.gguf")
        with open(truncated, "wb") as f:
            f.write(b"GGUF\x03\x00\x00\x00" + b"\x05" + b"\x00" * 7 + b"\xff" * 12)
        no_arch = os.path.join(directory, "noarch.gguf")
        writer = gguf.GGUFWriter(no_arch, "llama")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        for path in (os.path.join(directory, "missing.gguf"), empty, garbage, truncated, no_arch):
            with self.assertRaises(EstimateError) as caught:
                read_facts(path)
            message = str(caught.exception)
            self.assertIn(path, message)
            self.assertNotIn("\n", message)


FACTS = GGUFFacts("llama", 8, 512, (8,) * 8, (2,) * 8, 64, 64, 1000, 4096,
                  layer_bytes=(1 << 20,) * 8, output_bytes=1 << 19, other_bytes=1 << 19)


class Properties(SynchronousTestCase):
    @given(a=st.integers(1, 1 << 20), b=st.integers(1, 1 << 20),
           slots=st.sampled_from([None, 1, 2, 3, 8]), kind=st.sampled_from(["cpu", "gpu"]))
    def test_more_context_never_needs_less(self, a: int, b: int, slots: Optional[int], kind: str) -> None:
        lo, hi = sorted((a, b))
        args = {} if slots is None else {"parallel": slots}
        small = estimate(FACTS, model(ctx_size=lo, server_args=args), kind)
        large = estimate(FACTS, model(ctx_size=hi, server_args=args), kind)
        self.assertLessEqual(small.kv_cache_bytes, large.kv_cache_bytes)
        self.assertLessEqual(small.total_bytes, large.total_bytes)
        self.assertGreaterEqual(small.ctx_cells, lo - 256 * (slots or 1))

    @given(a=st.integers(0, 12), b=st.integers(0, 12))
    def test_more_gpu_layers_never_need_less(self, a: int, b: int) -> None:
        lo, hi = sorted((a, b))
        small = estimate(FACTS, model(ctx_size=1024, gpu_layers=lo), "gpu")
        large = estimate(FACTS, model(ctx_size=1024, gpu_layers=hi), "gpu")
        self.assertLessEqual(small.total_bytes, large.total_bytes)
        self.assertLessEqual(large.weights_bytes, FACTS.weight_bytes)
        self.assertEqual(offloaded_layers(FACTS, hi), min(hi, 9))

    def test_gib(self) -> None:
        self.assertEqual(gib(3 << 29), "1.50 GiB")
        self.assertEqual(gib(12 * MIB), "12.0 MiB")
        self.assertEqual(gib(None), "unknown")


class RuntimeTests(SynchronousTestCase):
    """What a child takes on a GPU beyond its buffers (measured on an H200:
    tests/integration/test_cuda_real.py), once per device it spans."""

    def test_cuda_adds_the_runtime_once_per_device(self) -> None:
        one = estimate_on(FACTS, model(ctx_size=1024), "cuda", 1, 0)
        two = estimate_on(FACTS, model(ctx_size=1024), "cuda", 2, MIB)
        plain = estimate(FACTS, model(ctx_size=1024), "gpu")
        self.assertEqual(one.runtime_bytes, RUNTIME_BYTES["cuda"])
        self.assertEqual(one.total_bytes, plain.total_bytes + RUNTIME_BYTES["cuda"])
        self.assertEqual((two.runtime_bytes, two.reserve_bytes), (2 * RUNTIME_BYTES["cuda"], 2 * MIB))
        self.assertEqual(one.to_json()["runtime_bytes"], RUNTIME_BYTES["cuda"])
        self.assertIn(f"runtime {gib(RUNTIME_BYTES['cuda'])}", one.describe())

    def test_unmeasured_backends_and_the_cpu_add_none(self) -> None:
        for backend in ("cpu", "rocm", "vulkan", "sycl", "metal"):
            need = estimate_on(FACTS, model(ctx_size=1024), backend, 2, 0)
            self.assertEqual(need.runtime_bytes, 0, backend)
            self.assertNotIn("runtime", need.describe())
