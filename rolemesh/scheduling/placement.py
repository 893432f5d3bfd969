"""Where a model may run and whether it can ever fit there: the node's lanes
for a model, its memory estimates, each lane's total memory, and the
placement a request is queued with (or the refusal it gets at once).

No I/O but the GGUF header read of a model first seen (``read_facts``,
memory-mapped, milliseconds); the answers are kept until :meth:`forget`
(a reload, a device's memory sample).
"""

from __future__ import annotations

from typing import Any, Callable, Container, Dict, List, Mapping, Optional, Sequence, Tuple

from rolemesh.backends.groups import group_name
from rolemesh.base import errors
from rolemesh.base.devices import DeviceMetrics, DeviceRef
from rolemesh.config.file import ModelConfig, NodeConfig
from rolemesh.scheduling.estimate import (
    AdapterFacts,
    GGUFFacts,
    MemoryEstimate,
    capacity_of,
    estimate_on,
    gib,
    shared_memory,
)

#: (eligible lanes, need in bytes per lane, pinned lane) for a request.
Placed = Tuple[List[str], Dict[str, int], Optional[str]]

#: Placements kept at most (pinned loads name devices: bounded all the same).
MAX_PLACEMENTS = 1024


class Placement:
    """Lanes, estimates, capacity and fit for the models of a node's config."""

    def __init__(
        self,
        config: Callable[[], NodeConfig],
        backend_name: str,
        devices: Callable[[], Sequence[DeviceRef]],
        groups: Mapping[str, List[str]],
        metrics: Mapping[str, DeviceMetrics],
        lanes: Container[str],
        facts: Optional[Mapping[str, Optional[GGUFFacts]]] = None,
        read_facts: Optional[Callable[[str], Optional[GGUFFacts]]] = None,
        read_adapter: Optional[Callable[[str], Optional[AdapterFacts]]] = None,
    ) -> None:
        #: The node's current config (a reload replaces it).
        self._config = config
        self._backend_name = backend_name
        #: The node's devices (read each time: a test may replace them).
        self._devices = devices
        #: Device groups: group name -> member device names.
        self._groups = groups
        #: The last metrics sample per device (a device's total may come from it).
        self._metrics = metrics
        #: The lanes the node has (its scheduler's books).
        self._lanes = lanes
        #: GGUF header facts per model path (None: unreadable, no memory
        #: checks); a path not seen yet -- a model a reload added or moved --
        #: is read with ``read_facts`` on first use (header only: milliseconds).
        self.facts: Dict[str, Optional[GGUFFacts]] = dict(facts or {})
        self._read_facts = read_facts
        #: LoRA adapter header facts per adapter path, read with ``read_adapter`` on first use (None: unreadable).
        self.adapter_facts: Dict[str, Optional[AdapterFacts]] = {}
        self._read_adapter = read_adapter
        #: Estimates worked out once per (model record, lane, reserve): pure,
        #: and asked for several times per request.
        self._estimates: Dict[Tuple[ModelConfig, str, int], MemoryEstimate] = {}
        #: Placements worked out once per (model record, pinned lane) and
        #: kept until the config or a device's memory sample changes: every
        #: request asks, and the answer depends on nothing else.
        self._placements: Dict[Tuple[ModelConfig, Optional[str]], Placed] = {}

    def forget(self) -> None:
        """Work placements out anew (the config or a device's memory changed)."""
        self._placements.clear()

    def lanes_for(self, model: ModelConfig) -> List[str]:
        """Where ``model`` may run: its ``devices`` (one device, or their
        group), else any single device."""
        if model.devices:
            return [group_name(model.devices)]
        return [d.name for d in self._devices()]

    def preload_targets(self, model: ModelConfig) -> List[Optional[str]]:
        """Where a ``preload: true`` model loads at start-up: anywhere (the
        scheduler's choice) for one replica; for ``min_replicas`` of them,
        that many of its devices, those no ``preload`` entry names first."""
        if model.min_replicas <= 1:
            return [None]
        named = {device for _, device in self._config().preload}
        lanes = self.lanes_for(model)
        ordered = [lane for lane in lanes if lane not in named] + [lane for lane in lanes if lane in named]
        return list(ordered[:model.min_replicas])

    def _members(self, lane: str) -> List[DeviceRef]:
        names = self._groups.get(lane, [lane])
        return [d for d in self._devices() if d.name in names]

    def shared_memory(self) -> bool:
        """Whether the devices share one memory pool (a group's free memory is its least member's)."""
        return shared_memory(self._backend_name)

    def capacity(self, lane: str) -> Optional[int]:
        """Total memory of a device, or of a group's members (once for a shared pool)."""
        totals = []
        for d in self._members(lane):
            sample = self._metrics.get(d.name)
            totals.append(d.memory_total_bytes or (sample.memory_total_bytes if sample else None))
        return capacity_of(totals, self._backend_name)

    def estimate_for(self, model: ModelConfig, lane: Optional[str] = None) -> Optional[MemoryEstimate]:
        """``model``'s memory estimate on ``lane`` (default: its first lane);
        None when its GGUF header could not be read."""
        if model.path not in self.facts and self._read_facts is not None:
            self.facts[model.path] = self._read_facts(model.path)
        facts = self.facts.get(model.path)
        if facts is None:
            return None
        lane = lane or self.lanes_for(model)[0]
        reserve = self._config().device_memory_reserve_bytes
        key = (model, lane, reserve)  # a reload brings new ModelConfig records, so new keys
        estimate = self._estimates.get(key)
        if estimate is None:
            members = len(self._groups.get(lane, [lane]))
            draft = model.draft_model
            if draft is not None and draft not in self.facts and self._read_facts is not None:
                self.facts[draft] = self._read_facts(draft)
            estimate = self._estimates[key] = estimate_on(facts, model, self._backend_name, members, reserve,
                                                          self.facts.get(draft) if draft is not None else None,
                                                          self._adapters_of(model))
        return estimate

    def _adapters_of(self, model: ModelConfig) -> List[AdapterFacts]:
        """The header facts of ``model``'s LoRA adapters that could be read."""
        for adapter in model.lora_adapters:
            if adapter.path not in self.adapter_facts and self._read_adapter is not None:
                self.adapter_facts[adapter.path] = self._read_adapter(adapter.path)
        found = (self.adapter_facts.get(adapter.path) for adapter in model.lora_adapters)
        return [facts for facts in found if facts is not None]

    def fits_on(self, model: ModelConfig) -> List[str]:
        """The lanes whose total memory can ever hold ``model`` (all of them
        when the estimate or a total is unknown)."""
        out = []
        for lane in self.lanes_for(model):
            need, cap = self.estimate_for(model, lane), self.capacity(lane)
            if need is None or cap is None or need.total_bytes <= cap:
                out.append(lane)
        return out

    def too_large(self, model: ModelConfig) -> Optional[errors.ApiError]:
        """``model_too_large`` when no lane can ever hold ``model``, else None."""
        lanes = self.lanes_for(model)
        if not lanes or self.fits_on(model):
            return None
        largest = max(lanes, key=lambda lane: self.capacity(lane) or 0)
        need = self.estimate_for(model, largest)
        assert need is not None
        what = "device group" if largest in self._groups else "device"
        return errors.model_too_large(
            model.model_id, need.describe(),
            f"the largest {what} it may use, {largest}, has {gib(self.capacity(largest))} in total")

    def placement(self, model: ModelConfig, device: Optional[str]) -> Placed:
        """(eligible lanes, need per lane, pinned lane) for a request; raises
        the ApiError that refuses it.  Shared, so never changed by a caller."""
        key = (model, device)
        placed = self._placements.get(key)
        if placed is None:
            placed = self._place(model, device)  # a refusal is not kept: worked out again, and rare
            if len(self._placements) >= MAX_PLACEMENTS:
                self._placements.clear()
            self._placements[key] = placed
        return placed

    def _place(self, model: ModelConfig, device: Optional[str]) -> Placed:
        lanes = self.lanes_for(model)
        missing = [lane for lane in lanes if lane not in self._lanes]
        if missing:  # a reload named a device group this node was not started with
            raise errors.ApiError(
                503, f"model {model.model_id!r} runs on the device group {missing[0]}, which this node did not "
                "have at start-up; restart the agent to use it", "server_error", "restart_required", 60)
        if device is not None and device not in lanes:
            holder = [lane for lane in lanes if device in self._groups.get(lane, [lane])]
            if not holder:
                raise errors.ApiError(
                    400, f"model {model.model_id!r} runs on {', '.join(lanes)}, not on {device}",
                    "invalid_request_error", "device_not_eligible")
            device = holder[0]
        fits = self.fits_on(model)
        if not fits:  # what too_large() checks first: asked only when it can say something
            problem = self.too_large(model)
            if problem is not None:
                raise problem
        need = {}
        for lane in lanes:
            e = self.estimate_for(model, lane)
            if e is not None:
                need[lane] = e.total_bytes
        return fits, need, device

    def model_memory(self, model: ModelConfig) -> Dict[str, Any]:
        """A model's memory estimate and the devices/groups that can hold it."""
        e = self.estimate_for(model)
        return {
            "model_id": model.model_id,
            "devices": self.lanes_for(model),
            "memory_estimate": e.to_json() if e is not None else None,
            "fits_on": self.fits_on(model),
        }
