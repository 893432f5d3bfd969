"""Pure builders for the JSON bodies the node sends to a RoleMesh dispatcher.

They take plain records and return plain dicts, with no I/O and no clock of
their own, so that ``GET /v1/node/registration`` and the dispatcher client
produce byte-for-byte the same registration, and so the shapes can be checked
against the shipped JSON Schemas (``rolemesh/schemas/*.schema.json``) by
property tests.  Secrets (``api_keys``, ``dispatcher_token``) are never read
here, so they cannot end up in a payload.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

from rolemesh.base.devices import DeviceMetrics, DeviceRef
from rolemesh.children.adapters import adapter_served_models
from rolemesh.children.llama_args import build_argv
from rolemesh.children.state import DeviceState
from rolemesh.config.file import ModelConfig, NodeConfig

#: The OpenAI-compatible endpoints the node proxies, plus SSE streaming.
CAPABILITIES = ("chat.completions", "completions", "embeddings", "streaming")
#: The spellings of llama-server's flag that turns ``/v1/embeddings`` on
#: (without it, llama-server answers 501; chat and completions work either way).
EMBEDDINGS_FLAGS = frozenset({"--embeddings", "--embedding"})


def model_capabilities(model: ModelConfig) -> List[str]:
    """What the model's child serves, from the command line it is started
    with: ``embeddings`` only when that has ``--embeddings``."""
    served = EMBEDDINGS_FLAGS.intersection(build_argv("llama-server", model, 0))
    return [c for c in CAPABILITIES if c != "embeddings" or served]

#: Child states a heartbeat may report for a device: the supervisor's.
DEVICE_STATES = tuple(state.value for state in DeviceState)

#: The heartbeat body's version.  2 added per device ``slots_total``,
#: ``slots_busy``, ``slots_free``, ``queue_depth``, ``tokens_per_s``,
#: ``issues`` and ``load`` (see docs/dispatcher-protocol.md); every field of
#: version 1 is still there with the same meaning.
HEARTBEAT_SCHEMA_VERSION = 2


def registration_payload(
    config: NodeConfig,
    backend: str,
    devices: Sequence[DeviceRef],
    version: str,
    memory: Optional[Mapping[str, Mapping[str, Any]]] = None,
) -> Dict[str, Any]:
    """The body of ``POST <dispatcher>/v1/nodes/register``.

    ``backend`` is the resolved backend name (never ``auto``); ``devices`` are
    the devices the node actually serves on (after the allow-list).
    ``memory`` maps a model_id to its placement (``Node.model_memory``): the
    estimate's total bytes, the devices or group it may use and those that can
    hold it, so a dispatcher can place models across nodes.  Each of a
    model's ``lora_adapters`` follows it as an entry of its own
    (:func:`rolemesh.children.adapters.adapter_served_models`).
    """
    served = {m.model_id: model_capabilities(m) for m in config.models}
    entries: List[Dict[str, Any]] = []
    for m in config.models:
        entry = {
            "model_id": m.model_id,
            "alias": m.alias,
            "roles": list(dict.fromkeys(m.roles)),
            "capabilities": served[m.model_id],
            **_placement(memory.get(m.model_id) if memory else None),
        }
        entries.append(entry)
        entries.extend(adapter_served_models(entry, m))  # each LoRA adapter is a model id of its own
    return {
        "node_id": config.node_id,
        "advertise_url": config.advertise_url,
        "agent_version": version,
        "backend": backend,
        "devices": [d.to_json() for d in devices],
        "served_models": entries,
        # What some model serves (embeddings: a model started with --embeddings).
        "capabilities": [c for c in CAPABILITIES if any(c in caps for caps in served.values())],
        "max_pending_requests_per_device": config.max_pending_requests_per_device,
    }


def _placement(memory: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    if memory is None:
        return {}
    estimate = memory.get("memory_estimate")
    return {
        "memory_estimate_bytes": estimate["total_bytes"] if estimate else None,
        "devices": list(memory.get("devices", ())),
        "fits_on": list(memory.get("fits_on", ())),
    }


def device_state(
    device: str,
    state: str,
    *,
    now: float,
    model: Optional[str] = None,
    port: Optional[int] = None,
    pid: Optional[int] = None,
    in_flight: int = 0,
    queued: int = 0,
    pending_limit: int,
    restarts: int = 0,
    metrics: Optional[DeviceMetrics] = None,
) -> Dict[str, Any]:
    """One entry of a heartbeat's ``devices`` list, in the documented shape.

    The one place these key names live (``Node.device_states`` builds its
    entries with it and adds telemetry); turns the metrics record into JSON
    with its age.
    """
    return {
        "device": device,
        "state": state,
        "model": model,
        "port": port,
        "pid": pid,
        "in_flight": in_flight,
        "queued": queued,
        "pending_limit": pending_limit,
        "restarts": restarts,
        "metrics": None if metrics is None else metrics.to_json(now),
    }


def heartbeat_payload(
    node_id: str,
    seq: int,
    now: float,
    devices: Sequence[Mapping[str, Any]],
    cache_hit_rate: Optional[Mapping[str, Optional[float]]] = None,
    prompt_cache_hit_rate: Optional[Mapping[str, Optional[float]]] = None,
) -> Dict[str, Any]:
    """The body of ``POST <dispatcher>/v1/nodes/heartbeat``.

    ``cache_hit_rate`` (model id -> share of its requests whose prompt
    prefix was found on a device; None: none looked up) shows a dispatcher
    where conversations stick; ``prompt_cache_hit_rate`` (model id -> share
    of its prompt tokens llama-server served from its cache, from the
    answers' ``timings``; None: none reported yet) what that saved.

    ``seq`` increases by one per heartbeat for the life of the process, so the
    dispatcher can drop reordered or duplicated beats; ``now`` is POSIX
    seconds.  Each entry of ``devices`` is a per-device state dict (see
    :func:`device_state`); a ``metrics`` value that is still a
    :class:`DeviceMetrics` record is converted with its age relative to
    ``now``.  Entries are copied, never mutated.
    """
    entries: List[Dict[str, Any]] = []
    for d in devices:
        entry = dict(d)
        metrics = entry.get("metrics")
        if isinstance(metrics, DeviceMetrics):
            entry["metrics"] = metrics.to_json(now)
        entries.append(entry)
    out = {"schema_version": HEARTBEAT_SCHEMA_VERSION, "node_id": node_id, "seq": seq, "time": now,
           "devices": entries}
    if cache_hit_rate is not None:
        out["cache_hit_rate"] = dict(cache_hit_rate)
    if prompt_cache_hit_rate is not None:
        out["prompt_cache_hit_rate"] = dict(prompt_cache_hit_rate)
    return out


#: The heartbeat body's version when it carries ``last_seq`` (sent to a
#: dispatcher that takes events; one that does not gets version 2, unchanged).
HEARTBEAT_EVENTS_SCHEMA_VERSION = 3
#: The events body's version (``POST <dispatcher>/v1/nodes/events``).
EVENTS_SCHEMA_VERSION = 1


def with_last_seq(heartbeat: Mapping[str, Any], last_seq: int) -> Dict[str, Any]:
    """A heartbeat body that also says the last events ``seq`` sent before
    its state was read: a dispatcher that did not get every delta up to it
    missed one, and takes this full state instead."""
    return dict(heartbeat, schema_version=HEARTBEAT_EVENTS_SCHEMA_VERSION, last_seq=last_seq)


def events_payload(node_id: str, seq: int, now: float, events: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """The body of ``POST <dispatcher>/v1/nodes/events``: the changes since
    the last one (each a :class:`rolemesh.node.feed.NodeEvent`'s JSON),
    coalesced, with ``seq`` one more than the last events body's."""
    return {"schema_version": EVENTS_SCHEMA_VERSION, "node_id": node_id, "seq": seq, "time": now,
            "events": [dict(e) for e in events]}


def deregistration_payload(node_id: str) -> Dict[str, Any]:
    """The body of ``POST <dispatcher>/v1/nodes/deregister``."""
    return {"node_id": node_id}
