"""Configuration: load YAML, merge an override over it, validate into records.

Each key is declared once, as a field of :class:`NodeConfig` or
:class:`ModelConfig` made by :func:`key`: its check, its default and its
documentation row live side by side.  Validation, the records and the tables
in ``docs/configuration.md`` (``TOP_LEVEL_KEYS`` / ``MODEL_KEYS``, checked by
a test) all come from those declarations, so they cannot drift.  Fields
computed from several keys (``api_keys``, the listener, ``models``,
``preload``) are :func:`derived` and filled by a named step.

Validation runs in two steps.  :func:`parse` is pure -- plain data in, a
frozen record out, no I/O -- so hypothesis can hammer it.
:func:`check_environment` then does everything that asks the host: the host
name and FQDN, ``$PATH``, environment variables, the home directory, model
files and key files.  Every mistake raises
:class:`~rolemesh.base.errors.ConfigError` with one line naming the exact key path
and the bad value, e.g. ``models[1].ctx_size: expected a positive integer,
got "big"``.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import math
import os
import re
import shutil
import socket
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Type, Union

import attr
import yaml

from rolemesh.base.errors import ConfigError
from rolemesh.config import template_names as chat_template_names
from rolemesh.config import vertex_ai
from rolemesh.config.tls import ClientTLSFiles, ServerTLSFiles, escape_endpoint_value, split_endpoint_description

PLACEHOLDER_PREFIX = "/path/to/"
#: Every device backend (rolemesh.backends); ``backend:`` may also say ``auto``
#: (resolved by :func:`rolemesh.backends.detect.select_backend`).
BACKEND_NAMES = ("cuda", "rocm", "metal", "sycl", "vulkan", "cpu")
BACKENDS = ("auto", *BACKEND_NAMES)
LOG_FORMATS = ("text", "json")


def is_loopback(host: str) -> bool:
    """Whether ``host`` -- a name or an address, IPv6 with or without
    brackets -- is this machine's loopback: 127.0.0.0/8, ::1, ``localhost``
    and ``*.localhost`` (RFC 6761).  The one test of it: the listener's
    missing-key warning and the dispatcher's plain-HTTP warning both ask it."""
    name = host.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
SECRET_KEYS = frozenset({"api_key", "api_keys", "dispatcher_token"})

#: A pure value check: ``(key path, value) -> value to store``, raising ConfigError.
Check = Callable[[str, Any], Any]


# --------------------------------------------------------------------------
# Value checks (pure)


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _fail(path: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"{path}: expected {expected}, got {_show(value)}")


def _key_name(key: Any) -> str:
    """A key as it appears in a key path; quoted when it would not read as one line."""
    text = str(key)
    return text if text and text.isprintable() else _show(key)


def _unknown_keys(data: Mapping[str, Any], known: Tuple[KeyDoc, ...], prefix: str) -> None:
    names = [k.name for k in known]
    for key in data:
        if key not in names:
            hint = difflib.get_close_matches(str(key), names, n=1)
            suggestion = f' (did you mean "{hint[0]}"?)' if hint else ""
            raise ConfigError(f"{prefix}{_key_name(key)}: unknown key{suggestion}")


