"""The node as the inventory, the heartbeat and the status routes show it:
each device's and group's state (child, queue, memory, telemetry, typed
issues, back-off, load progress) and each model's memory estimate.  Read
only: nothing here changes the node.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from twisted.internet.interfaces import IReactorTime

from rolemesh.base.devices import DeviceMetrics, DeviceRef
from rolemesh.children import chat_templates
from rolemesh.children.restart_policy import same_command
from rolemesh.children.state import READY, STARTING
from rolemesh.children.supervisor import DeviceSupervisor
from rolemesh.children.telemetry import ChildTelemetry, device_issues, load_progress
from rolemesh.config.file import ModelConfig, NodeConfig
from rolemesh.event_loop.reactor import UsesReactor
from rolemesh.http.prompt_cache import PromptCacheTally
from rolemesh.node.leases import Acquisition
from rolemesh.node.payloads import device_state
from rolemesh.node.reload import leaving
from rolemesh.scheduling.placement import Placement
from rolemesh.scheduling.prefix import PrefixMemory
from rolemesh.scheduling.scheduler import Scheduler, superseded


class NodeViews(UsesReactor[IReactorTime]):
    """device_states, group_states, inventory, load_progress."""

    def __init__(
        self,
        config: Callable[[], NodeConfig],
        backend_name: str,
        devices: Callable[[], Sequence[DeviceRef]],
        supervisors: Mapping[str, DeviceSupervisor],
        groups: Mapping[str, List[str]],
        scheduler: Scheduler,
        metrics: Mapping[str, DeviceMetrics],
        placement: Placement,
        prefixes: PrefixMemory,
        telemetry_of: Callable[[str], Optional[ChildTelemetry]],
        cache_hit_rates: Callable[[], Dict[str, Optional[float]]],
        draining: Callable[[], bool],
        reactor: Optional[IReactorTime] = None,
        prompt_cache: Optional[PromptCacheTally] = None,
    ) -> None:
        self._config = config
        self._backend_name = backend_name
        #: The node's devices (read each time: a test may replace them).
        self._devices = devices
        self._supervisors = supervisors
        self._groups = groups
        self._scheduler = scheduler
        self._metrics = metrics
        self._placement = placement
        self._prefixes = prefixes
        #: Prompt tokens from llama-server's cache vs processed, per device and model.
        self._prompt_cache = prompt_cache if prompt_cache is not None else PromptCacheTally()
        #: The latest telemetry sample of a device's or group's child.
        self._telemetry_of = telemetry_of
        self._cache_hit_rates = cache_hit_rates
        self._draining = draining
        self._reactor = reactor
        #: device -> when its child began starting (reactor seconds).
        self._loading_since: Dict[str, float] = {}

    def child_starting(self, device: str) -> None:
        """``device``'s child began starting now (its load progress counts from here)."""
        self._loading_since[device] = self.reactor.seconds()

    def load_progress(self, device: str) -> Optional[Dict[str, Any]]:
        """How far the device's child has got loading (None unless it is
        starting), from the child's own output lines."""
        supervisor = self._supervisors[device]
        if supervisor.state != STARTING or supervisor.model is None:
            return None
        now = self.reactor.seconds()
        since = self._loading_since.get(device, now)
        return load_progress(list(supervisor.logs), supervisor.model.model_id, since).to_json(now)

    def device_states(self) -> List[Dict[str, Any]]:
        """Per-device state as the inventory and the heartbeat report it."""
        now = self.reactor.seconds()
        out = []
        for device in self._devices():
            supervisor = self._supervisors[device.name]
            book = self._scheduler.devices[device.name]
            metrics = self._metrics.get(device.name)
            snap = supervisor.snapshot()
            entry = device_state(
                device.name, snap["state"], now=now, model=snap["model"], port=snap["port"], pid=snap["pid"],
                in_flight=len(book.running), queued=len(book.queue), pending_limit=self._scheduler.pending_limit,
                restarts=snap["restarts"], metrics=metrics,
            )
            entry.update(self._telemetry_state(supervisor, len(book.queue), metrics))
            entry["stale"] = self.stale(device.name)
            entry["group"] = self._group_on(device.name)
            out.append(entry)
        return out

    def stale(self, device: str) -> bool:
        """Whether the device's child runs (or loads) a command the config no
        longer has: a reload changed it."""
        supervisor = self._supervisors[device]
        held = supervisor.model
        if held is None or supervisor.state not in (STARTING, READY):
            return False
        current = next((m for m in self._config().models if m.model_id == held.model_id), None)
        return current is not None and current is not held and not same_command(held, current)

    def leaving_models(self) -> Tuple[ModelConfig, ...]:
        """Models a reload removed whose requests still run or wait here
        (listed until they are done: :func:`rolemesh.node.reload.leaving`)."""
        pending = []
        for name, book in self._scheduler.devices.items():
            held = self._supervisors[name].model
            for ticket in (*book.running, *book.queue):
                request = ticket.context
                if isinstance(request, Acquisition):
                    pending.append(request.model)
                elif held is not None and ticket.model_id in (held.model_id, superseded(held.model_id)):
                    pending.append(held)  # admitted at once (lease_now) on the child of this record
        return leaving(self._config(), pending)

    def inventory(self) -> Dict[str, Any]:
        config = self._config()
        states = {s["device"]: s for s in self.device_states()}
        devices = []
        for device in self._devices():
            entry = {"ref": device.to_json(), **states[device.name]}
            supervisor = self._supervisors[device.name]
            entry["last_error"] = supervisor.last_error
            entry["last_error_code"] = supervisor.last_error_code
            entry["warnings"] = supervisor.warnings
            entry["backoff"] = self._backoff_json(supervisor)
            entry.update(self._telemetry_blocks(device.name))
            entry["prompt_tokens"] = self._prompt_cache.device_json(device.name)
            devices.append(entry)
        warnings = [w for s in self._supervisors.values() for w in s.warnings]
        if config.exposed_without_key:
            warnings.append(f"listening on {', '.join(config.addresses)} without an api_key: anyone who can reach "
                            "the port can use every model on this node")
        return {
            "node_id": config.node_id,
            "backend": self._backend_name,
            "draining": self._draining(),
            "warnings": warnings,
            "devices": devices,
            "groups": self.group_states(),
            "models": [{**self._placement.model_memory(m), "chat_template": chat_templates.describe_model(m)}
                       for m in config.models],
            "prefix_memory": {**self._prefixes.to_json(), "affinity": config.prefix_affinity,
                              "per_model_hit_rate": self._cache_hit_rates()},
        }

    def group_states(self) -> List[Dict[str, Any]]:
        """Each device group: its members and its child, like a device's state."""
        out = []
        for group, members in self._groups.items():
            supervisor, book = self._supervisors[group], self._scheduler.devices[group]
            snap = supervisor.snapshot()
            out.append({
                "group": group, "members": list(members), "state": snap["state"], "model": snap["model"],
                "port": snap["port"], "pid": snap["pid"], "in_flight": len(book.running),
                "queued": len(book.queue), "pending_limit": self._scheduler.pending_limit,
                "restarts": snap["restarts"], "last_error": supervisor.last_error,
                "backoff": self._backoff_json(supervisor), "memory_total_bytes": self._placement.capacity(group),
                **self._telemetry_state(supervisor, len(book.queue), None),
                **self._telemetry_blocks(group),
                "prompt_tokens": self._prompt_cache.device_json(group),
            })
        return out

    def _telemetry_state(self, supervisor: DeviceSupervisor, queued: int,
                         metrics: Optional[DeviceMetrics]) -> Dict[str, Any]:
        """A device's routing figures (slots, queue, tokens/s), its typed
        issues and its load progress, for the heartbeat and the inventory."""
        telemetry = self._telemetry_of(supervisor.name)
        deferred = telemetry.requests_deferred if telemetry is not None else None
        return {
            "slots_total": telemetry.slots_total if telemetry is not None else None,
            "slots_busy": telemetry.slots_busy if telemetry is not None else None,
            "slots_free": telemetry.slots_free if telemetry is not None else None,
            "queue_depth": queued + int(deferred or 0),
            "tokens_per_s": telemetry.tokens_per_s if telemetry is not None else None,
            "issues": device_issues(supervisor, telemetry, metrics),
            "load": self.load_progress(supervisor.name),
        }

    def _telemetry_blocks(self, name: str) -> Dict[str, Any]:
        """The inventory's ``slots`` and ``throughput`` blocks of a device or group."""
        telemetry = self._telemetry_of(name)
        return {
            "slots": telemetry.slots_json() if telemetry is not None else None,
            "throughput": telemetry.throughput_json() if telemetry is not None else None,
        }

    def _backoff_json(self, supervisor: DeviceSupervisor) -> List[Dict[str, Any]]:
        """The models backing off on a device or group: until when (reactor
        seconds: POSIX time), the Retry-After they get now, and why."""
        now = self.reactor.seconds()
        return [backoff.to_json(now) for backoff in supervisor.backoffs()]

    def _group_on(self, device: str) -> Optional[str]:
        """The device group whose child holds (or is getting) ``device`` now."""
        for group, members in self._groups.items():
            if device in members and self._scheduler.devices[group].occupied:
                return group
        return None
