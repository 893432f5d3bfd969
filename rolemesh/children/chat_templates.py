"""Which chat template a model's child uses, said out loud.

llama-server takes the template from the GGUF's ``tokenizer.chat_template``;
a GGUF without one (the demo's Gemma 3 270M) makes it fall back to ChatML,
and chat answers then carry ``<|im_end|>``.  A model's ``chat_template``
field is a built-in template name (passed as ``--chat-template NAME`` with
``--no-jinja``: with jinja on, this llama-server takes the name itself as
the whole template) or a Jinja file (``--chat-template-file PATH``).

:mod:`rolemesh.config.template_names` holds the names (the config's check,
``chat_template`` in :mod:`rolemesh.config.file`, uses them), :func:`template_args`
the flags, :func:`describe` (reads the GGUF header, cached per file version)
what ``--check``, the inventory and the load warning say.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

from rolemesh.config.template_names import BUILT_IN, FALLBACK, FLAGS, is_file
from rolemesh.scheduling.estimate import EstimateError, parse_header

__all__ = ["BUILT_IN", "FALLBACK", "FLAGS", "describe", "describe_model", "gguf_has_template", "is_file",
           "summary", "template_args"]


def template_args(value: Optional[str]) -> List[str]:
    """llama-server flags for a ``chat_template`` value."""
    if value is None:
        return []
    if is_file(value):
        return ["--chat-template-file", value]
    return ["--no-jinja", "--chat-template", value]


_GGUF_TEMPLATE: Dict[Tuple[str, int, int], Optional[bool]] = {}


def gguf_has_template(path: str) -> Optional[bool]:
    """Whether the GGUF at ``path`` carries ``tokenizer.chat_template``
    (None: its header cannot be read); cached per (path, size, mtime)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (path, st.st_size, st.st_mtime_ns)
    if key not in _GGUF_TEMPLATE:
        import mmap

        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                kv, _ = parse_header(buf)
            found: Optional[bool] = bool(kv.get("tokenizer.chat_template"))
        except (OSError, ValueError, EstimateError, IndexError, TypeError, Exception):  # noqa: BLE001
            found = None
        if len(_GGUF_TEMPLATE) > 256:
            _GGUF_TEMPLATE.clear()
        _GGUF_TEMPLATE[key] = found
    return _GGUF_TEMPLATE[key]


def describe(field: Optional[str], has_template: Optional[bool]) -> Dict[str, Any]:
    """Which template a model uses (pure): ``{"source", "template",
    "warning"}`` -- source ``config`` (the field), ``gguf`` (the file's own),
    ``fallback`` (none: llama-server's ChatML) or ``unknown`` (header
    unreadable)."""
    if field is not None:
        kind = "file" if is_file(field) else "built-in"
        return {"source": "config", "template": field, "kind": kind, "warning": None}
    if has_template:
        return {"source": "gguf", "template": "tokenizer.chat_template", "kind": "gguf", "warning": None}
    if has_template is None:
        return {"source": "unknown", "template": None, "kind": None, "warning": None}
    return {"source": "fallback", "template": FALLBACK, "kind": "built-in",
            "warning": "the GGUF has no tokenizer.chat_template and no chat_template is set: llama-server "
                       f"falls back to {FALLBACK} (chat answers may carry <|im_end|>); set chat_template"}


def describe_model(model: Any) -> Dict[str, Any]:
    """:func:`describe` for a ModelConfig (reads its GGUF header unless the field is set)."""
    field = getattr(model, "chat_template", None)
    return describe(field, None if field is not None else gguf_has_template(model.path))


def summary(info: Dict[str, Any]) -> str:
    """One phrase: what ``--check`` prints after the model id."""
    if info["source"] == "config":
        return f"{info['template']} ({info['kind']}, from chat_template)"
    if info["source"] == "gguf":
        return "the GGUF's own (tokenizer.chat_template)"
    if info["source"] == "fallback":
        return f"{FALLBACK} (llama-server's fallback: the GGUF has none; set chat_template)"
    return "unknown (the GGUF header cannot be read)"
