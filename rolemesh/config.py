"""Configuration: load YAML, merge an override over it, validate into records.

Validation is a pure function from plain data to frozen records (plus a few
filesystem checks the caller can turn off in tests).  Every mistake raises
:class:`~rolemesh.errors.ConfigError` with one line naming the exact key path
and the bad value, e.g. ``models[1].ctx_size: expected a positive integer,
got "big"``.

The table ``TOP_LEVEL_KEYS`` / ``MODEL_KEYS`` is the single source of truth
for key names, types, defaults and meanings; ``docs/configuration.md`` is
checked against it by a test so the two cannot drift.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import socket
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import attr
import yaml

from rolemesh.errors import ConfigError
from rolemesh.tls import ClientTLSFiles, ServerTLSFiles, escape_endpoint_value, split_endpoint_description

PLACEHOLDER_PREFIX = "/path/to/"
BACKENDS = ("auto", "cuda", "rocm", "metal", "sycl", "vulkan", "cpu")
LOG_FORMATS = ("text", "json")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
SECRET_KEYS = frozenset({"api_key", "api_keys", "dispatcher_token"})


@attr.s(auto_attribs=True, frozen=True)
class KeyDoc:
    """One documented configuration key."""

    name: str
    type: str
    default: str
    meaning: str


TOP_LEVEL_KEYS: Tuple[KeyDoc, ...] = (
    KeyDoc("node_id", "string", "the host name", "Name of this node at the dispatcher."),
    KeyDoc("listen_host", "string", "`127.0.0.1`", "Address the API listens on."),
    KeyDoc("listen_port", "integer 0-65535", "`8090`", "Port the API listens on (0 = any free port)."),
    KeyDoc("listen", "Twisted server endpoint description", "unset (`listen_host`/`listen_port`)",
           "Where to listen instead of `listen_host`/`listen_port`, e.g. `tcp6:8090:interface=\\:\\:`, "
           "`unix:/run/rolemesh/agent.sock` or `ssl:8443:privateKey=key.pem:certKey=cert.pem` "
           "(same as `tls_cert_file`/`tls_key_file`)."),
    KeyDoc("tls_cert_file", "path", "unset (plain HTTP)",
           "PEM certificate (leaf first, then intermediates) to serve HTTPS with; TLS 1.2 or newer."),
    KeyDoc("tls_key_file", "path", "`tls_cert_file`", "PEM private key of `tls_cert_file` (unencrypted)."),
    KeyDoc("tls_client_ca_file", "path", "unset",
           "Mutual TLS: clients must present a certificate signed by a CA in this PEM file."),
    KeyDoc("advertise_url", "URL", "`http(s)://<listen_host>:<listen_port>`",
           "URL the dispatcher uses to reach this node."),
    KeyDoc("backend", "`auto`, `cuda`, `rocm`, `metal`, `sycl`, `vulkan` or `cpu`", "`auto`",
           "Device backend; `auto` picks from hardware evidence."),
    KeyDoc("devices", "list of device names", "all discovered",
           "Allow-list such as `[\"gpu:0\", \"gpu:2\"]`; naming an absent device is an error."),
    KeyDoc("cpu_devices", "`numa` or a positive integer", "one device",
           "How the `cpu` backend splits the host: one device per NUMA node, or N core groups."),
    KeyDoc("llama_server_bin", "path or command name",
           "the one `scripts/install-llama-server.sh` installed, else `llama-server` on PATH",
           "The llama-server executable."),
    KeyDoc("llama_server_startup_timeout_s", "positive number", "`30.0`",
           "How long a child may take to become ready."),
    KeyDoc("llama_server_probe_interval_s", "positive number", "`0.5`",
           "Readiness probe interval while a child starts."),
    KeyDoc("llama_server_stall_timeout_s", "positive number", "`20.0`",
           "A loading child that prints nothing for this long has stalled: it is killed and the load fails "
           "(`model_load_timeout`, \"stalled\") without waiting for `llama_server_startup_timeout_s`."),
    KeyDoc("llama_server_stop_timeout_s", "positive number", "`5.0`",
           "Grace between SIGTERM and SIGKILL when a child is stopped."),
    KeyDoc("max_pending_requests_per_device", "positive integer", "`2`",
           "In-flight plus queued requests a device admits before answering 429."),
    KeyDoc("device_memory_reserve_bytes", "non-negative integer", "`0`",
           "Headroom kept free on each device: added to every model's memory estimate "
           "(once per device a model spans)."),
    KeyDoc("dispatcher_base_url", "URL", "unset (standalone)",
           "RoleMesh dispatcher to register and heartbeat with."),
    KeyDoc("heartbeat_interval_s", "positive number", "`5.0`", "Seconds between heartbeats."),
    KeyDoc("api_key", "string", "unset", "Bearer key every route but `/health` requires."),
    KeyDoc("api_keys", "list of strings", "`[]`", "Several accepted keys, for rotation."),
    KeyDoc("api_key_env", "environment variable name", "unset",
           "Read one more accepted key from this environment variable."),
    KeyDoc("api_key_file", "path", "unset", "Read accepted keys from this file, one per line."),
    KeyDoc("require_auth_off_loopback", "boolean", "`false`",
           "Refuse to start when listening beyond loopback without an API key (else: a loud warning)."),
    KeyDoc("dispatcher_token", "string", "unset", "Bearer token sent to the dispatcher."),
    KeyDoc("dispatcher_ca_file", "path", "unset (the system trust store)",
           "PEM CA certificate(s) an `https://` dispatcher's certificate must be signed by."),
    KeyDoc("dispatcher_client_cert_file", "path", "unset",
           "PEM client certificate presented to the dispatcher (mutual TLS)."),
    KeyDoc("dispatcher_client_key_file", "path", "`dispatcher_client_cert_file`",
           "PEM private key of `dispatcher_client_cert_file` (unencrypted)."),
    KeyDoc("max_request_body_bytes", "positive integer", "`8388608` (8 MiB)",
           "Larger request bodies are answered 413."),
    KeyDoc("max_connections", "positive integer", "`1024`",
           "Open client connections accepted at once; more are closed at once."),
    KeyDoc("request_read_timeout_s", "positive number", "`30`",
           "Deadline for receiving a whole request (headers and body); slower clients are cut off."),
    KeyDoc("idle_timeout_s", "positive number", "`60`", "Keep-alive connections idle this long are closed."),
    KeyDoc("queue_timeout_s", "positive number", "`300`",
           "Longest wait in a device queue; then 503 `queue_timeout` with `Retry-After`, and the request leaves "
           "the queue."),
    KeyDoc("stream_idle_timeout_s", "positive number", "`120`",
           "Longest silence between chunks of an answer that has begun (stream or body); then the answer is "
           "ended (an SSE error event, or a cut connection) and the child is probed and replaced if it fails."),
    KeyDoc("request_timeout_s", "positive number", "`600`",
           "Deadline for a non-streaming upstream answer (504 after it)."),
    KeyDoc("shutdown_grace_s", "non-negative number", "`30`",
           "How long a drain waits for in-flight requests."),
    KeyDoc("idle_unload_s", "positive number", "unset (keep loaded)",
           "Stop a child idle this long; a model may override it."),
    KeyDoc("state_dir", "path", "`$XDG_STATE_HOME/rolemesh-node` or `~/.local/state/rolemesh-node`",
           "Where pid files of children live."),
    KeyDoc("log_format", "`text` or `json`", "`text`", "Log line format."),
    KeyDoc("preload", "list of model ids or `{model, device}` mappings", "`[]`",
           "Models to load at start-up, optionally on a given device (besides per-model `preload`)."),
    KeyDoc("models", "list of model entries", "`[]`", "The models this node serves (below)."),
)

MODEL_KEYS: Tuple[KeyDoc, ...] = (
    KeyDoc("model_id", "string", "required", "Name clients use; also the child's `--alias` by default."),
    KeyDoc("path", "path", "required", "The exact GGUF file."),
    KeyDoc("roles", "list of strings", "`[]`", "Roles this model can satisfy (clients may ask for a role)."),
    KeyDoc("alias", "string", "the `model_id`", "Another name for the model; passed as `--alias`."),
    KeyDoc("ctx_size", "positive integer", "llama-server's", "`--ctx-size`"),
    KeyDoc("batch_size", "positive integer", "llama-server's", "`--batch-size`"),
    KeyDoc("ubatch_size", "positive integer", "llama-server's", "`--ubatch-size`"),
    KeyDoc("threads", "positive integer", "the device's core count (cpu) or llama-server's", "`--threads`"),
    KeyDoc("threads_batch", "positive integer", "llama-server's", "`--threads-batch`"),
    KeyDoc("gpu_layers", "non-negative integer, `auto` or `all`", "llama-server's", "`--n-gpu-layers`"),
    KeyDoc("main_gpu", "non-negative integer", "llama-server's", "`--main-gpu`"),
    KeyDoc("tensor_split", "list of non-negative numbers",
           "the devices' memory ratio on a device group, else llama-server's", "`--tensor-split a,b,...`"),
    KeyDoc("devices", "list of device names", "any one device",
           "The devices this model runs on. One name pins it there; several make a device group: one child "
           "spans them all (pinned to all of them) and holds every member while it runs."),
    KeyDoc("flash_attn", "boolean or `on`/`off`/`auto`", "llama-server's",
           "`--flash-attn on|off|auto`; `true` means `on`, `false` means `off`."),
    KeyDoc("server_args", "mapping", "`{}`",
           "Other llama-server flags: `true` = bare flag, `false`/null = omitted, lists repeat the flag "
           "(or join with commas where llama-server expects that)."),
    KeyDoc("preload", "boolean", "`false`", "Load this model at start-up."),
    KeyDoc("inference_probe_interval_s", "positive number", "unset (off)",
           "After this long without a successful request, send the ready child a 1-token completion (an "
           "embedding for embedding models); 3 failures in a row replace the child. Catches a child whose "
           "`/health` answers while its GPU is broken."),
    KeyDoc("idle_unload_s", "positive number or null", "the top-level value",
           "Per-model idle unload; null keeps it loaded forever."),
)


@attr.s(auto_attribs=True, frozen=True)
class ModelConfig:
    """One validated ``models[]`` entry."""

    model_id: str
    path: str
    roles: Tuple[str, ...] = ()
    alias: Optional[str] = None
    ctx_size: Optional[int] = None
    batch_size: Optional[int] = None
    ubatch_size: Optional[int] = None
    threads: Optional[int] = None
    threads_batch: Optional[int] = None
    gpu_layers: Optional[Any] = None
    main_gpu: Optional[int] = None
    tensor_split: Optional[Tuple[float, ...]] = None
    flash_attn: Optional[str] = None
    #: ``(flag, value)`` pairs, flag normalised to dashes, in config order.
    server_args: Tuple[Tuple[str, Any], ...] = ()
    preload: bool = False
    #: ``None`` = inherit the node default; ``0`` is never stored.
    idle_unload_s: Optional[float] = None
    inference_probe_interval_s: Optional[float] = None
    #: The devices the model runs on (one: pinned; several: a device group);
    #: empty = any single device.
    devices: Tuple[str, ...] = ()
    #: True when the entry says ``idle_unload_s: null`` (keep forever).
    keep_loaded: bool = False

    @property
    def served_name(self) -> str:
        """The name llama-server reports for this model (its first alias)."""
        return self.alias or self.model_id

    @property
    def names(self) -> Tuple[str, ...]:
        return (self.model_id,) if not self.alias else (self.model_id, self.alias)

    @property
    def parallel(self) -> int:
        """Concurrent slots llama-server runs for this model (``--parallel``)."""
        for flag, value in self.server_args:
            if flag in ("parallel", "np") and value is not None and value is not False:
                return int(value)
        return 1


@attr.s(auto_attribs=True, frozen=True)
class NodeConfig:
    """The validated agent configuration."""

    node_id: str
    listen_host: str = "127.0.0.1"
    listen_port: int = 8090
    #: A Twisted server endpoint description (never ``ssl:``: that becomes
    #: ``tcp:`` plus the tls_* files); None = TCP on listen_host:listen_port.
    listen: Optional[str] = None
    tls_cert_file: Optional[str] = None
    tls_key_file: Optional[str] = None
    tls_client_ca_file: Optional[str] = None
    advertise_url: str = ""
    backend: str = "auto"
    devices: Optional[Tuple[str, ...]] = None
    cpu_devices: Optional[Any] = None
    llama_server_bin: Optional[str] = None
    llama_server_startup_timeout_s: float = 30.0
    llama_server_probe_interval_s: float = 0.5
    llama_server_stop_timeout_s: float = 5.0
    llama_server_stall_timeout_s: float = 20.0
    max_pending_requests_per_device: int = 2
    device_memory_reserve_bytes: int = 0
    dispatcher_base_url: Optional[str] = None
    heartbeat_interval_s: float = 5.0
    api_keys: Tuple[str, ...] = attr.ib(default=(), repr=False)
    dispatcher_token: Optional[str] = attr.ib(default=None, repr=False)
    dispatcher_ca_file: Optional[str] = None
    dispatcher_client_cert_file: Optional[str] = None
    dispatcher_client_key_file: Optional[str] = None
    require_auth_off_loopback: bool = False
    max_request_body_bytes: int = 8 * 1024 * 1024
    max_connections: int = 1024
    request_read_timeout_s: float = 30.0
    idle_timeout_s: float = 60.0
    queue_timeout_s: float = 300.0
    stream_idle_timeout_s: float = 120.0
    request_timeout_s: float = 600.0
    shutdown_grace_s: float = 30.0
    idle_unload_s: Optional[float] = None
    state_dir: str = ""
    log_format: str = "text"
    models: Tuple[ModelConfig, ...] = ()
    #: ``(model_id, device or None)`` pairs from the top-level ``preload`` list.
    preload: Tuple[Tuple[str, Optional[str]], ...] = ()

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
        return self.listen_host not in LOOPBACK_HOSTS and not self.api_keys

    def idle_unload_for(self, model: ModelConfig) -> Optional[float]:
        if model.keep_loaded:
            return None
        return model.idle_unload_s if model.idle_unload_s is not None else self.idle_unload_s


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
    path: str,
    override_path: Optional[str] = None,
    *,
    check_files: bool = True,
    environ: Optional[Mapping[str, str]] = None,
) -> NodeConfig:
    """Load, merge and validate; the CLI and the twistd plugin both call this."""
    raw = load_yaml(path)
    if override_path:
        raw = deep_merge(raw, load_yaml(override_path))
    return validate(raw, check_files=check_files, environ=environ)


# --------------------------------------------------------------------------
# Validation


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


def _validate_model(i: int, data: Any, check_files: bool) -> ModelConfig:
    prefix = f"models[{i}]."
    if not isinstance(data, dict):
        raise _fail(f"models[{i}]", "a mapping", data)
    _unknown_keys(data, MODEL_KEYS, prefix)
    for required in ("model_id", "path"):
        if data.get(required) is None:
            raise ConfigError(f"{prefix}{required}: required")
    model_id = _string(prefix + "model_id", data["model_id"])
    model_path = _string(prefix + "path", data["path"])
    if check_files:
        if not os.path.exists(model_path):
            raise ConfigError(f"{prefix}path: file not found: {_show(model_path)}")
        if not os.path.isfile(model_path):
            raise ConfigError(f"{prefix}path: not a regular file: {_show(model_path)}")
    roles = _string_list(prefix + "roles", data.get("roles") or [])

    gpu_layers = data.get("gpu_layers")
    if gpu_layers is not None and gpu_layers not in ("auto", "all"):
        _non_negative_int(prefix + "gpu_layers", gpu_layers)

    tensor_split = data.get("tensor_split")
    if tensor_split is not None:
        if not isinstance(tensor_split, list) or not tensor_split or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in tensor_split
        ):
            raise _fail(prefix + "tensor_split", "a non-empty list of non-negative numbers", tensor_split)
        tensor_split = tuple(tensor_split)

    flash_attn = data.get("flash_attn")
    if flash_attn is not None:
        if flash_attn is True:
            flash_attn = "on"
        elif flash_attn is False:
            flash_attn = "off"
        else:
            flash_attn = _choice(prefix + "flash_attn", flash_attn, ("on", "off", "auto"))

    preload = _boolean(prefix + "preload", data.get("preload", False))

    devices = _string_list(prefix + "devices", data.get("devices") or [])
    for j, name in enumerate(devices):
        if name in devices[:j]:
            raise ConfigError(f"{prefix}devices[{j}]: {_show(name)} is listed twice")

    keep_loaded = "idle_unload_s" in data and data["idle_unload_s"] is None

    return ModelConfig(
        model_id=model_id,
        path=model_path,
        roles=roles,
        alias=_optional(data, "alias", prefix, _string),
        ctx_size=_optional(data, "ctx_size", prefix, _positive_int),
        batch_size=_optional(data, "batch_size", prefix, _positive_int),
        ubatch_size=_optional(data, "ubatch_size", prefix, _positive_int),
        threads=_optional(data, "threads", prefix, _positive_int),
        threads_batch=_optional(data, "threads_batch", prefix, _positive_int),
        gpu_layers=gpu_layers,
        main_gpu=_optional(data, "main_gpu", prefix, _non_negative_int),
        tensor_split=tensor_split,
        flash_attn=flash_attn,
        server_args=_server_args(prefix + "server_args", data.get("server_args") or {}, data),
        preload=preload,
        idle_unload_s=_optional(data, "idle_unload_s", prefix, _positive_number),
        inference_probe_interval_s=_optional(data, "inference_probe_interval_s", prefix, _positive_number),
        keep_loaded=keep_loaded,
        devices=tuple(devices),
    )


def default_state_dir(environ: Mapping[str, str]) -> str:
    base = environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "rolemesh-node")


def _resolve_binary(value: Optional[str], check_files: bool) -> Optional[str]:
    if value is None:
        return None
    value = _string("llama_server_bin", value)
    if not check_files:
        return value
    if os.sep not in value:
        found = shutil.which(value)
        if found is None:
            raise ConfigError(f"llama_server_bin: {_show(value)} not found on PATH")
        return found
    if not os.path.isfile(value) or not os.access(value, os.X_OK):
        raise ConfigError(f"llama_server_bin: not an executable file: {_show(value)}")
    return value


def _api_keys(data: Mapping[str, Any], environ: Mapping[str, str], check_files: bool) -> Tuple[str, ...]:
    keys: List[str] = []
    if data.get("api_key") is not None:
        keys.append(_string("api_key", data["api_key"]))
    keys.extend(_string_list("api_keys", data.get("api_keys") or []))
    env_name = _optional(data, "api_key_env", "", _string)
    if env_name is not None:
        value = environ.get(env_name, "").strip()
        if not value:
            raise ConfigError(f"api_key_env: environment variable {env_name} is not set or empty")
        keys.append(value)
    key_file = _optional(data, "api_key_file", "", _string)
    if key_file is not None and check_files:
        try:
            with open(key_file, encoding="utf-8") as f:
                from_file = [line.strip() for line in f if line.strip() and not line.startswith("#")]
        except OSError as e:
            raise ConfigError(f"api_key_file: cannot read {_show(key_file)}: {e.strerror}") from None
        if not from_file:
            raise ConfigError(f"api_key_file: {_show(key_file)} holds no key")
        keys.extend(from_file)
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


def _listener(
    data: Mapping[str, Any], host: str, port: int, check_files: bool
) -> Tuple[Optional[str], str, int, Optional[ServerTLSFiles]]:
    """``listen`` and the ``tls_*`` keys: (endpoint or None, host, port, TLS files).

    An ``ssl:`` description is turned into ``tcp:`` plus TLS files, so every
    TLS listener gets the agent's own TLS (TLS 1.2 at least, client
    certificates, reload).  For TCP descriptions host and port are taken
    from the description (they feed ``advertise_url`` and the
    unauthenticated-listener warning).
    """
    cert = _optional(data, "tls_cert_file", "", _string)
    key = _optional(data, "tls_key_file", "", _string)
    client_ca = _optional(data, "tls_client_ca_file", "", _string)
    listen = _optional(data, "listen", "", _string)
    if key is not None and cert is None:
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
            key = options.get("privateKey")
            if not key:
                raise ConfigError("listen: an ssl: description needs privateKey=<PEM key file>")
            cert = options.get("certKey") or key
            port_text = positional[1] if len(positional) > 1 else options.get("port")
            listen = "tcp:" + str(_endpoint_port("listen", port_text)) + "".join(
                f":{name}={escape_endpoint_value(options[name])}" for name in ("interface", "backlog")
                if name in options)
            positional, options = split_endpoint_description(listen)
            kind = "tcp"
        if kind in ("tcp", "tcp6"):
            port = _endpoint_port("listen", positional[1] if len(positional) > 1 else options.get("port"))
            host = options.get("interface") or ("0.0.0.0" if kind == "tcp" else "::")
        if check_files or kind in ("tcp", "tcp6"):
            from twisted.internet.endpoints import serverFromString

            try:
                serverFromString(None, listen)
            except Exception as e:  # noqa: BLE001 - Twisted says ValueError, TypeError, KeyError...
                raise ConfigError(f"listen: {_show(listen)} is not a usable endpoint description: "
                                  f"{type(e).__name__}: {e}") from None
    if cert is None:
        if client_ca is not None:
            raise ConfigError("tls_client_ca_file: needs tls_cert_file (mutual TLS is on top of TLS)")
        return listen, host, port, None
    return listen, host, port, ServerTLSFiles(cert, key or cert, client_ca)


_DISPATCHER_TLS_KEYS = ("dispatcher_ca_file", "dispatcher_client_cert_file", "dispatcher_client_key_file")


def _dispatcher_tls(data: Mapping[str, Any], url: Optional[str]) -> Dict[str, Optional[str]]:
    """The dispatcher_* TLS keys, checked against each other and the URL."""
    files = {key: _optional(data, key, "", _string) for key in _DISPATCHER_TLS_KEYS}
    if files["dispatcher_client_key_file"] is not None and files["dispatcher_client_cert_file"] is None:
        raise ConfigError("dispatcher_client_key_file: set dispatcher_client_cert_file too")
    used = [key for key, value in files.items() if value is not None]
    if used and not (url or "").startswith("https://"):
        raise ConfigError(f"{used[0]}: only used with an https:// dispatcher_base_url, "
                          f"got {_show(url) if url else 'none'}")
    return files


def validate(
    data: Mapping[str, Any],
    *,
    check_files: bool = True,
    environ: Optional[Mapping[str, str]] = None,
) -> NodeConfig:
    """Turn merged YAML data into a :class:`NodeConfig` or raise ConfigError.

    ``check_files=False`` skips checks that touch the filesystem (model paths,
    the binary, key files), for unit tests and documentation examples.
    """
    env = os.environ if environ is None else environ
    _unknown_keys(data, TOP_LEVEL_KEYS, "")

    node_id = _optional(data, "node_id", "", _string) or socket.gethostname()
    listen_host = _optional(data, "listen_host", "", _string) or "127.0.0.1"
    listen_port = data.get("listen_port", 8090)
    if isinstance(listen_port, bool) or not isinstance(listen_port, int) or not 0 <= listen_port <= 65535:
        raise _fail("listen_port", "a port number 0-65535", listen_port)
    listen, listen_host, listen_port, tls = _listener(data, listen_host, listen_port, check_files)
    advertise_url = _optional(data, "advertise_url", "", _url)
    if advertise_url is None:
        host = listen_host
        if host in ("0.0.0.0", "::", ""):
            host = socket.getfqdn()
        if ":" in host:
            host = f"[{host}]"
        advertise_url = f"{'https' if tls else 'http'}://{host}:{listen_port}"

    backend = _choice("backend", data.get("backend", "auto"), BACKENDS)
    devices = data.get("devices")
    if devices is not None:
        devices = _string_list("devices", devices)
        if not devices:
            raise _fail("devices", "a non-empty list of device names (or leave it unset)", [])
    cpu_devices = data.get("cpu_devices")
    if cpu_devices is not None and cpu_devices != "numa":
        if isinstance(cpu_devices, bool) or not isinstance(cpu_devices, int) or cpu_devices <= 0:
            raise _fail("cpu_devices", '"numa" or a positive integer', cpu_devices)

    raw_models = data.get("models") or []
    if not isinstance(raw_models, list):
        raise _fail("models", "a list of model entries", raw_models)
    models = tuple(_validate_model(i, m, check_files) for i, m in enumerate(raw_models))
    names: Dict[str, str] = {}
    for i, m in enumerate(models):
        for key, name in (("model_id", m.model_id), ("alias", m.alias)):
            if name is None:
                continue
            if name in names and not (key == "alias" and names[name] == f"models[{i}].model_id"):
                here, other = f"models[{i}].{key}", names[name]
                if key == "model_id" and other.endswith(".model_id"):
                    raise ConfigError(f"{here}: duplicate model_id {_show(name)} (also {other})")
                raise ConfigError(f"{here}: {_show(name)} already names another model ({other})")
            names[name] = f"models[{i}].{key}"

    idle = data.get("idle_unload_s")
    return NodeConfig(
        node_id=node_id,
        listen_host=listen_host,
        listen_port=listen_port,
        listen=listen,
        tls_cert_file=tls.cert_file if tls else None,
        tls_key_file=tls.key_file if tls else None,
        tls_client_ca_file=tls.client_ca_file if tls else None,
        advertise_url=advertise_url,
        backend=backend,
        devices=devices,
        cpu_devices=cpu_devices,
        llama_server_bin=_resolve_binary(data.get("llama_server_bin"), check_files),
        llama_server_startup_timeout_s=_positive_number(
            "llama_server_startup_timeout_s", data.get("llama_server_startup_timeout_s", 30.0)
        ),
        llama_server_probe_interval_s=_positive_number(
            "llama_server_probe_interval_s", data.get("llama_server_probe_interval_s", 0.5)
        ),
        llama_server_stall_timeout_s=_positive_number(
            "llama_server_stall_timeout_s", data.get("llama_server_stall_timeout_s", 20.0)
        ),
        llama_server_stop_timeout_s=_positive_number(
            "llama_server_stop_timeout_s", data.get("llama_server_stop_timeout_s", 5.0)
        ),
        max_pending_requests_per_device=_positive_int(
            "max_pending_requests_per_device", data.get("max_pending_requests_per_device", 2)
        ),
        device_memory_reserve_bytes=_non_negative_int(
            "device_memory_reserve_bytes", data.get("device_memory_reserve_bytes", 0)
        ),
        dispatcher_base_url=_optional(data, "dispatcher_base_url", "", _url),
        **_dispatcher_tls(data, _optional(data, "dispatcher_base_url", "", _url)),
        heartbeat_interval_s=_positive_number("heartbeat_interval_s", data.get("heartbeat_interval_s", 5.0)),
        api_keys=_api_keys(data, env, check_files),
        dispatcher_token=_optional(data, "dispatcher_token", "", _string),
        require_auth_off_loopback=_boolean("require_auth_off_loopback", data.get("require_auth_off_loopback", False)),
        max_request_body_bytes=_positive_int(
            "max_request_body_bytes", data.get("max_request_body_bytes", 8 * 1024 * 1024)
        ),
        max_connections=_positive_int("max_connections", data.get("max_connections", 1024)),
        request_read_timeout_s=_positive_number("request_read_timeout_s", data.get("request_read_timeout_s", 30.0)),
        idle_timeout_s=_positive_number("idle_timeout_s", data.get("idle_timeout_s", 60.0)),
        queue_timeout_s=_positive_number("queue_timeout_s", data.get("queue_timeout_s", 300.0)),
        stream_idle_timeout_s=_positive_number("stream_idle_timeout_s", data.get("stream_idle_timeout_s", 120.0)),
        request_timeout_s=_positive_number("request_timeout_s", data.get("request_timeout_s", 600.0)),
        shutdown_grace_s=_non_negative_number("shutdown_grace_s", data.get("shutdown_grace_s", 30.0)),
        idle_unload_s=None if idle is None else _positive_number("idle_unload_s", idle),
        state_dir=os.path.expanduser(_optional(data, "state_dir", "", _string) or default_state_dir(env)),
        log_format=_choice("log_format", data.get("log_format", "text"), LOG_FORMATS),
        models=models,
        preload=_preload(data.get("preload"), models),
    )


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
    data["api_keys"] = ["***"] * len(config.api_keys)
    data["dispatcher_token"] = "***" if config.dispatcher_token else None
    data["preload"] = [model if device is None else {"model": model, "device": device}
                       for model, device in config.preload]
    data["models"] = [_model_data(m) for m in config.models]
    return data
