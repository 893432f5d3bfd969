"""Build a ``llama-server`` argument vector from a model entry.

A pure function, so the mapping can be checked exhaustively: structured fields
become the current llama-server flags, ``server_args`` follow in config order,
the agent's own ``--model/--host/--port`` and ``--metrics`` come first, then
``--parallel 1`` where the model does not set ``parallel`` itself (without
it this llama-server makes 4 slots while the agent admits one request at a
time: the slots the child has, the estimate and what the agent admits are
one figure, ``ModelConfig.parallel``), and device defaults (the cpu backend's ``--cpu-range`` and ``--threads``) apply
only where the model did not set the flag itself.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence

from rolemesh.children.chat_templates import template_args
from rolemesh.config.file import DRAFT_FLAGS, STRUCTURED_FLAGS, ModelConfig, normalize_flag

#: Flags whose list values llama-server takes comma-joined; any other list
#: repeats the flag once per element (``--lora a --lora b``).
JOINED_LIST_FLAGS = frozenset({"tensor-split", "ts", "device", "dev", "override-tensor", "ot"})

CHILD_HOST = "127.0.0.1"

#: Every child serves ``/metrics`` (off by default in llama-server); ``/slots``
#: is on by default.  The agent samples both (:mod:`rolemesh.children.telemetry`).
TELEMETRY_FLAGS = ("--metrics",)


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def structured_args(model: ModelConfig) -> List[str]:
    """The flags the model's structured fields set, in a fixed order."""
    argv: List[str] = ["--alias", model.served_name]
    for field, flags in STRUCTURED_FLAGS.items():
        if field == "alias":
            continue
        value = getattr(model, field)
        if value is None:
            continue
        if field == "tensor_split":
            value = ",".join(_number(v) for v in value)
        argv += ["--" + flags[0], _number(value)]
    # a chat template (a built-in name or a file: rolemesh.children.chat_templates), adapters and a draft
    return argv + template_args(model.chat_template) + adapter_and_draft_args(model)


#: The speculative decoding the agent turns on with ``draft_model`` (this
#: llama-server loads a draft given only ``--spec-draft-model`` but drafts
#: nothing until ``--spec-type`` names a type).
DRAFT_SPEC_TYPE = "draft-simple"


def adapter_and_draft_args(model: ModelConfig) -> List[str]:
    """``lora_adapters``: every adapter loaded, none applied (the agent
    sets each request's scales, :mod:`rolemesh.children.adapters`), by index in this
    order; the draft fields: the draft model and how much it drafts."""
    argv: List[str] = []
    if model.lora_adapters:
        argv += ["--lora", ",".join(a.path for a in model.lora_adapters), "--lora-init-without-apply"]
    if model.draft_model is None:
        return argv
    for field, flags in DRAFT_FLAGS.items():
        value = getattr(model, field)
        if value is not None:
            argv += ["--" + flags[0], _number(value)]
    if not any(flag == "spec-type" and value not in (None, False) for flag, value in model.server_args):
        argv += ["--spec-type", DRAFT_SPEC_TYPE]
    return argv


#: The two spellings of llama-server's slot count.
SLOT_FLAGS = frozenset({"parallel", "np"})


#: Flags of three letters or fewer that llama-server only knows in long form.
LONG_ONLY_FLAGS = frozenset({"rpc"})


def _spelling(flag: str) -> str:
    """llama.cpp spells short flags with one dash (``-ngl``, ``-np``, ``-c``)."""
    if len(flag) <= 3 and "-" not in flag and flag not in LONG_ONLY_FLAGS:
        return "-" + flag
    return "--" + flag


def server_args(pairs: Sequence[tuple]) -> List[str]:
    """``true`` -> bare flag, ``false``/null -> omitted, lists repeat or join."""
    argv: List[str] = []
    for flag, value in pairs:
        if value is None or value is False:
            continue
        name = _spelling(flag)
        if value is True:
            argv.append(name)
        elif isinstance(value, (list, tuple)):
            if flag in JOINED_LIST_FLAGS:
                argv += [name, ",".join(_number(v) for v in value)]
            else:
                for v in value:
                    argv += [name, _number(v)]
        else:
            argv += [name, _number(value)]
    return argv


def flags_set_by(model: ModelConfig) -> frozenset:
    """Every flag spelling the model already sets (structured or server_args)."""
    names: set = set()
    for field, flags in STRUCTURED_FLAGS.items():
        if field == "alias" or getattr(model, field) is not None:
            names.update(flags)
    for flag, value in model.server_args:
        if value is not None and value is not False:
            names.add(flag)
    return frozenset(names)


def build_argv(
    binary: str,
    model: ModelConfig,
    port: int,
    host: str = CHILD_HOST,
    device_defaults: Optional[Mapping[str, Any]] = None,
) -> List[str]:
    """The full argv for one child: binary, agent-owned flags, model flags.

    ``device_defaults`` maps flag names (e.g. ``threads``, ``cpu-range``) to
    values the device backend wants unless the model sets them itself.
    """
    argv = [binary, "--model", model.path, "--host", host, "--port", str(port)] + list(TELEMETRY_FLAGS)
    if not flags_set_by(model) & SLOT_FLAGS:
        argv += ["--parallel", str(model.parallel)]  # the agent's default (1): ModelConfig.parallel
    argv += structured_args(model)
    argv += server_args(model.server_args)
    if device_defaults:
        already = set(flags_set_by(model))
        aliases = {flag: set(flags) for flags in STRUCTURED_FLAGS.values() for flag in flags}
        extra = []
        for key, value in device_defaults.items():
            flag = normalize_flag(key)
            spellings = aliases.get(flag, {flag})
            if already & spellings:
                continue
            if value is not None and value is not False:
                # One flag once, even if the defaults name it twice (``threads`` and ``t``).
                already |= spellings
            extra.append((flag, value))
        argv += server_args(extra)
    return argv
