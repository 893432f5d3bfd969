"""The node: every device's supervisor, the scheduler between them, and the
metrics sampler -- the one place a request gets a device from.

``acquire(model)`` queues a request (429 when full), and once the scheduler
lets it run, has the device's supervisor ensure the model is loaded; it fires
with a :class:`Lease` (where to send the request) that the caller releases
when the answer is done.  Cancelling the Deferred (a client that went away)
leaves the queue at once.

``Node`` is the composition; each concern is a part in its own module (see
docs/architecture.md, "The node's parts"): :mod:`rolemesh.scheduling.placement`
(lanes, estimates, fit), :mod:`rolemesh.node.admission` (acquire, lease_now,
unload, queue timeouts), :mod:`rolemesh.node.leases` (a ticket that may run
becomes a lease; release, check and retry), :mod:`rolemesh.node.drain`,
:mod:`rolemesh.node.timers` (idle unload, inference probes),
:mod:`rolemesh.node.sampling` (the metrics tick) and
:mod:`rolemesh.node.views` (inventory, device and group states).  What is
left here is the wiring, the supervisors' state changes, start-up preloads
and reloads (adopted by :mod:`rolemesh.node.adoption`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from twisted.application.service import MultiService
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from rolemesh.base import errors
from rolemesh.base.devices import DeviceMetrics, DeviceRef
from rolemesh.base.events import Events
from rolemesh.base.interfaces import IDeviceBackend, IHTTPClientReactor
from rolemesh.children.readahead import ReadAhead
from rolemesh.children.record import StateChange
from rolemesh.children.state import FAILED, READY, STARTING, STOPPED
from rolemesh.children.supervisor import DeviceSupervisor
from rolemesh.children.telemetry import TelemetrySampler
from rolemesh.children.views import ChildEndpoint
from rolemesh.config.file import ModelConfig, NodeConfig
from rolemesh.event_loop.reactor import UsesReactor
from rolemesh.http.prompt_cache import PromptCacheTally
from rolemesh.node.admission import Admission
from rolemesh.node.adoption import ConfigAdoption
from rolemesh.node.drain import Drain
from rolemesh.node.feed import NodeFeed
from rolemesh.node.leases import Lease, LeaseStarts, Pin, refuse_waiting
from rolemesh.node.names import ModelNames
from rolemesh.node.reload import needs_new_child
from rolemesh.node.sampling import METRICS_INTERVAL_S, METRICS_TIMEOUT_S, DeviceSampler
from rolemesh.node.timers import DeviceTimers
from rolemesh.node.views import NodeViews
from rolemesh.scheduling.estimate import AdapterFacts, GGUFFacts, MemoryEstimate
from rolemesh.scheduling.fairqueue import DEFAULT_SHARE, Share
from rolemesh.scheduling.placement import Placement
from rolemesh.scheduling.prefix import PrefixMemory
from rolemesh.scheduling.scheduler import Scheduler

__all__ = ["METRICS_INTERVAL_S", "METRICS_TIMEOUT_S", "Lease", "Node"]

log = Logger(namespace="rolemesh.node")


class Node(MultiService, UsesReactor[IHTTPClientReactor]):
    """Supervisors + scheduler + metrics for this host's devices: the composition of the node's parts."""

    def __init__(
        self,
        config: NodeConfig,
        backend: IDeviceBackend,
        devices: Sequence[DeviceRef],
        supervisors: Sequence[DeviceSupervisor],
        reactor: Optional[IHTTPClientReactor] = None,
        metrics_interval: float = METRICS_INTERVAL_S,
        telemetry_get: Optional[Callable[..., Deferred]] = None,
        facts: Optional[Mapping[str, Optional[GGUFFacts]]] = None,
        read_facts: Optional[Callable[[str], Optional[GGUFFacts]]] = None,
        read_adapter: Optional[Callable[[str], Optional[AdapterFacts]]] = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.devices = list(devices)
        self._reactor = reactor
        self.supervisors: Dict[str, DeviceSupervisor] = {}
        for supervisor in supervisors:
            self.supervisors[supervisor.name] = supervisor
            supervisor.setServiceParent(self)
            supervisor.subscribe(self._supervisor_changed)
        #: Device groups (a supervisor whose child spans several devices):
        #: group name -> member device names.
        self.groups: Dict[str, List[str]] = {
            s.name: [d.name for d in s.members] for s in supervisors if len(getattr(s, "members", ())) > 1
        }
        self.scheduler = Scheduler(
            [d.name for d in self.devices], config.max_pending_requests_per_device,
            lambda ticket: self.leases.start(ticket), groups=self.groups,
        )
        #: What a request's ``model`` names (rolemesh.node.names).
        self.names = ModelNames(self._current_config, self.loaded_on)
        #: The last device metrics sample per device (stale ones marked so).
        self.metrics: Dict[str, DeviceMetrics] = {}
        #: Lanes, memory estimates, capacity and fit.
        self.placement = Placement(self._current_config, backend.name, self._current_devices, self.groups,
                                   self.metrics, self.scheduler.devices,
                                   facts=facts, read_facts=read_facts, read_adapter=read_adapter)
        #: GGUF header facts per model path, and per LoRA adapter path (the placement's).
        self.facts = self.placement.facts
        self.adapter_facts = self.placement.adapter_facts
        #: The node's events (queue_full, queue_timeout, queue_wait,
        #: idle_unload, child_state), for the metrics module.
        self.events = Events()
        #: Start-up preloads not finished yet (``GET /ready`` waits for them).
        self.preloading = 0
        self._compose_request_path(reactor)
        self._compose_observers(reactor, metrics_interval, telemetry_get)

    def _compose_request_path(self, reactor: Optional[IHTTPClientReactor]) -> None:
        """The parts a request goes through: admission, leases, drain, timers."""
        current, draining, emit = self._current_config, self._is_draining, self.events.emit
        books = self.scheduler.devices
        self.drainer = Drain(books, functools.partial(refuse_waiting, self.scheduler), emit, reactor=reactor)
        self.timers = DeviceTimers(self.supervisors, self.scheduler.is_idle,
                                   lambda model: self.config.idle_unload_for(model), lambda: bool(self.running),
                                   draining, emit, reactor=reactor)
        #: Reads a model's GGUF ahead while a switch to it waits (rolemesh.children.readahead).
        self.read_ahead = ReadAhead(lambda: self.reactor)
        #: Which device last served each prompt prefix (prefix affinity).
        self.prefixes = PrefixMemory(self.config.prefix_memory_entries if self.config.prefix_affinity else 0)
        #: Prompt tokens served from llama-server's cache vs processed, per (device, model).
        self.prompt_cache = PromptCacheTally()
        self.leases = LeaseStarts(self.scheduler, self.supervisors, current, draining, self._request_started,
                                  self._device_quiet, self.timers.cancel_idle, needs_new_child, reactor=reactor)
        self.admission = Admission(self.scheduler, self.supervisors, current, self.placement.placement,
                                   self.prefixes, draining, self.loaded_on, lambda model: self.read_ahead.warm(model),
                                   self._request_started, self.leases.release, emit, reactor=reactor)
        #: What a reload changes in the running children (rolemesh.node.adoption).
        self.adoption = ConfigAdoption(self.supervisors, self.scheduler, self.prefixes, current,
                                       self.placement.lanes_for, self.placement.forget, self.timers.cancel_idle,
                                       self.timers.arm_idle)

    def _compose_observers(self, reactor: Optional[IHTTPClientReactor], metrics_interval: float,
                           telemetry_get: Optional[Callable[..., Deferred]]) -> None:
        """The parts that watch and show the node: telemetry, sampling, views, the feed."""
        books = self.scheduler.devices
        #: The children's own telemetry, sampled on the metrics interval.
        self.telemetry = TelemetrySampler(self.supervisors, reactor=reactor, get=telemetry_get)
        self.sampler = DeviceSampler(
            sample=lambda refs: self.backend.sample(refs), devices=self._current_devices, groups=self.groups,
            lanes=books, set_free_memory=self.scheduler.set_free_memory,
            shared_memory=self.placement.shared_memory, changed=self.placement.forget,
            check_feed=lambda: self.feed.check(), sample_telemetry=lambda: self.telemetry.sample(),
            metrics=self.metrics, interval=metrics_interval, reactor=reactor)
        self.views = NodeViews(
            self._current_config, self.backend.name, self._current_devices, self.supervisors, self.groups,
            self.scheduler, self.metrics, self.placement, self.prefixes, lambda name: self.telemetry.latest(name),
            self.cache_hit_rates, self._is_draining, reactor=reactor, prompt_cache=self.prompt_cache)
        #: The node's typed events (rolemesh.node.feed): the events route's and the dispatcher's source.
        self.feed = NodeFeed(reactor)
        self.feed.watch(self)

    def _current_config(self) -> NodeConfig:
        return self.config

    def _current_devices(self) -> List[DeviceRef]:
        return self.devices

    def _is_draining(self) -> bool:
        return self.drainer.draining

    @property
    def draining(self) -> bool:
        """New requests are refused (a drain began, or the node stopped)."""
        return self.drainer.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.drainer.draining = value

    # -- lifecycle --------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self.sampler.start()
        for model in self.config.models:
            if model.preload:
                for device in self.preload_targets(model):
                    self._startup_preload(self.preload(model, device))
        for model_id, device in self.config.preload:
            self._startup_preload(self.preload(self.config.model(model_id), device))

    def _startup_preload(self, d: "Deferred[Optional[str]]") -> None:
        self.preloading += 1

        def done(result: Optional[str]) -> None:
            self.preloading -= 1

        d.addBoth(done)

    def preload_targets(self, model: ModelConfig) -> List[Optional[str]]:
        """Where a ``preload: true`` model loads (see :meth:`Placement.preload_targets`)."""
        return self.placement.preload_targets(model)

    def preload(self, model: ModelConfig, device: Optional[str] = None) -> "Deferred[Optional[str]]":
        """Load ``model`` as a request would, then release the device at once."""
        d = self.acquire(model, device=device)

        def loaded(lease: Lease) -> str:
            lease.release()
            return lease.device

        def failed(f: Failure) -> None:
            log.error("preloading {model} failed: {error}", model=model.model_id, error=f.getErrorMessage())
            return None

        done: "Deferred[Optional[str]]" = d.addCallbacks(loaded, failed)
        return done.addErrback(lambda f: log.failure("preloading {model} failed", f, model=model.model_id))

    def stopService(self) -> "Deferred[None]":
        self.draining = True
        self.sampler.stop()
        self.telemetry.stop()
        self.feed.stop()
        self.timers.stop()
        return super().stopService()

    # -- model names --------------------------------------------------------------

    def loaded_on(self, model_id: str) -> List[str]:
        return [n for n, s in self.supervisors.items() if s.loading_or_loaded == model_id]

    def resolve_request(self, name: Optional[str]) -> Tuple[ModelConfig, str]:
        """A request's model and the name it is served under (see :meth:`ModelNames.for_request`)."""
        return self.names.for_request(name)

    def resolve(self, name: str) -> ModelConfig:
        """The model ``name`` names, or 404 (see :func:`rolemesh.node.names.resolve`)."""
        return self.names.resolve(name)

    def leaving_models(self) -> Tuple[ModelConfig, ...]:
        """Removed models still busy here (see :meth:`NodeViews.leaving_models`)."""
        return self.views.leaving_models()

    # -- requests (rolemesh.node.admission, rolemesh.node.leases, rolemesh.node.drain) ------------------

    def acquire(self, model: ModelConfig, device: Optional[str] = None, share: Share = DEFAULT_SHARE,
                prompt: Optional[Mapping[str, Any]] = None) -> "Deferred[Lease]":
        """A lease on a device for ``model`` (see :meth:`Admission.acquire`)."""
        return self.admission.acquire(model, device, share, prompt)

    def lease_now(self, model: ModelConfig, share: Share = DEFAULT_SHARE,
                  prompt: Optional[Mapping[str, Any]] = None) -> Optional[Lease]:
        """A lease at once on a ready child, or None (see :meth:`Admission.lease_now`)."""
        return self.admission.lease_now(model, share, prompt)

    def pin_now(self, model: ModelConfig) -> Optional[Pin]:
        """A ready child for a use that takes no slot, or None (see :meth:`Admission.pin_now`)."""
        return self.admission.pin_now(model)

    def pin_child(self, device: str, pid: int, generation: int) -> Optional[Pin]:
        """Pin that very child of ``device`` (see :meth:`Admission.pin_child`)."""
        return self.admission.pin_child(device, pid, generation)

    def unload(self, device: str) -> "Deferred[None]":
        """Stop ``device``'s child once the requests ahead are done (see :meth:`Admission.unload`)."""
        return self.admission.unload(device)

    def cache_hit_rates(self) -> Dict[str, Optional[float]]:
        """Per model: the share of prefix lookups that found their device."""
        return self.admission.cache_hit_rates()

    def check_child(self, lease: Lease, after: str) -> "Deferred[bool]":
        """Probe ``lease``'s child after a failed request (see :meth:`LeaseStarts.check_child`)."""
        return self.leases.check_child(lease, after)

    def retry_endpoint(self, lease: Lease) -> "Deferred[ChildEndpoint]":
        """Where to send a request once more (see :meth:`LeaseStarts.retry_endpoint`)."""
        return self.leases.retry_endpoint(lease)

    def drain(self, grace: float) -> "Deferred[None]":
        """Refuse new requests; fire when in-flight ones are done or ``grace`` passed (see :meth:`Drain.drain`)."""
        return self.drainer.drain(grace)

    def in_flight(self) -> int:
        """Requests being answered or waiting to be, on every device."""
        return self.drainer.in_flight()

    def _request_started(self, device: str, model: ModelConfig, waited: float, share: Share) -> None:
        """A request begins on ``device``: its idle timers stop, its queue wait is observed."""
        self.timers.request_started(device)
        self.events.emit("queue_wait", device=device, model=model.model_id, seconds=waited, tenant=share.tenant)

    def _device_quiet(self, device: str) -> None:
        """A ticket ended on ``device``."""
        self.drainer.quiet()
        if self.scheduler.is_idle(device):
            if self.adoption.retire_if_removed(device):
                return
            self.timers.device_quiet(device)

    # -- memory (rolemesh.scheduling.placement) ----------------------------------------------------

    def lanes_for(self, model: ModelConfig) -> List[str]:
        """Where ``model`` may run (see :meth:`Placement.lanes_for`)."""
        return self.placement.lanes_for(model)

    def capacity(self, lane: str) -> Optional[int]:
        """Total memory of a device, or of a group's members."""
        return self.placement.capacity(lane)

    def estimate_for(self, model: ModelConfig, lane: Optional[str] = None) -> Optional[MemoryEstimate]:
        """``model``'s memory estimate on ``lane`` (see :meth:`Placement.estimate_for`)."""
        return self.placement.estimate_for(model, lane)

    def fits_on(self, model: ModelConfig) -> List[str]:
        """The lanes whose total memory can ever hold ``model``."""
        return self.placement.fits_on(model)

    def too_large(self, model: ModelConfig) -> Optional[errors.ApiError]:
        """``model_too_large`` when no lane can ever hold ``model``, else None."""
        return self.placement.too_large(model)

    def model_memory(self, model: ModelConfig) -> Dict[str, Any]:
        """A model's memory estimate and the devices/groups that can hold it."""
        return self.placement.model_memory(model)

    # -- reload ---------------------------------------------------------------------

    def reconfigure(self, config: NodeConfig) -> None:
        """Adopt a reloaded config (see :mod:`rolemesh.node.reload`).

        New models are servable at once.  A device holding a model that left
        the config stops its child once no request runs or waits there.  A
        device holding a model whose llama-server command changed is unbooked,
        so the next request for it is a switch: it waits for the requests in
        flight, then restarts the child with the new command.  Other changes
        (roles, idle_unload_s) are adopted by the running child as it is.
        (:mod:`rolemesh.node.adoption`.)
        """
        previous, self.config = self.config, config
        self.adoption.adopt(config, previous)
        for name, supervisor in self.supervisors.items():
            if self.views.stale(name) and supervisor.model is not None:
                self.events.emit("superseded", device=name, model=supervisor.model.model_id, state=supervisor.state)

    # -- supervisor events -------------------------------------------------------------

    def _supervisor_changed(self, change: StateChange) -> None:
        """A supervisor's state change, told once its transition is complete:
        ``change`` says which state it was about (the supervisor may be further on)."""
        model, name, state = change.model, change.name, change.state
        if state in (STOPPED, FAILED):  # the child is gone, and its prompt cache with it
            self.prefixes.forget(name)
        if model is None:
            return
        if state == STARTING:
            self.views.child_starting(name)
        if state in (STARTING, READY):
            if model in self.config.models:  # not a model a reload removed or changed
                self.scheduler.model_loaded(name, model.model_id, model.parallel)
        elif state in (STOPPED, FAILED):
            self.scheduler.model_unloaded(name, model.model_id)
        if state == READY and self.scheduler.is_idle(name):
            self.timers.arm_idle(name)
        self.events.emit("child_state", device=name, state=state, model=model.model_id)

    # -- metrics (rolemesh.node.sampling) and reporting (rolemesh.node.views) -----------

    def sample_metrics(self) -> "Deferred[None]":
        """Take one device metrics sample; a failed or slow one marks samples stale."""
        return self.sampler.sample_metrics()

    def child_stale(self, device: str) -> bool:
        """Whether the device's child runs a command a reload replaced (see :meth:`NodeViews.stale`)."""
        return self.views.stale(device)

    def load_progress(self, device: str) -> Optional[Dict[str, Any]]:
        """How far the device's child has got loading (None unless it is starting)."""
        return self.views.load_progress(device)

    def device_states(self) -> List[Dict[str, Any]]:
        """Per-device state as the inventory and the heartbeat report it."""
        return self.views.device_states()

    def group_states(self) -> List[Dict[str, Any]]:
        """Each device group: its members and its child, like a device's state."""
        return self.views.group_states()

    def inventory(self) -> Dict[str, Any]:
        """The node's inventory (``GET /v1/node/inventory``)."""
        return self.views.inventory()

    # -- views for the API ----------------------------------------------------------------
    # What the routes read of a device (or device group) and its child: the
    # routes go through the node, never to a supervisor.

    def has_device(self, device: str) -> bool:
        """Whether ``device`` names a device or device group of this node."""
        return device in self.supervisors

    def device_ready(self, device: str) -> bool:
        """Whether ``device``'s child is ready (not starting, stopping or down)."""
        return self.supervisors[device].state == READY

    def device_snapshot(self, device: str) -> Dict[str, Any]:
        """``device``'s child: state, model, port, pid, restarts (the operator routes' answer)."""
        return self.supervisors[device].snapshot()

    def device_log_tail(self, device: str, lines: int) -> List[str]:
        """The last ``lines`` lines ``device``'s children printed."""
        return self.supervisors[device].log_tail(lines)