def _positive_int(path: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _fail(path, "a positive integer", value)
    return value


def _non_negative_int(path: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _fail(path, "a non-negative integer", value)
    return value


def _positive_number(path: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise _fail(path, "a positive number", value)
    return float(value)


def _non_negative_number(path: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise _fail(path, "a non-negative number", value)
    return float(value)


def _boolean(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(path, "true or false", value)
    return value


def _string(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(path, "a non-empty string", value)
    if value.startswith(PLACEHOLDER_PREFIX):
        raise ConfigError(
            f"{path}: placeholder value {_show(value)} is still in place; "
            "set a real value (e.g. in a --config-override file)"
        )
    return value


def _hosts(path: str, value: Any) -> Tuple[str, ...]:
    """The addresses to listen on: one, a list, or llama-server's ``a,b``."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list) and not isinstance(value, str):
        raise _fail(path, "an address or a list of addresses", value)
    hosts: List[str] = []
    for i, item in enumerate(items):
        here = path if isinstance(value, str) else f"{path}[{i}]"
        host = _string(here, item.strip() if isinstance(item, str) else item)
        if any(c.isspace() for c in host):
            raise ConfigError(f"{here}: an address (a host name or an IP) has no spaces: {_show(item)}")
        if host not in hosts:
            hosts.append(host)
    if not hosts:
        raise _fail(path, "an address or a list of addresses", value)
    return tuple(hosts)


def _several_hosts(value: Any) -> Tuple[str, ...]:
    """``listen_hosts``: every address when there are several, else ()."""
    hosts = _hosts("listen_host", value) if value is not None else ()
    return hosts if len(hosts) > 1 else ()


def _host(path: str, value: Any) -> str:
    """The first address (``listen_hosts`` has them all)."""
    return _hosts(path, value)[0]


def _string_list(path: str, value: Any) -> Tuple[str, ...]:
    if not isinstance(value, list):
        raise _fail(path, "a list of strings", value)
    return tuple(_string(f"{path}[{i}]", v) for i, v in enumerate(value))


def _url(path: str, value: Any) -> str:
    value = _string(path, value)
    if not (value.startswith("http://") or value.startswith("https://")) or len(value.split("://", 1)[1]) == 0:
        raise _fail(path, "an http:// or https:// URL", value)
    return value.rstrip("/")


def _choice(path: str, value: Any, choices: Tuple[str, ...]) -> str:
    if value not in choices:
        raise _fail(path, "one of " + ", ".join(choices), value)
    return value


def _optional(
    data: Mapping[str, Any], key: str, prefix: str, check: Callable[[str, Any], Any]
) -> Any:
    value = data.get(key)
    return None if value is None else check(prefix + key, value)




def _port(path: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise _fail(path, "a port number 0-65535", value)
    return value


def _one_of(*choices: str) -> Check:
    return lambda path, value: _choice(path, value, choices)


def _device_allow_list(path: str, value: Any) -> Tuple[str, ...]:
    devices = _string_list(path, value)
    if not devices:
        raise _fail(path, "a non-empty list of device names (or leave it unset)", [])
    return devices


#: ``cpu_devices``: ``"numa"`` (one device per NUMA node) or a number of core groups.
CpuDevices = Union[str, int]


def check_cpu_devices(path: str, value: Any) -> CpuDevices:
    """``cpu_devices``: ``"numa"`` or a positive integer (the config and the cpu backend both use this)."""
    if value == "numa":
        return "numa"
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _fail(path, '"numa" or a positive integer', value)
    return value


def _roles(path: str, value: Any) -> Tuple[str, ...]:
    return _string_list(path, value or [])


def _names(path: str, value: Any) -> Tuple[str, ...]:
    """A list of names or labels; llama-server's comma-separated string is taken too."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    return tuple(dict.fromkeys(_string_list(path, value or [])))  # _string refuses an empty one


def _model_devices(path: str, value: Any) -> Tuple[str, ...]:
    devices = _string_list(path, value or [])
    for j, name in enumerate(devices):
        if name in devices[:j]:
            raise ConfigError(f"{path}[{j}]: {_show(name)} is listed twice")
    return devices


def _gpu_layers(path: str, value: Any) -> Any:
    return value if value in ("auto", "all") else _non_negative_int(path, value)


def _tensor_split(path: str, value: Any) -> Tuple[float, ...]:
    if not isinstance(value, list) or not value or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in value
    ):
        raise _fail(path, "a non-empty list of non-negative numbers", value)
    return tuple(value)


def _chat_template(path: str, value: Any) -> str:
    """``chat_template``: a built-in name, or a path (with a ``/`` or a
    ``.jinja``-like suffix); anything else is a one-line error."""
    value = _string(path, value)
    names = chat_template_names.BUILT_IN
    if value in names:
        return value
    if os.sep in value or "/" in value or value.lower().endswith(chat_template_names.FILE_SUFFIXES):
        return value
    hint = difflib.get_close_matches(value, sorted(names), n=1)
    suggestion = f' (did you mean "{hint[0]}"?)' if hint else ""
    raise ConfigError(
        f"{_fail(path, 'a built-in template name or a template file path', value)}{suggestion}; "
        "built-in names: llama-server --help, --chat-template")


def _models_dir(path: str, value: Any) -> Tuple[str, ...]:
    """``models_dir``: one folder or a list of them."""
    if isinstance(value, str):
        return (_string(path, value),)
    if isinstance(value, list) and value:
        return _string_list(path, value)
    raise _fail(path, "a folder path or a non-empty list of folder paths", value)


def _flash_attn(path: str, value: Any) -> str:
    if value is True:
        return "on"
    if value is False:
        return "off"
    return _choice(path, value, ("on", "off", "auto"))


# --------------------------------------------------------------------------
# LoRA adapters and draft models (issue 28): their records and checks


@attr.s(auto_attribs=True, frozen=True)
class LoraAdapter:
    """One ``lora_adapters`` entry: served as the model ``id`` by its base
    model's child (loaded at start, applied per request with ``scale``)."""

    id: str
    path: str
    scale: float = 1.0


#: The keys of a ``lora_adapters`` entry.
LORA_ADAPTER_KEYS = ("id", "path", "scale")


def _lora_adapters(path: str, value: Any) -> Tuple[LoraAdapter, ...]:
    if not isinstance(value, list):
        raise _fail(path, "a list of {id, path, scale} mappings", value)
    adapters: List[LoraAdapter] = []
    for i, entry in enumerate(value):
        here = f"{path}[{i}]"
        if not isinstance(entry, dict):
            raise _fail(here, "a mapping with id, path and scale", entry)
        for name in entry:
            if name not in LORA_ADAPTER_KEYS:
                hint = difflib.get_close_matches(str(name), LORA_ADAPTER_KEYS, n=1)
                suggestion = f' (did you mean "{hint[0]}"?)' if hint else " (expected id, path, scale)"
                raise ConfigError(f"{here}.{_key_name(name)}: unknown key{suggestion}")
        for name in ("id", "path"):
            if entry.get(name) is None:
                raise ConfigError(f"{here}.{name}: required")
        adapter_id = _string(f"{here}.id", entry["id"])
        file = _string(f"{here}.path", entry["path"])
        if "," in file:
            raise ConfigError(f"{here}.path: {_show(file)} has a comma, and llama-server takes its adapter "
                              "paths comma-separated (--lora a,b); rename the file")
        scale = entry.get("scale")
        if scale is None:
            scale = 1.0
        elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise _fail(f"{here}.scale", "a number", scale)
        for j, other in enumerate(adapters):
            if other.id == adapter_id:
                raise ConfigError(f"{here}.id: duplicate adapter id {_show(adapter_id)} (also {path}[{j}].id)")
        adapters.append(LoraAdapter(adapter_id, file, float(scale)))
    return tuple(adapters)


#: The llama-server flags the draft fields set (every spelling, the first is
#: passed) and those ``lora_adapters`` sets; ``server_args`` may not set them
#: again where the field is set.  ``spec-type`` is the agent's
#: ``draft-simple`` unless ``server_args`` names other types.
DRAFT_FLAGS: Dict[str, Tuple[str, ...]] = {
    "draft_model": ("spec-draft-model", "md", "model-draft"),
    "draft_max": ("spec-draft-n-max", "draft-max", "draft", "draft-n"),
    "draft_min": ("spec-draft-n-min", "draft-min", "draft-n-min"),
    "draft_gpu_layers": ("spec-draft-ngl", "ngld", "gpu-layers-draft", "n-gpu-layers-draft"),
}
LORA_FLAGS = ("lora", "lora-scaled", "lora-init-without-apply")


def _adapters_and_draft(prefix: str, model: "ModelConfig") -> None:
    """The draft fields need ``draft_model`` and agree with each other, and
    ``server_args`` does not set a flag these fields set."""
    if model.draft_model is None:
        for name in ("draft_max", "draft_min", "draft_gpu_layers"):
            if getattr(model, name) is not None:
                raise ConfigError(f"{prefix}{name}: only used with draft_model (the draft GGUF); set it too")
    elif model.draft_max is not None and model.draft_min is not None and model.draft_min > model.draft_max:
        raise ConfigError(f"{prefix}draft_min: {model.draft_min} is more than draft_max ({model.draft_max})")
    if model.max_replicas is not None and model.min_replicas > model.max_replicas:
        raise ConfigError(f"{prefix}min_replicas: {model.min_replicas} is more than max_replicas "
                          f"({model.max_replicas})")
    if model.min_replicas > 1 and len(model.devices) >= 1:
        raise ConfigError(f"{prefix}min_replicas: a model with `devices` runs on one device (or one group); "
                          "drop min_replicas or devices")
    owners = {flag: name for name, flags in DRAFT_FLAGS.items() for flag in flags}
    owners.update({flag: "lora_adapters" for flag in LORA_FLAGS})
    for flag, value in model.server_args:
        field = owners.get(flag)
        if field is not None and getattr(model, field) not in (None, ()) and value is not None and value is not False:
            raise ConfigError(f"{prefix}server_args.{flag}: conflicts with the structured field {prefix}{field}; "
                              "set it in one place")


# --------------------------------------------------------------------------
# Key declarations

#: attrs metadata naming the configuration keys a record field is read from.
_KEYS = "rolemesh.config.file.keys"


@attr.s(auto_attribs=True, frozen=True)
class KeyDoc:
    """One configuration key: its documentation row and how a value is checked."""

    name: str
    type: str
    default: str
    meaning: str
    #: The pure check of one value; None = a named derivation step reads the key.
    check: Optional[Check] = attr.ib(default=None, eq=False, repr=False)
    #: ``null`` means "the default" (otherwise null is checked, and refused, like any value).
    nullable: bool = False
    #: Absent or null is an error ("required").
    required: bool = False


def render_default(value: Any) -> str:
    """A default value as the documentation table shows it."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, tuple):
        return "`[" + ", ".join(json.dumps(v) for v in value) + "]`"
    return f"`{value}`"


def key(
    default: Any,
    check: Check,
    type_doc: str,
    meaning: str,
    *,
    default_doc: Optional[str] = None,
    nullable: Optional[bool] = None,
    required: bool = False,
    **attrib: Any,
) -> Any:
    """A record field that is exactly one configuration key of the same name.

    ``default_doc`` is for defaults the value alone does not say (``None``
    meaning "llama-server's", ``""`` meaning "the host name"); otherwise the
    documented default is rendered from ``default`` itself.  Null means the
    default when ``nullable`` (by default: when the default is None).
    """
    doc = KeyDoc(
        "",
        type_doc,
        render_default(default) if default_doc is None else default_doc,
        meaning,
        check,
        default is None if nullable is None else nullable,
        required,
    )
    return attr.ib(default=default, metadata={_KEYS: (doc,)}, **attrib)


def derived(default: Any, *keys: KeyDoc, **attrib: Any) -> Any:
    """A record field a named step computes from the documented ``keys``
    (none: from other fields)."""
    return attr.ib(default=default, metadata={_KEYS: keys}, **attrib)


def key_docs(record: Type[Any]) -> Tuple[KeyDoc, ...]:
    """Every configuration key ``record`` is read from, in field order."""
    return tuple(
        doc if doc.name else attr.evolve(doc, name=field.name)
        for field in attr.fields(record)
        for doc in field.metadata.get(_KEYS, ())
    )


def plain_key(field: Any) -> Optional[KeyDoc]:
    """The one key a field is checked from on its own, or None for derived fields."""
    docs = field.metadata.get(_KEYS, ())
    return docs[0] if len(docs) == 1 and docs[0].check is not None else None


# --------------------------------------------------------------------------
# The records


@attr.s(auto_attribs=True, frozen=True, cache_hash=True)  # a key of per-request caches (node.estimate_for)
class ModelConfig:
    """One validated ``models[]`` entry."""

    model_id: str = key(attr.NOTHING, _string, "string", "Name clients use; also the child's `--alias` by default.",
                        default_doc="required", required=True)
    path: str = key(attr.NOTHING, _string, "path", "The exact GGUF file.", default_doc="required", required=True)
    roles: Tuple[str, ...] = key((), _roles, "list of strings",
                                 "Roles this model can satisfy (clients may ask for a role).", nullable=True)
    alias: Optional[str] = key(None, _string, "string", "Another name for the model; passed as `--alias`.",
                               default_doc="the `model_id`")
    aliases: Tuple[str, ...] = key((), _names, "list of strings",
                                   "More names clients may use (llama-server's `--alias a,b,c`); listed in "
                                   "`/v1/models` as `aliases`, the node resolves them (the child answers to "
                                   "`alias`).", nullable=True)
    tags: Tuple[str, ...] = key((), _names, "list of strings",
                                "Free labels listed in `/v1/models` as `tags` (llama-server's `--tags`).",
                                nullable=True)
    ctx_size: Optional[int] = key(None, _positive_int, "positive integer", "`--ctx-size`",
                                  default_doc="llama-server's")
    batch_size: Optional[int] = key(None, _positive_int, "positive integer", "`--batch-size`",
                                    default_doc="llama-server's")
    ubatch_size: Optional[int] = key(None, _positive_int, "positive integer", "`--ubatch-size`",
                                     default_doc="llama-server's")
    threads: Optional[int] = key(None, _positive_int, "positive integer", "`--threads`",
                                 default_doc="the device's core count (cpu) or llama-server's")
    threads_batch: Optional[int] = key(None, _positive_int, "positive integer", "`--threads-batch`",
                                       default_doc="llama-server's")
    gpu_layers: Optional[Any] = key(None, _gpu_layers, "non-negative integer, `auto` or `all`", "`--n-gpu-layers`",
                                    default_doc="llama-server's")
    main_gpu: Optional[int] = key(None, _non_negative_int, "non-negative integer", "`--main-gpu`",
                                  default_doc="llama-server's")
    tensor_split: Optional[Tuple[float, ...]] = key(
        None, _tensor_split, "list of non-negative numbers", "`--tensor-split a,b,...`",
        default_doc="the devices' memory ratio on a device group, else llama-server's")
    #: The devices the model runs on (one: pinned; several: a device group);
    #: empty = any single device.
    devices: Tuple[str, ...] = key(
        (), _model_devices, "list of device names",
        "The devices this model runs on. One name pins it there; several make a device group: one child "
        "spans them all (pinned to all of them) and holds every member while it runs.",
        default_doc="any one device", nullable=True)
    flash_attn: Optional[str] = key(None, _flash_attn, "boolean or `on`/`off`/`auto`",
                                    "`--flash-attn on|off|auto`; `true` means `on`, `false` means `off`.",
                                    default_doc="llama-server's")
    #: LoRA adapters and a draft model (issue 28): see docs/configuration.md.
    lora_adapters: Tuple[LoraAdapter, ...] = key(
        (), _lora_adapters, "list of `{id, path, scale}`",
        "LoRA adapters (GGUF) of this model, each served as the model `id`: one child loads them all (not "
        "applied) and the agent sets each request's `lora` scales: the adapter's `scale` (default 1) for its "
        "id, 0 for the others and for the bare model. Switching adapters costs no reload; requests for them "
        "share the child (see below).",
        nullable=True)
    draft_model: Optional[str] = key(
        None, _string, "path",
        "A draft GGUF for speculative decoding (`--spec-draft-model`, with `--spec-type draft-simple` unless "
        "`server_args` sets `spec-type`); it must share the model's vocabulary.", default_doc="unset (off)")
    draft_max: Optional[int] = key(None, _positive_int, "positive integer", "`--spec-draft-n-max`: tokens "
                                   "drafted at most per step (needs `draft_model`).", default_doc="llama-server's (3)")
    draft_min: Optional[int] = key(None, _non_negative_int, "non-negative integer", "`--spec-draft-n-min`: "
                                   "fewest tokens worth drafting (needs `draft_model`).",
                                   default_doc="llama-server's (0)")
    draft_gpu_layers: Optional[Any] = key(None, _gpu_layers, "non-negative integer, `auto` or `all`",
                                          "`--spec-draft-ngl`: the draft's layers on the device.",
                                          default_doc="llama-server's (`auto`)")
    #: ``(flag, value)`` pairs, flag normalised to dashes, in config order (:func:`_server_args`).
    server_args: Tuple[Tuple[str, Any], ...] = derived((), KeyDoc(
        "server_args", "mapping", "`{}`",
        "Other llama-server flags: `true` = bare flag, `false`/null = omitted, lists repeat the flag "
        "(or join with commas where llama-server expects that)."))
    preload: bool = key(False, _boolean, "boolean", "Load this model at start-up (on `min_replicas` devices).")
    #: Replicas on purpose (issue 27): see rolemesh.scheduling.scheduler's docstring.
    min_replicas: int = key(1, _positive_int, "positive integer",
                            "Devices this model stays loaded on once there: `preload` loads it on that many, and "
                            "idle unload never takes it below (a model that may use fewer devices gets them all).")
    max_replicas: Optional[int] = key(
        None, _positive_int, "positive integer",
        "The most devices this model may hold at once. Set, it scales out on purpose: a request that would wait "
        "on every device holding the model starts a copy on an idle device that holds nothing, up to this many; "
        "past it requests queue on those devices (429 when full). Prefix affinity keeps each conversation on "
        "its copy.",
        default_doc="unset: the model spreads to another device only when its devices' queues are full")
    inference_probe_interval_s: Optional[float] = key(
        None, _positive_number, "positive number",
        "After this long without a successful request, send the ready child a 1-token completion (an "
        "embedding for embedding models); 3 failures in a row replace the child. Catches a child whose "
        "`/health` answers while its GPU is broken.",
        default_doc="unset (off)")
    #: ``None`` = inherit the node default; ``0`` is never stored.
    idle_unload_s: Optional[float] = key(None, _positive_number, "positive number or null",
                                         "Per-model idle unload; null keeps it loaded forever.",
                                         default_doc="the top-level value")
    #: True when the entry says ``idle_unload_s: null`` (keep forever).
    keep_loaded: bool = derived(False)
    # -- models folder and chat templates (issue 28: rolemesh.config.models_dir, rolemesh.children.chat_templates)
    mmproj: Optional[str] = key(None, _string, "path", "`--mmproj`: the multimodal projector GGUF.",
                                default_doc="the `mmproj-*` file paired with it in `models_dir`, else unset")
    chat_template: Optional[str] = key(
        None, _chat_template, "built-in template name or file path",
        "The chat template: a llama-server built-in name (e.g. `gemma`; passed as `--chat-template` with "
        "`--no-jinja`, so no tool calls) or a Jinja file (`--chat-template-file`). `--check` and "
        "`/v1/node/inventory` say which template each model uses.",
        default_doc="the GGUF's `tokenizer.chat_template`, else llama-server's `chatml`")

    @property
    def served_name(self) -> str:
        """The name llama-server reports for this model (its first alias)."""
        return self.alias or self.model_id

    @property
    def names(self) -> Tuple[str, ...]:
        named = (self.model_id,) if not self.alias else (self.model_id, self.alias)
        return named + tuple(a for a in self.aliases if a not in named)

    @property
    def parallel(self) -> int:
        """Concurrent slots llama-server runs for this model (``--parallel``)."""
        for flag, value in self.server_args:
            if flag in ("parallel", "np") and value is not None and value is not False:
                return int(value)
        return 1


def _seconds(default: float, meaning: str, check: Check = _positive_number, type_doc: str = "positive number") -> Any:
    return key(default, check, type_doc, meaning)


@attr.s(auto_attribs=True, frozen=True)
class NodeConfig:
    """The validated agent configuration."""

    #: ``""`` only before :func:`check_environment` (which puts in the host name).
    node_id: str = key("", _string, "string", "Name of this node at the dispatcher.",
                       default_doc="the host name", nullable=True)
    listen_host: str = key(
        "127.0.0.1", _host, "address, or list of addresses",
        "Address the API listens on; several (a list, or llama-server's `a,b`) listen on one port.",
        nullable=True)
    #: Every address of ``listen_host`` where it names several (else (): one
    #: address, or the ``listen`` endpoint's).  Read :attr:`addresses`.
    listen_hosts: Tuple[str, ...] = derived(())
    listen_port: int = key(8090, _port, "integer 0-65535", "Port the API listens on (0 = any free port).")
    #: A Twisted server endpoint description (never ``ssl:``: that becomes
    #: ``tcp:`` plus the tls_* files); None = TCP on listen_host:listen_port.
    listen: Optional[str] = key(
        None, _string, "Twisted server endpoint description",
        "Where to listen instead of `listen_host`/`listen_port`, e.g. `tcp6:8090:interface=\\:\\:`, "
        "`unix:/run/rolemesh/agent.sock` or `ssl:8443:privateKey=key.pem:certKey=cert.pem` "
        "(same as `tls_cert_file`/`tls_key_file`).",
        default_doc="unset (`listen_host`/`listen_port`)")
    tls_cert_file: Optional[str] = key(
        None, _string, "path",
        "PEM certificate (leaf first, then intermediates) to serve HTTPS with; TLS 1.2 or newer.",
        default_doc="unset (plain HTTP)")
    tls_key_file: Optional[str] = key(None, _string, "path", "PEM private key of `tls_cert_file` (unencrypted).",
                                      default_doc="`tls_cert_file`")
    tls_client_ca_file: Optional[str] = key(
        None, _string, "path", "Mutual TLS: clients must present a certificate signed by a CA in this PEM file.")
    #: ``""`` only before :func:`check_environment` (which derives it from the listen address).
    advertise_url: str = key("", _url, "URL", "URL the dispatcher uses to reach this node.",
                             default_doc="`http(s)://<listen_host>:<listen_port>`", nullable=True)
    backend: str = key("auto", _one_of(*BACKENDS), "`auto`, `cuda`, `rocm`, `metal`, `sycl`, `vulkan` or `cpu`",
                       "Device backend; `auto` picks from hardware evidence.")
    devices: Optional[Tuple[str, ...]] = key(
        None, _device_allow_list, "list of device names",
        "Allow-list such as `[\"gpu:0\", \"gpu:2\"]`; naming an absent device is an error.",
        default_doc="all discovered")
    cpu_devices: Optional[CpuDevices] = key(
        None, check_cpu_devices, "`numa` or a positive integer",
        "How the `cpu` backend splits the host: one device per NUMA node, or N core groups.",
        default_doc="one device")
    models: Tuple[ModelConfig, ...] = derived(
        (), KeyDoc("models", "list of model entries", "`[]`", "The models this node serves (below)."))
    # -- models folder (issue 28: rolemesh.config.models_dir)
    models_dir: Optional[Tuple[str, ...]] = key(
        None, _models_dir, "folder path or list of folder paths",
        "Every GGUF in these folders (and their sub-folders, one level) is a model, its id the file name "
        "without `.gguf` (and without a `-00001-of-00003` part suffix); `mmproj-*` files are paired with "
        "their model; a `models` entry with the same `model_id` and no `path` refines it. Rescanned on reload. "
        "Files left out (not a GGUF, unreadable) are one warning line each. Relative to the working directory.",
        default_doc="unset")
    # -- model names (issue 36: clients that send no model, or one of their own)
    default_model: Optional[str] = key(
        None, _string, "model id, alias or role",
        "Where a request with no `model` goes (llama.cpp's native clients and editor plugins send none); "
        "unset, such a request goes to the only model, or is a 400 that lists the models.",
        default_doc="unset")
    unknown_models: str = key(
        "reject", _one_of("reject", "default"), "`reject` or `default`",
        "A `model` that names nothing here: `reject` answers 404 listing the models; `default` serves it with "
        "`default_model` (for tools that hard-code a model name, such as an Anthropic client's Claude model id), "
        "logged once per name.")
    cors_allowed_origins: Tuple[str, ...] = key(
        ("*",), _string_list, "list of origins, or `[\"*\"]`",
        "Browser origins allowed to call the API (CORS): a preflight `OPTIONS` is answered 200 without a key, "
        "and answers to an allowed `Origin` carry `Access-Control-Allow-Origin` (the request itself still "
        "needs the key). `[]` allows none; `[\"*\"]` allows any origin, as llama-server does; `localhost` "
        "allows any origin on a loopback host (`localhost`, `127.0.0.1`, `[::1]`, any scheme and port), as "
        "llama-server's `--cors-origins localhost`.")
    #: As written until :func:`check_environment` resolves it on ``$PATH``.
    llama_server_bin: Optional[str] = key(
        None, _string, "path or command name", "The llama-server executable.",
        default_doc="the one `scripts/install-llama-server.sh` installed, else `llama-server` on PATH")
    llama_server_startup_timeout_s: float = _seconds(30.0, "How long a child may take to become ready.")
    llama_server_probe_interval_s: float = _seconds(0.5, "Readiness probe interval while a child starts.")
    llama_server_stop_timeout_s: float = _seconds(5.0, "Grace between SIGTERM and SIGKILL when a child is stopped.")
    llama_server_stall_timeout_s: float = _seconds(
        20.0,
        "A loading child that prints nothing for this long has stalled: it is killed and the load fails "
        "(`model_load_timeout`, \"stalled\") without waiting for `llama_server_startup_timeout_s`.")
    max_pending_requests_per_device: int = key(
        2, _positive_int, "positive integer", "In-flight plus queued requests a device admits before answering 429.")
    device_memory_reserve_bytes: int = key(
        0, _non_negative_int, "non-negative integer",
        "Headroom kept free on each device: added to every model's memory estimate "
        "(once per device a model spans).")
    dispatcher_base_url: Optional[str] = key(None, _url, "URL", "RoleMesh dispatcher to register and heartbeat with.",
                                             default_doc="unset (standalone)")
    heartbeat_interval_s: float = _seconds(5.0, "Seconds between heartbeats.")
    full_heartbeat_interval_s: float = _seconds(
        30.0, "Seconds between full heartbeats to a dispatcher that takes events (`POST /v1/nodes/events`): "
        "changes go at once, the full state is the reconciliation; `heartbeat_interval_s` applies to one "
        "that does not.")
    #: Every accepted key, from the four key sources (:func:`_api_keys`, then
    #: :func:`_environment_api_keys` adds the variable's and the file's).
    api_keys: Tuple[str, ...] = derived(
        (),
        KeyDoc("api_key", "string", "unset", "Bearer key every route but `/health` and `/ready` requires."),
        KeyDoc("api_keys", "list of strings or `{name, key, weight, priority, max_concurrent, tenant_header}` "
               "mappings", "`[]`",
               "Several accepted keys (rotation, tenants). Each key is a tenant: a mapping's `name`, a bare "
               "string's position (`key0`, `key1`, ... in the list of accepted keys); `weight` (positive, "
               "default 1) is its fair share of a queue, `priority` (`interactive` or `batch`) its default band, "
               "`max_concurrent` its cap on queued plus running requests (over it: 429 `tenant_limit`), "
               "`tenant_header: true` lets it name the tenant in `X-RoleMesh-Tenant` (a dispatcher's key)."),
        KeyDoc("api_key_env", "environment variable name", "unset",
               "Read one more accepted key from this environment variable."),
        KeyDoc("api_key_file", "path", "unset", "Read accepted keys from this file, one per line."),
        repr=False)
    #: The ``api_keys`` entries written as mappings (tenant name, weight,
    #: band, cap); the other keys are tenants named by position.
    tenants: Tuple["TenantConfig", ...] = derived((), repr=False)
    prefix_affinity: bool = key(
        True, _boolean, "boolean",
        "Send a prompt to the device whose llama-server cache already holds its beginning (the chat's "
        "earlier messages, a prompt's leading blocks), where its model is on several devices.")
    prefix_memory_entries: int = key(
        4096, _non_negative_int, "non-negative integer",
        "Prompt prefixes remembered for affinity (least recently used out first; about 100 bytes each; "
        "a conversation takes one per message): size it to the conversations alive at once times their "
        "messages. 0 turns affinity off.")
    prefix_affinity_max_imbalance: int = key(
        2, _non_negative_int, "non-negative integer",
        "Affinity yields when the remembered device has more than this many pending requests more than the "
        "least busy device holding the model.")
    dispatcher_token: Optional[str] = key(None, _string, "string", "Bearer token sent to the dispatcher.", repr=False)
    dispatcher_ca_file: Optional[str] = key(
        None, _string, "path", "PEM CA certificate(s) an `https://` dispatcher's certificate must be signed by.",
        default_doc="unset (the system trust store)")
    dispatcher_client_cert_file: Optional[str] = key(
        None, _string, "path", "PEM client certificate presented to the dispatcher (mutual TLS).")
    dispatcher_client_key_file: Optional[str] = key(
        None, _string, "path", "PEM private key of `dispatcher_client_cert_file` (unencrypted).",
        default_doc="`dispatcher_client_cert_file`")
    require_auth_off_loopback: bool = key(
        False, _boolean, "boolean",
        "Refuse to start when listening beyond loopback without an API key (else: a loud warning).")
    max_request_body_bytes: int = key(8 * 1024 * 1024, _positive_int, "positive integer",
                                      "Larger request bodies are answered 413.", default_doc="`8388608` (8 MiB)")
    max_connections: int = key(1024, _positive_int, "positive integer",
                               "Open client connections accepted at once; more are closed at once.")
    fast_path: bool = key(
        True, _boolean, "boolean",
        "Serve the inference routes and the common GETs on the listener's own lean path; `false` sends every "
        "request through twisted.web and Klein (after the same parsing and checks): slower, for comparison "
        "or if the fast path misbehaves.")
    request_read_timeout_s: float = _seconds(
        30.0, "Deadline for receiving a whole request (headers and body); slower clients are cut off.")
    idle_timeout_s: float = _seconds(60.0, "Keep-alive connections idle this long are closed.")
    queue_timeout_s: float = _seconds(
        300.0,
        "Longest wait in a device queue; then 503 `queue_timeout` with `Retry-After`, and the request leaves "
        "the queue.")
    stream_idle_timeout_s: float = _seconds(
        120.0,
        "Longest silence between chunks of an answer that has begun (stream or body); then the answer is "
        "ended (an SSE error event, or a cut connection) and the child is probed and replaced if it fails.")
    stream_coalesce_ms: float = key(
        0.0, _non_negative_number, "non-negative number",
        "Once a stream has begun, hold the child's socket this long after each small read so several events "
        "go out together, each token up to this much later. Pays only when tokens come faster than the window "
        "(the tiny test model: 45 -> 15 us per event at 8); at a real model's pace (one event per 20 ms) it costs "
        "more (200 -> 350 us per event, bench/stream_cost.py). 0 (off) relays every read at once.")
    request_timeout_s: float = _seconds(600.0, "Deadline for a non-streaming upstream answer (504 after it).")
    shutdown_grace_s: float = _seconds(30.0, "How long a drain waits for in-flight requests.",
                                       _non_negative_number, "non-negative number")
    idle_unload_s: Optional[float] = key(None, _positive_number, "positive number",
                                         "Stop a child idle this long; a model may override it.",
                                         default_doc="unset (keep loaded)")
    #: ``""`` only before :func:`check_environment` (which puts in the XDG default).
    state_dir: str = key("", _string, "path", "Where the pid files of children and the agent's lock live: "
                         "one agent per folder (a second one on it refuses to start).",
                         default_doc="`$XDG_STATE_HOME/rolemesh-node` or `~/.local/state/rolemesh-node`",
                         nullable=True)
    log_format: str = key("text", _one_of(*LOG_FORMATS), "`text` or `json`", "Log line format.")
    #: ``(model_id, device or None)`` pairs from the top-level ``preload`` list.
    preload: Tuple[Tuple[str, Optional[str]], ...] = derived((), KeyDoc(
        "preload", "list of model ids or `{model, device}` mappings", "`[]`",
        "Models to load at start-up, optionally on a given device (besides per-model `preload`)."))


    def model(self, model_id: str) -> ModelConfig:
        for m in self.models:
            if m.model_id == model_id:
                return m
        raise KeyError(model_id)

    @property
    def tls(self) -> Optional[ServerTLSFiles]:
        """The listener's TLS files; None = plain HTTP."""
        if self.tls_cert_file is None:
            return None
        return ServerTLSFiles(self.tls_cert_file, self.tls_key_file or self.tls_cert_file, self.tls_client_ca_file)

    @property
    def dispatcher_tls(self) -> ClientTLSFiles:
        """How an https:// dispatcher is verified and whom we present as."""
        return ClientTLSFiles(self.dispatcher_ca_file, self.dispatcher_client_cert_file,
                              self.dispatcher_client_key_file or self.dispatcher_client_cert_file)

    @property
    def exposed_without_key(self) -> bool:
        """Listening beyond loopback with no API key: anyone who reaches the
        port can use every model."""
        return not all(is_loopback(host) for host in self.addresses) and not self.api_keys

    @property
    def addresses(self) -> Tuple[str, ...]:
        """Every address the API listens on (``listen_host`` first)."""
        return self.listen_hosts or (self.listen_host,)

    def idle_unload_for(self, model: ModelConfig) -> Optional[float]:
        if model.keep_loaded:
            return None
        return model.idle_unload_s if model.idle_unload_s is not None else self.idle_unload_s


#: The documented keys, from the declarations above (docs/gen_config_doc.py
#: prints them as the tables in docs/configuration.md).
TOP_LEVEL_KEYS: Tuple[KeyDoc, ...] = key_docs(NodeConfig)
MODEL_KEYS: Tuple[KeyDoc, ...] = key_docs(ModelConfig)


# --------------------------------------------------------------------------
# Loading and merging


def load_yaml(path: str) -> Dict[str, Any]:
    """Read one YAML file into a mapping, or raise a one-line ConfigError."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a YAML file") from None
    except PermissionError:
        raise ConfigError(f"{path}: permission denied") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {_kind(data)}")
    return data


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any], where: str = "") -> Dict[str, Any]:
    """Merge ``override`` over ``base``.

    Mappings merge recursively; scalars and lists replace -- except the
    top-level ``models`` list, whose entries are matched by ``model_id`` so an
    override can change one model's ``path`` without restating the others.
    Entries with a new ``model_id`` are appended.
    """
    merged: Dict[str, Any] = dict(base)
    for key, value in override.items():
        path = f"{where}.{key}" if where else str(key)
        if key == "models" and not where and isinstance(value, list) and isinstance(base.get(key), list):
            merged[key] = _merge_models(base[key], value)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key] = deep_merge(base[key], value, path)
        else:
            merged[key] = value
    return merged


def _merge_models(base: List[Any], override: List[Any]) -> List[Any]:
    result = list(base)
    index = {m.get("model_id"): i for i, m in enumerate(base) if isinstance(m, dict)}
    for i, entry in enumerate(override):
        if not isinstance(entry, dict) or not isinstance(entry.get("model_id"), str):
            raise ConfigError(
                f"models[{i}] (override): each override entry needs a model_id to match a base entry"
            )
        j = index.get(entry["model_id"])
        if j is None:
            index[entry["model_id"]] = len(result)
            result.append(entry)
        else:
            result[j] = deep_merge(result[j], entry, f"models[{j}]")
    return result


def load_config(
    path: Optional[str],
    override_path: Optional[str] = None,
    *,
    model_files: Sequence[str] = (),
    check_files: bool = True,
    environ: Optional[Mapping[str, str]] = None,
) -> NodeConfig:
    """Load, merge, validate (pure), then check against this host; the CLI,
    the twistd plugin and reload all call this.  ``model_files`` are the
    command line's ``--model`` files, added to the file's models (``path``
    None: to an empty config, every key at its default)."""
    raw = load_yaml(path) if path is not None else {}
    if override_path:
        raw = deep_merge(raw, load_yaml(override_path))
    if raw.get("models_dir") is not None:
        raw = with_models_dir(raw)
    if model_files:
        raw = with_model_files(raw, model_files, check_files=check_files)
    return check_environment(parse(raw), raw, check_files=check_files, environ=environ)


def with_models_dir(raw: Mapping[str, Any]) -> Dict[str, Any]:
    """``raw`` with the models of ``models_dir`` folded into ``models``
    (:mod:`rolemesh.config.models_dir`); each file left out is one warning line."""
    from twisted.logger import Logger

    from rolemesh.config import models_dir

    merged, notes = models_dir.apply(dict(raw), _models_dir)
    for note in notes:
        Logger(namespace="rolemesh.models_dir").warn("{note}", note=note)
    return merged


def model_id_of(path: str) -> str:
    """A ``--model`` file's model id: its name without ``.gguf``."""
    name = os.path.basename(path.rstrip(os.sep))
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") and len(name) > 5 else name


def with_model_files(raw: Mapping[str, Any], files: Sequence[str], check_files: bool = True) -> Dict[str, Any]:
    """``raw`` with a ``models`` entry per ``--model`` file (model id from
    the file name, every other key at its default), or a one-line
    ConfigError naming the ``--model`` (a missing file, an id already used)."""
    models = raw.get("models") or []
    if not isinstance(models, list):
        raise _fail("models", "a list of model entries", models)
    taken: Dict[str, str] = {}
    for i, entry in enumerate(models):
        if isinstance(entry, dict):
            for key_name in ("model_id", "alias"):
                if isinstance(entry.get(key_name), str):
                    taken.setdefault(entry[key_name], f"models[{i}].{key_name} in the config")
    added = []
    for given in files:
        where = f"--model {given}"
        if check_files:
            if not os.path.exists(given):
                raise ConfigError(f"{where}: no such file")
            if not os.path.isfile(given):
                raise ConfigError(f"{where}: not a regular file (expected a GGUF file)")
        model_id = model_id_of(given)
        if not model_id.strip():
            raise ConfigError(f"{where}: no model id in the file name")
        if model_id in taken:
            raise ConfigError(f"{where}: model id {_show(model_id)} (the file name without .gguf) is already "
                              f"used by {taken[model_id]}; rename the file or give it an entry with its own "
                              "model_id in a config file")
        taken[model_id] = f"--model {given}"
        added.append({"model_id": model_id, "path": os.path.abspath(given)})
    return {**raw, "models": list(models) + added}


# --------------------------------------------------------------------------
# Pure validation: plain data in, a record out


def _checked_keys(
    record: Type[Any], data: Mapping[str, Any], prefix: str, steps: Mapping[str, Callable[[Dict[str, Any]], Any]]
) -> Dict[str, Any]:
    """The field values of ``record`` from ``data``, in field order (so the
    first mistake in that order is the one reported).

    A plain key is checked on its own (absent, or null where that means the
    default: the field's default); a derived field is computed by its named
    step in ``steps`` from the values so far.
    """
    for field in attr.fields(record):
        doc = plain_key(field)
        if doc is not None and doc.required and data.get(field.name) is None:
            raise ConfigError(f"{prefix}{field.name}: required")
    values: Dict[str, Any] = {}
    for field in attr.fields(record):
        doc = plain_key(field)
        if doc is None or doc.check is None:
            values[field.name] = steps[field.name](values)
        elif field.name in data and not (doc.nullable and data[field.name] is None):
            values[field.name] = doc.check(prefix + field.name, data[field.name])
        elif field.default is not attr.NOTHING:
            values[field.name] = field.default
    return values


#: Structured model fields and every spelling of the llama-server flag each
#: one sets; ``server_args`` may not set any of them again.
STRUCTURED_FLAGS: Dict[str, Tuple[str, ...]] = {
    "ctx_size": ("ctx-size", "c"),
    "batch_size": ("batch-size", "b"),
    "ubatch_size": ("ubatch-size", "ub"),
    "threads": ("threads", "t"),
    "threads_batch": ("threads-batch", "tb"),
    "gpu_layers": ("n-gpu-layers", "ngl", "gpu-layers"),
    "main_gpu": ("main-gpu", "mg"),
    "tensor_split": ("tensor-split", "ts"),
    "flash_attn": ("flash-attn", "fa"),
    "alias": ("alias", "a"),
    "mmproj": ("mmproj", "mm"),
}

#: Other flags with two spellings the agent cares about (``ModelConfig.parallel``).
SYNONYMS: Dict[str, str] = {"np": "parallel"}

#: Flags the agent owns: it picks the model file, the address and the port.
FORBIDDEN_FLAGS = frozenset({"host", "port", "model", "m"})


def normalize_flag(key: str) -> str:
    """``ctx_size``, ``--ctx-size`` and ``ctx-size`` all name ``ctx-size``."""
    return key.lstrip("-").replace("_", "-")


def _server_args(path: str, value: Any, model: Mapping[str, Any]) -> Tuple[Tuple[str, Any], ...]:
    if not isinstance(value, dict):
        raise _fail(path, "a mapping of llama-server flags", value)
    owner = {flag: field for field, flags in STRUCTURED_FLAGS.items() for flag in flags}
    seen: Dict[str, str] = {}
    result = []
    for key, item in value.items():
        if not isinstance(key, str) or not normalize_flag(key):
            raise _fail(f"{path}", "flag names as keys", key)
        flag = normalize_flag(key)
        here = f"{path}.{_key_name(key)}"
        if flag in FORBIDDEN_FLAGS:
            raise ConfigError(
                f"{here}: the agent sets --{flag} itself (children always bind 127.0.0.1 "
                "on a port the agent picks, and load the model's path); remove it"
            )
        field = owner.get(flag)
        entry = path.rsplit('.', 1)[0]
        if flag in ("chat-template", "chat-template-file") and model.get("chat_template") is not None:
            raise ConfigError(f"{here}: conflicts with the structured field {entry}.chat_template; "
                              "set it in one place")
        if field == "alias":
            # The agent always passes --alias (the alias, else the model_id);
            # a second one would rename the model behind the agent's back.
            raise ConfigError(f"{here}: the agent sets --alias itself; use {entry}.alias instead")
        if field is not None and model.get(field) is not None:
            raise ConfigError(
                f"{here}: conflicts with the structured field {entry}.{field}; set it in one place"
            )
        # Two spellings of one structured flag (``ngl`` and ``n-gpu-layers``)
        # are the same flag too.
        canonical = STRUCTURED_FLAGS[field][0] if field is not None else SYNONYMS.get(flag, flag)
        if canonical in seen:
            raise ConfigError(f"{here}: the same flag as {path}.{_key_name(seen[canonical])}")
        seen[canonical] = key
        if isinstance(item, dict):
            raise _fail(here, "a scalar, a boolean, null or a list", item)
        if isinstance(item, list):
            for i, element in enumerate(item):
                if element is None or isinstance(element, (dict, list, bool)):
                    raise _fail(f"{here}[{i}]", "a string or a number", element)
            item = tuple(item)
        if flag in ("parallel", "np") and item is not None and item is not False:
            _positive_int(here, item)
        result.append((flag, item))
    return tuple(result)



def _model(i: int, data: Any) -> ModelConfig:
    prefix = f"models[{i}]."
    if not isinstance(data, dict):
        raise _fail(f"models[{i}]", "a mapping", data)
    _unknown_keys(data, MODEL_KEYS, prefix)
    model = ModelConfig(**_checked_keys(ModelConfig, data, prefix, {
        "server_args": lambda _: _server_args(prefix + "server_args", data.get("server_args") or {}, data),
        "keep_loaded": lambda _: "idle_unload_s" in data and data["idle_unload_s"] is None,
    }))
    _adapters_and_draft(prefix, model)
    return model


def _models(value: Any) -> Tuple[ModelConfig, ...]:
    """``models``: each entry checked, then no name used twice."""
    raw_models = value or []
    if not isinstance(raw_models, list):
        raise _fail("models", "a list of model entries", raw_models)
    models = tuple(_model(i, m) for i, m in enumerate(raw_models))
    names: Dict[str, str] = {}
    for i, m in enumerate(models):
        adapter_ids = tuple((f"lora_adapters[{j}].id", a.id) for j, a in enumerate(m.lora_adapters))
        more = tuple((f"aliases[{j}]", a) for j, a in enumerate(m.aliases))
        for key_name, name in (("model_id", m.model_id), ("alias", m.alias)) + more + adapter_ids:
            if name is None:
                continue
            ours = names.get(name, "").startswith(f"models[{i}].")
            if name in names and not (key_name != "model_id" and ours and not key_name.startswith("lora")):
                here, other = f"models[{i}].{key_name}", names[name]
                if key_name == "model_id" and other.endswith(".model_id"):
                    raise ConfigError(f"{here}: duplicate model_id {_show(name)} (also {other})")
                raise ConfigError(f"{here}: {_show(name)} already names another model ({other})")
            names[name] = f"models[{i}].{key_name}"
    return models


@attr.s(auto_attribs=True, frozen=True)
class TenantConfig:
    """An ``api_keys`` entry written as a mapping: a named tenant."""

    name: str
    key: str = attr.ib(repr=False)
    weight: float = 1.0
    priority: str = "interactive"
    max_concurrent: Optional[int] = None
    tenant_header: bool = False


_TENANT_KEYS = ("name", "key", "weight", "priority", "max_concurrent", "tenant_header")
_TENANT_NAME = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


def tenant_name(path: str, value: Any) -> str:
    name = _string(path, value)
    if not _TENANT_NAME.fullmatch(name) or name == "other":
        raise _fail(path, "a tenant name of 1-64 letters, digits, '.', '_', ':' or '-' (not 'other')", value)
    return name


def _tenant(path: str, value: Any) -> TenantConfig:
    unknown = [k for k in value if k not in _TENANT_KEYS]
    if unknown:
        raise ConfigError(f"{path}.{_key_name(unknown[0])}: unknown key (expected one of {', '.join(_TENANT_KEYS)})")
    for required in ("name", "key"):
        if value.get(required) is None:
            raise ConfigError(f"{path}.{required}: required")
    cap = _optional(value, "max_concurrent", path + ".", _positive_int)
    return TenantConfig(
        tenant_name(f"{path}.name", value["name"]), _string(f"{path}.key", value["key"]),
        float(_optional(value, "weight", path + ".", _positive_number) or 1.0),
        _optional(value, "priority", path + ".", _one_of("interactive", "batch")) or "interactive",
        cap, bool(_optional(value, "tenant_header", path + ".", _boolean)))


def _tenants(data: Mapping[str, Any]) -> Tuple[TenantConfig, ...]:
    """The mapping entries of ``api_keys`` (checked in :func:`_api_keys`)."""
    entries = data.get("api_keys") or []
    out = tuple(_tenant(f"api_keys[{i}]", v) for i, v in enumerate(entries) if isinstance(v, dict))
    seen: Dict[str, int] = {}
    for i, tenant in enumerate(out):
        if tenant.name in seen:
            raise ConfigError(f"api_keys: the tenant name {_show(tenant.name)} is used twice")
        seen[tenant.name] = i
    return out


def _api_keys(data: Mapping[str, Any]) -> Tuple[str, ...]:
    """``api_keys`` from ``api_key`` and ``api_keys``; the ``api_key_env`` and
    ``api_key_file`` names are checked here and read by :func:`check_environment`."""
    keys: List[str] = []
    if data.get("api_key") is not None:
        keys.append(_string("api_key", data["api_key"]))
    entries = data.get("api_keys") or []
    if not isinstance(entries, list):
        raise _fail("api_keys", "a list of strings or {name, key, ...} mappings", entries)
    for i, entry in enumerate(entries):
        keys.append(_tenant(f"api_keys[{i}]", entry).key if isinstance(entry, dict)
                    else _string(f"api_keys[{i}]", entry))
    _optional(data, "api_key_env", "", _string)
    _optional(data, "api_key_file", "", _string)
    return tuple(dict.fromkeys(keys))


def _preload(value: Any, models: Tuple[ModelConfig, ...]) -> Tuple[Tuple[str, Optional[str]], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _fail("preload", "a list of model ids or {model, device} mappings", value)
    known = {m.model_id for m in models}
    out = []
    for i, entry in enumerate(value):
        path = f"preload[{i}]"
        if isinstance(entry, str):
            model, device = entry, None
        elif isinstance(entry, dict):
            extra = set(entry) - {"model", "device"}
            if extra:
                raise ConfigError(f"{path}.{sorted(extra)[0]}: unknown key (expected model and device)")
            model = _string(f"{path}.model", entry.get("model"))
            device = _optional(entry, "device", f"{path}.", _string)
        else:
            raise _fail(path, "a model id or a {model, device} mapping", entry)
        if model not in known:
            raise ConfigError(f"{path}: unknown model_id {_show(model)}")
        out.append((model, device))
    return tuple(out)


_SSL_OPTIONS = ("port", "interface", "backlog", "privateKey", "certKey")


def _endpoint_port(path: str, text: Optional[str]) -> int:
    if text is None or not text.isdigit() or not 0 <= int(text) <= 65535:
        raise _fail(path, "a port number 0-65535", text)
    return int(text)



def _endpoint_kind(listen: str) -> str:
    positional, _ = split_endpoint_description(listen)
    return positional[0].lower() if positional else ""


def _parse_endpoint(listen: str) -> None:
    from twisted.internet.endpoints import serverFromString

    try:
        serverFromString(None, listen)
    except Exception as e:  # noqa: BLE001 - Twisted says ValueError, TypeError, KeyError...
        raise ConfigError(f"listen: {_show(listen)} is not a usable endpoint description: "
                          f"{type(e).__name__}: {e}") from None


def _listener(values: Mapping[str, Any]) -> Dict[str, Any]:
    """``listen`` and the ``tls_*`` keys checked together: the listener fields.

    An ``ssl:`` description is turned into ``tcp:`` plus TLS files, so every
    TLS listener gets the agent's own TLS (TLS 1.2 at least, client
    certificates, reload).  For TCP descriptions host and port are taken
    from the description (they feed ``advertise_url`` and the
    unauthenticated-listener warning).  Other kinds (``unix:``...) are
    parsed by :func:`check_environment`, which may load plugins.
    """
    cert, key_file = values["tls_cert_file"], values["tls_key_file"]
    client_ca, listen = values["tls_client_ca_file"], values["listen"]
    host, port = values["listen_host"], values["listen_port"]
    if key_file is not None and cert is None:
        raise ConfigError("tls_key_file: set tls_cert_file too (the certificate the key belongs to)")
    if listen is not None:
        positional, options = split_endpoint_description(listen)
        kind = positional[0].lower() if positional else ""
        if kind == "ssl":
            if cert is not None:
                raise ConfigError("listen: an ssl: description names its own certificate; "
                                  "drop tls_cert_file/tls_key_file, or use tcp: with them")
            unknown = sorted(set(options) - set(_SSL_OPTIONS))
            if unknown:
                raise ConfigError(f"listen: ssl option {unknown[0]} is not supported by the agent "
                                  f"(supported: {', '.join(_SSL_OPTIONS)}; put intermediates in the certKey file)")
            key_file = options.get("privateKey")
            if not key_file:
                raise ConfigError("listen: an ssl: description needs privateKey=<PEM key file>")
            cert = options.get("certKey") or key_file
            port_text = positional[1] if len(positional) > 1 else options.get("port")
            listen = "tcp:" + str(_endpoint_port("listen", port_text)) + "".join(
                f":{name}={escape_endpoint_value(options[name])}" for name in ("interface", "backlog")
                if name in options)
            positional, options = split_endpoint_description(listen)
            kind = "tcp"
        if kind in ("tcp", "tcp6"):
            port = _endpoint_port("listen", positional[1] if len(positional) > 1 else options.get("port"))
            host = options.get("interface") or ("0.0.0.0" if kind == "tcp" else "::")
            _parse_endpoint(listen)
    hosts = values["listen_hosts"] if listen is None else ()
    if cert is None:
        if client_ca is not None:
            raise ConfigError("tls_client_ca_file: needs tls_cert_file (mutual TLS is on top of TLS)")
        return {"listen": listen, "listen_host": host, "listen_hosts": hosts, "listen_port": port}
    return {"listen": listen, "listen_host": host, "listen_hosts": hosts, "listen_port": port,
            "tls_cert_file": cert, "tls_key_file": key_file or cert, "tls_client_ca_file": client_ca}


_DISPATCHER_TLS_KEYS = ("dispatcher_ca_file", "dispatcher_client_cert_file", "dispatcher_client_key_file")


def _dispatcher_tls(values: Mapping[str, Any]) -> None:
    """The dispatcher_* TLS keys, checked against each other and the URL."""
    url = values["dispatcher_base_url"]
    if values["dispatcher_client_key_file"] is not None and values["dispatcher_client_cert_file"] is None:
        raise ConfigError("dispatcher_client_key_file: set dispatcher_client_cert_file too")
    used = [name for name in _DISPATCHER_TLS_KEYS if values[name] is not None]
    if used and not (url or "").startswith("https://"):
        raise ConfigError(f"{used[0]}: only used with an https:// dispatcher_base_url, "
                          f"got {_show(url) if url else 'none'}")


def parse(data: Mapping[str, Any]) -> NodeConfig:
    """Merged YAML data as a :class:`NodeConfig`, or ConfigError; pure (no I/O).

    What only the host can say is left for :func:`check_environment`:
    ``node_id``, ``advertise_url`` and ``state_dir`` stay ``""`` when unset,
    ``llama_server_bin`` is as written, and ``api_keys`` lacks the keys from
    ``api_key_env`` and ``api_key_file``.
    """
    _unknown_keys(data, TOP_LEVEL_KEYS, "")
    values = _checked_keys(NodeConfig, data, "", {
        "models": lambda _: _models(data.get("models")),
        "api_keys": lambda _: _api_keys(data),
        "tenants": lambda _: _tenants(data),
        "preload": lambda so_far: _preload(data.get("preload"), so_far["models"]),
        "listen_hosts": lambda _: _several_hosts(data.get("listen_host")),
    })
    values.update(_listener(values))
    _dispatcher_tls(values)
    _model_names(values)
    return NodeConfig(**values)


def _model_names(values: Mapping[str, Any]) -> None:
    """``default_model`` names a model here (an id, alias, adapter id or
    role); ``unknown_models: default`` has one to go to."""
    default = values.get("default_model")
    models: Tuple[ModelConfig, ...] = values.get("models", ())
    if default is not None and models:
        names = {n for m in models for n in (*m.names, *m.roles, *(a.id for a in m.lora_adapters))}
        if default not in names:
            shown = ", ".join(sorted(m.model_id for m in models)[:20])
            raise ConfigError(f"default_model: {_show(default)} names no model here (models: {shown})")
    if values.get("unknown_models") == "default" and default is None:
        raise ConfigError("unknown_models: `default` needs default_model set (the model such requests go to)")


# --------------------------------------------------------------------------
# The environment: what only this host can say


def default_state_dir(environ: Mapping[str, str]) -> str:
    base = environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "rolemesh-node")


def default_advertise_url(config: NodeConfig, fqdn: Callable[[], str]) -> str:
    """``http(s)://<listen_host>:<listen_port>``; a wildcard host becomes ``fqdn()``."""
    host = config.listen_host
    if host in ("0.0.0.0", "::", ""):
        host = fqdn()
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if config.tls else 'http'}://{host}:{config.listen_port}"


def _resolve_binary(value: Optional[str], check_files: bool) -> Optional[str]:
    if value is None or not check_files:
        return value
    if os.sep not in value:
        found = shutil.which(value)
        if found is None:
            raise ConfigError(f"llama_server_bin: {_show(value)} not found on PATH")
        return found
    if not os.path.isfile(value) or not os.access(value, os.X_OK):
        raise ConfigError(f"llama_server_bin: not an executable file: {_show(value)}")
    return value


def _check_model_files(models: Tuple[ModelConfig, ...]) -> None:
    for i, model in enumerate(models):
        if not os.path.exists(model.path):
            raise ConfigError(f"models[{i}].path: file not found: {_show(model.path)}")
        if not os.path.isfile(model.path):
            raise ConfigError(f"models[{i}].path: not a regular file: {_show(model.path)}")
        extra = [(f"lora_adapters[{j}].path", a.path) for j, a in enumerate(model.lora_adapters)]
        for where, file in extra + ([("draft_model", model.draft_model)] if model.draft_model else []):
            if not os.path.isfile(file):
                problem = "not a regular file" if os.path.exists(file) else "file not found"
                raise ConfigError(f"models[{i}].{where}: {problem}: {_show(file)}")
        for name in ("mmproj", "chat_template"):
            value = getattr(model, name)
            if value is None or (name == "chat_template" and not _is_template_file(value)):
                continue
            if not os.path.isfile(value):
                raise ConfigError(f"models[{i}].{name}: file not found: {_show(value)}")


def _is_template_file(value: str) -> bool:
    return chat_template_names.is_file(value)


def _environment_api_keys(
    keys: Tuple[str, ...], data: Mapping[str, Any], environ: Mapping[str, str], check_files: bool
) -> Tuple[str, ...]:
    """``keys`` plus the one in ``api_key_env`` and those in ``api_key_file``."""
    more: List[str] = []
    env_name = data.get("api_key_env")
    if env_name is not None:
        value = environ.get(env_name, "").strip()
        if not value:
            raise ConfigError(f"api_key_env: environment variable {env_name} is not set or empty")
        more.append(value)
    key_file = data.get("api_key_file")
    if key_file is not None and check_files:
        try:
            with open(key_file, encoding="utf-8") as f:
                from_file = [line.strip() for line in f if line.strip() and not line.startswith("#")]
        except OSError as e:
            raise ConfigError(f"api_key_file: cannot read {_show(key_file)}: {e.strerror}") from None
        if not from_file:
            raise ConfigError(f"api_key_file: {_show(key_file)} holds no key")
        more.extend(from_file)
    return tuple(dict.fromkeys(keys + tuple(more)))


def check_environment(
    config: NodeConfig,
    data: Mapping[str, Any],
    *,
    check_files: bool = True,
    environ: Optional[Mapping[str, str]] = None,
) -> NodeConfig:
    """``config`` (from :func:`parse` of ``data``) completed and checked against this host.

    Fills in the host name, the advertised URL (a wildcard listener resolves
    the FQDN), the state directory and the API keys from the environment.
    Under Vertex AI (``AIP_MODE=PREDICTION``) the port is ``AIP_HTTP_PORT``.
    With ``check_files`` (off for unit tests and documentation examples) it
    also resolves ``llama_server_bin`` on ``$PATH``, checks model files exist,
    reads ``api_key_file`` and parses non-TCP ``listen`` descriptions.
    """
    env = os.environ if environ is None else environ
    if check_files:
        if config.listen is not None and _endpoint_kind(config.listen) not in ("tcp", "tcp6"):
            _parse_endpoint(config.listen)
        _check_model_files(config.models)
    vertex = vertex_ai.from_environ(env)
    if vertex is not None and config.listen is None:  # a Vertex AI container: where the platform sends traffic
        config = attr.evolve(config, listen_port=vertex.http_port)
    return attr.evolve(
        config,
        node_id=config.node_id or socket.gethostname(),
        advertise_url=config.advertise_url or default_advertise_url(config, socket.getfqdn),
        llama_server_bin=_resolve_binary(config.llama_server_bin, check_files),
        api_keys=_environment_api_keys(config.api_keys, data, env, check_files),
        state_dir=os.path.expanduser(config.state_dir or default_state_dir(env)),
    )


def validate(
    data: Mapping[str, Any],
    *,
    check_files: bool = True,
    environ: Optional[Mapping[str, str]] = None,
) -> NodeConfig:
    """:func:`parse` then :func:`check_environment`: data to a complete
    :class:`NodeConfig`, or ConfigError.

    ``check_files=False`` skips checks that touch the filesystem (model paths,
    the binary, key files), for unit tests and documentation examples.
    """
    return check_environment(parse(data), data, check_files=check_files, environ=environ)




def redacted(data: Mapping[str, Any]) -> Dict[str, Any]:
    """A copy of raw config data with secrets replaced, for ``--check``."""
    out: Dict[str, Any] = {}
    for key, value in data.items():
        if key in SECRET_KEYS and value:
            out[key] = ["***"] * len(value) if isinstance(value, list) else "***"
        else:
            out[key] = value
    return out


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _model_data(model: ModelConfig) -> Dict[str, Any]:
    data: Dict[str, Any] = {}
    for key in MODEL_KEYS:
        value = getattr(model, key.name, None)
        if key.name == "server_args":
            value = {flag: _plain(v) for flag, v in model.server_args} or None
        if key.name == "lora_adapters":
            value = [attr.asdict(a) for a in model.lora_adapters] or None
        if value is not None:
            data[key.name] = _plain(value)
    if model.keep_loaded:
        data["idle_unload_s"] = None
    return data


def as_dict(config: NodeConfig) -> Dict[str, Any]:
    """The resolved configuration as configuration data, secrets redacted.

    Only documented keys, in their documented shapes, so what ``--check``
    prints is itself a valid configuration (a test feeds it back to
    :func:`validate`).
    """
    data: Dict[str, Any] = {}
    for key in TOP_LEVEL_KEYS:
        if hasattr(config, key.name) and key.name not in ("models", "preload"):
            data[key.name] = _plain(getattr(config, key.name))
    if len(config.addresses) > 1 and config.listen is None:
        data["listen_host"] = list(config.addresses)
    data["api_keys"] = ["***"] * len(config.api_keys)
    data["dispatcher_token"] = "***" if config.dispatcher_token else None
    data["preload"] = [model if device is None else {"model": model, "device": device}
                       for model, device in config.preload]
    data["models"] = [_model_data(m) for m in config.models]
    return data
