"""The node: every device's supervisor, the scheduler between them, and the
metrics sampler -- the one place a request gets a device from.

``acquire(model)`` queues a request (429 when full), and once the scheduler
lets it run, has the device's supervisor ensure the model is loaded; it fires
with a :class:`Lease` (where to send the request) that the caller releases
when the answer is done.  Cancelling the Deferred (a client that went away)
leaves the queue at once.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import attr
from twisted.application.service import MultiService
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from rolemesh import chat_templates, errors
from rolemesh.backends.groups import group_name
from rolemesh.config import ModelConfig, NodeConfig
from rolemesh.devices import DeviceMetrics, DeviceRef
from rolemesh.estimate import AdapterFacts, GGUFFacts, MemoryEstimate, capacity_of, estimate_on, gib, shared_memory
from rolemesh.events import Events
from rolemesh.fairqueue import DEFAULT_SHARE, Share
from rolemesh.interfaces import IDeviceBackend, IHTTPClientReactor
from rolemesh.node_events import NodeFeed
from rolemesh.payloads import device_state
from rolemesh.prefix import PrefixMemory, prefix_hashes
from rolemesh.reactor import UsesReactor
from rolemesh.readahead import ReadAhead
from rolemesh.scheduler import QUEUED, RUNNING, UNLOAD, QueueFull, Scheduler, Ticket
from rolemesh.supervisor import FAILED, READY, STARTING, STOPPED, ChildEndpoint, DeviceSupervisor, StateChange
from rolemesh.telemetry import TelemetrySampler, device_issues, load_progress
from rolemesh.tenants import tenant_limit

log = Logger()

#: Seconds between device metrics samples, and the bound on one sample.
METRICS_INTERVAL_S = 5.0
METRICS_TIMEOUT_S = 10.0


@attr.s(eq=False, auto_attribs=True)
class Lease:
    """A running request's claim on a device; ``release()`` exactly once."""

    ticket: Ticket
    endpoint: ChildEndpoint
    supervisor: DeviceSupervisor
    _release: Callable[["Lease"], None]
    released: bool = False
    #: The model record the request was admitted for (the child serves it):
    #: a retry goes to a child of this record, not of a reloaded one.
    model: Optional[ModelConfig] = None

    @property
    def device(self) -> str:
        return self.supervisor.name

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._release(self)


@attr.s(eq=False, auto_attribs=True)
class _Acquisition:
    model: ModelConfig
    result: Deferred
    loading: Optional[Deferred] = None
    #: Ends the wait in the queue (``queue_timeout_s``); None once started.
    queue_timer: Optional[IDelayedCall] = None
    #: When it joined the queue (reactor seconds), for the queue-wait histogram.
    queued_at: float = 0.0
    #: The client went away (while evicted children stopped, say).
    cancelled: bool = False
    share: Share = DEFAULT_SHARE


@attr.s(eq=False, auto_attribs=True)
class _Unload:
    result: Deferred


class Node(MultiService, UsesReactor[IHTTPClientReactor]):
    """Supervisors + scheduler + metrics for this host's devices."""

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
            [d.name for d in self.devices], config.max_pending_requests_per_device, self._ticket_started,
            groups=self.groups,
        )
        #: GGUF header facts per model path (None: unreadable, no memory
        #: checks); a path not seen yet -- a model a reload added or moved --
        #: is read with ``read_facts`` on first use (header only: milliseconds).
        self.facts: Dict[str, Optional[GGUFFacts]] = dict(facts or {})
        #: Estimates worked out once per (model record, lane, reserve): pure,
        #: and asked for several times per request.
        self._estimates: Dict[Tuple[ModelConfig, str, int], MemoryEstimate] = {}
        #: Placements worked out once per (model record, pinned lane) and
        #: kept until the config or a device's memory sample changes: every
        #: request asks, and the answer depends on nothing else.
        self._placements: Dict[Tuple[ModelConfig, Optional[str]], Tuple[List[str], Dict[str, int], Optional[str]]] = {}
        self._read_facts = read_facts
        #: LoRA adapter header facts per adapter path, read with ``read_adapter`` on first use (None: unreadable).
        self.adapter_facts: Dict[str, Optional[AdapterFacts]] = {}
        self._read_adapter = read_adapter
        self.metrics: Dict[str, DeviceMetrics] = {}
        self.draining = False
        #: Reads a model's GGUF ahead while a switch to it waits (rolemesh.readahead).
        self.read_ahead = ReadAhead(lambda: self.reactor)
        self._drained: List[Deferred] = []
        self._idle_timers: Dict[str, IDelayedCall] = {}
        #: device -> (config, model) that _retire_if_removed found still wanted.
        self._kept: Dict[str, Tuple[NodeConfig, str]] = {}
        self._inference_timers: Dict[str, IDelayedCall] = {}
        self._metrics_interval = metrics_interval
        self._metrics_loop: Optional[LoopingCall] = None
        self._sampling = False
        #: Start-up preloads not finished yet (``GET /ready`` waits for them).
        self.preloading = 0
        #: The node's events (queue_full, queue_timeout, queue_wait,
        #: idle_unload, child_state), for the metrics module.
        self.events = Events()
        #: The children's own telemetry, sampled on the metrics interval.
        self.telemetry = TelemetrySampler(self.supervisors, reactor=reactor, get=telemetry_get)
        self._loading_since: Dict[str, float] = {}
        #: The node's typed events (rolemesh.node_events): the events route's and the dispatcher's source.
        self.feed = NodeFeed(reactor)
        self.feed.watch(self)
        #: Which device last served each prompt prefix (prefix affinity).
        self.prefixes = PrefixMemory(config.prefix_memory_entries if config.prefix_affinity else 0)
        #: model id -> [prefix lookups, hits].
        self._prefix_counts: Dict[str, List[int]] = {}

    def _emit(self, event: str, **fields: Any) -> None:
        self.events.emit(event, **fields)

    # -- lifecycle --------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._metrics_loop = LoopingCall(self._sample)
        self._metrics_loop.clock = self.reactor
        self._metrics_loop.start(self._metrics_interval, now=True)
        for model in self.config.models:
            if model.preload:
                self._startup_preload(self.preload(model))
        for model_id, device in self.config.preload:
            self._startup_preload(self.preload(self.config.model(model_id), device))

    def _startup_preload(self, d: "Deferred[Optional[str]]") -> None:
        self.preloading += 1

        def done(result: Optional[str]) -> None:
            self.preloading -= 1

        d.addBoth(done)

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

    def drain(self, grace: float) -> "Deferred[None]":
        """Refuse new requests; fire when in-flight ones are done or ``grace`` passed.

        Requests that have not begun -- queued, or waiting on a model load --
        are answered 503 ``shutting_down`` at once: only answers already
        being generated are waited for.
        """
        self.draining = True
        self._emit("draining")
        self._refuse_waiting()
        if self._all_idle():
            return defer.succeed(None)
        d: Deferred = Deferred()
        self._drained.append(d)
        timer = self.reactor.callLater(grace, self._drain_timeout, d)

        def stop_timer(result: object) -> object:
            if timer.active():
                timer.cancel()
            return result

        d.addBoth(stop_timer)
        return d

    def in_flight(self) -> int:
        """Requests being answered or waiting to be, on every device."""
        return sum(book.pending for book in self.scheduler.devices.values())

    def _refuse_waiting(self) -> None:
        for book in list(self.scheduler.devices.values()):
            for ticket in list(book.queue):
                self.scheduler.cancel(ticket)
                self._refuse(ticket.context)
            for ticket in list(book.running):
                request = ticket.context
                if isinstance(request, _Acquisition) and request.loading is not None and not request.loading.called:
                    self._refuse(request)
                    request.loading.cancel()  # frees the ticket through its errback

    @classmethod
    def _refuse(cls, request: object) -> None:
        """Answer a ticket's waiter (an _Acquisition or _Unload) 503 shutting_down."""
        cls._stop_queue_timer(request)
        result = getattr(request, "result", None)
        if result is not None and not result.called:
            result.errback(errors.shutting_down())

    def _drain_timeout(self, d: Deferred) -> None:
        if not d.called:
            busy = {n: b.pending for n, b in self.scheduler.devices.items() if b.pending}
            log.warn("drain grace over with requests still pending ({busy}); stopping anyway", busy=busy)
            self._drained.remove(d)
            d.callback(None)

    def _all_idle(self) -> bool:
        return all(book.pending == 0 for book in self.scheduler.devices.values())

    def stopService(self) -> "Deferred[None]":
        self.draining = True
        if self._metrics_loop is not None and self._metrics_loop.running:
            self._metrics_loop.stop()
        self.telemetry.stop()
        self.feed.stop()
        for timers in (self._idle_timers, self._inference_timers):
            for timer in timers.values():
                if timer.active():
                    timer.cancel()
            timers.clear()
        return super().stopService()

    # -- model names --------------------------------------------------------------

    def loaded_on(self, model_id: str) -> List[str]:
        return [n for n, s in self.supervisors.items() if s.loading_or_loaded == model_id]

    def resolve(self, name: str) -> ModelConfig:
        """``model_id`` or alias; else a LoRA adapter's id (its base model:
        placed, queued and switched as the base, :mod:`rolemesh.adapters`);
        else a role (preferring a loaded model); else 404."""
        for model in self.config.models:
            if name in model.names:
                return model
        for model in self.config.models:
            if any(adapter.id == name for adapter in model.lora_adapters):
                return model
        serving = [m for m in self.config.models if name in m.roles]
        if not serving:
            raise errors.model_not_found(name)
        loaded = [m for m in serving if self.loaded_on(m.model_id)]
        return (loaded or serving)[0]

    def leaving_models(self) -> Tuple[ModelConfig, ...]:
        """Models a reload removed whose requests still run or wait here
        (listed until they are done: :func:`rolemesh.reload.leaving`)."""
        from rolemesh.reload import leaving

        pending = []
        for name, book in self.scheduler.devices.items():
            held = self.supervisors[name].model
            for ticket in (*book.running, *book.queue):
                request = ticket.context
                if isinstance(request, _Acquisition):
                    pending.append(request.model)
                elif held is not None and ticket.model_id == held.model_id:
                    pending.append(held)  # admitted at once (lease_now) on the child of this record
        return leaving(self.config, pending)

    # -- requests -------------------------------------------------------------------

    def _capped(self, share: Share) -> Optional[errors.ApiError]:
        """429 ``tenant_limit`` when the tenant already has its cap of requests queued or running."""
        cap = share.max_concurrent
        if cap is not None and self.scheduler.tenant_pending.get(share.tenant, 0) >= cap:
            return tenant_limit(share.tenant, cap)
        return None

    def _prefixes(self, lanes: List[str], prompt: Optional[Mapping[str, Any]]) -> Optional[List[int]]:
        """The prompt's prefix hashes, where affinity can choose (several lanes); else None."""
        if prompt is None or len(lanes) < 2 or not self.prefixes.entries:
            return None
        return prefix_hashes(prompt) or None

    def _prefer(self, model: ModelConfig, hashes: Optional[List[int]]) -> Optional[str]:
        """The device that served the prompt's longest remembered prefix (counted per model)."""
        if not hashes:
            return None
        found = self.prefixes.lookup(hashes)
        counts = self._prefix_counts.get(model.model_id)
        if counts is None:
            counts = self._prefix_counts[model.model_id] = [0, 0]
        counts[0] += 1
        counts[1] += found is not None
        return found

    def cache_hit_rates(self) -> Dict[str, Optional[float]]:
        """Per model: the share of prefix lookups that found the device holding
        the prompt's beginning (the heartbeat's ``cache_hit_rate``)."""
        return {model.model_id: (lambda c: c[1] / c[0] if c and c[0] else None)(
            self._prefix_counts.get(model.model_id)) for model in self.config.models}

    def acquire(self, model: ModelConfig, device: Optional[str] = None, share: Share = DEFAULT_SHARE,
                prompt: Optional[Mapping[str, Any]] = None) -> "Deferred[Lease]":
        if self.draining:
            return defer.fail(errors.shutting_down())
        try:
            lanes, need, device = self._placement(model, device)
            lanes = self._not_backing_off(model, lanes, device)
        except errors.ApiError as e:
            return defer.fail(e)
        capped = self._capped(share)
        if capped is not None:
            self._emit("tenant_limit", tenant=share.tenant)
            return defer.fail(capped)
        hashes = self._prefixes(lanes, prompt) if device is None else None
        prefer = self._prefer(model, hashes)
        request = _Acquisition(model, Deferred(lambda d: self._cancel(ticket, request)),
                               queued_at=self.reactor.seconds(), share=share)
        try:
            ticket = self.scheduler.submit(model.model_id, model.parallel, device, context=request,
                                           lanes=lanes, need=need, share=share, prefer=prefer,
                                           max_imbalance=self.config.prefix_affinity_max_imbalance)
        except QueueFull:
            self._emit("queue_full", model=model.model_id)
            where = f"device {device}" if device else "every device that can take it"
            return defer.fail(errors.queue_full(where, self.config.max_pending_requests_per_device))
        if hashes:
            self.prefixes.remember(hashes, ticket.device)  # type: ignore[arg-type]  # set by submit
        if ticket.state == QUEUED:
            request.queue_timer = self.reactor.callLater(
                self.config.queue_timeout_s, self._queue_timed_out, ticket, request)
            if not self.loaded_on(model.model_id):  # a switch is coming: warm the page cache meanwhile
                self.read_ahead.warm(model)
        return request.result

    def _not_backing_off(self, model: ModelConfig, lanes: List[str], device: Optional[str]) -> List[str]:
        """The lanes where ``model`` is not backing off (a back-off belongs to
        the model and the device it failed on); raises the refusal (503 with
        Retry-After: the soonest next attempt) when it backs off on them all,
        so that no switch is booked for a load that would be refused."""
        supervisors = self.supervisors
        refusals = {lane: supervisors[lane].refusal(model) for lane in ([device] if device else lanes)}
        if not any(refusals.values()):
            return lanes
        open_lanes = [lane for lane, refusal in refusals.items() if refusal is None]
        if not open_lanes:
            raise min((r for r in refusals.values() if r is not None), key=lambda r: r.retry_after or 0)
        return lanes if device else open_lanes

    def lease_now(self, model: ModelConfig, share: Share = DEFAULT_SHARE,
                  prompt: Optional[Mapping[str, Any]] = None) -> Optional[Lease]:
        """A lease at once, without a Deferred, when the request would start
        there and then on a ready child of ``model`` (see
        :meth:`Scheduler.admit`: nearly every request on a node serving its
        models); else None, and nothing changed: :meth:`acquire` then, which
        queues, loads, switches or refuses."""
        if self.draining:
            return None
        try:
            lanes, need, _ = self._placement(model, None)
        except errors.ApiError:
            return None  # acquire() refuses it, the same way
        if share.max_concurrent is not None and self._capped(share) is not None:
            return None  # acquire() refuses it
        hashes = self._prefixes(lanes, prompt)
        prefer = self._prefer(model, hashes)
        supervisors = self.supervisors
        ticket = self.scheduler.admit(model.model_id, model.parallel, lanes, need,
                                      ready=lambda lane: supervisors[lane].serving(model) is not None,
                                      share=share, prefer=prefer,
                                      max_imbalance=self.config.prefix_affinity_max_imbalance)
        if ticket is None:
            return None  # acquire() looks the prefix up again: a rare second lookup
        supervisor = supervisors[ticket.device]  # type: ignore[index]
        endpoint = supervisor.serving(model)
        assert endpoint is not None  # ready() said so, a moment ago
        if hashes:
            self.prefixes.remember(hashes, supervisor.name)
        self._started(supervisor.name, model, 0.0, share)
        return Lease(ticket, endpoint, supervisor, self._release, model=model)

    def _started(self, device: str, model: ModelConfig, waited: float, share: Share = DEFAULT_SHARE) -> None:
        """A request begins on ``device``: its idle timers stop, its queue wait is observed."""
        self._cancel_idle_timer(device)
        self._cancel_inference_probe(device)
        self._emit("queue_wait", device=device, model=model.model_id, seconds=waited, tenant=share.tenant)

    def _queue_timed_out(self, ticket: Ticket, request: _Acquisition) -> None:
        request.queue_timer = None
        if ticket.state != QUEUED or request.result.called:
            return
        self.scheduler.cancel(ticket)
        log.warn("a request for {model} waited {seconds:g}s in the queue of {device}; answered 503 queue_timeout",
                 model=request.model.model_id, seconds=self.config.queue_timeout_s, device=ticket.device)
        self._emit("queue_timeout", model=request.model.model_id)
        request.result.errback(errors.queue_timeout(f"device {ticket.device}", self.config.queue_timeout_s))

    @staticmethod
    def _stop_queue_timer(request: object) -> None:
        timer = getattr(request, "queue_timer", None)  # an _Acquisition's, while it waits
        if timer is not None:
            request.queue_timer = None  # type: ignore[attr-defined]
            if timer.active():
                timer.cancel()

    # -- memory ---------------------------------------------------------------------

    def lanes_for(self, model: ModelConfig) -> List[str]:
        """Where ``model`` may run: its ``devices`` (one device, or their
        group), else any single device."""
        if model.devices:
            return [group_name(model.devices)]
        return [d.name for d in self.devices]

    def _members(self, lane: str) -> List[DeviceRef]:
        names = self.groups.get(lane, [lane])
        return [d for d in self.devices if d.name in names]

    def _shared_memory(self) -> bool:
        return shared_memory(self.backend.name)

    def capacity(self, lane: str) -> Optional[int]:
        """Total memory of a device, or of a group's members (once for a shared pool)."""
        totals = []
        for d in self._members(lane):
            sample = self.metrics.get(d.name)
            totals.append(d.memory_total_bytes or (sample.memory_total_bytes if sample else None))
        return capacity_of(totals, self.backend.name)

    def estimate_for(self, model: ModelConfig, lane: Optional[str] = None) -> Optional[MemoryEstimate]:
        """``model``'s memory estimate on ``lane`` (default: its first lane);
        None when its GGUF header could not be read."""
        if model.path not in self.facts and self._read_facts is not None:
            self.facts[model.path] = self._read_facts(model.path)
        facts = self.facts.get(model.path)
        if facts is None:
            return None
        lane = lane or self.lanes_for(model)[0]
        reserve = self.config.device_memory_reserve_bytes
        key = (model, lane, reserve)  # a reload brings new ModelConfig records, so new keys
        estimate = self._estimates.get(key)
        if estimate is None:
            members = len(self.groups.get(lane, [lane]))
            draft = model.draft_model
            if draft is not None and draft not in self.facts and self._read_facts is not None:
                self.facts[draft] = self._read_facts(draft)
            estimate = self._estimates[key] = estimate_on(facts, model, self.backend.name, members, reserve,
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
        what = "device group" if largest in self.groups else "device"
        return errors.model_too_large(
            model.model_id, need.describe(),
            f"the largest {what} it may use, {largest}, has {gib(self.capacity(largest))} in total")

    def _placement(self, model: ModelConfig,
                   device: Optional[str]) -> Tuple[List[str], Dict[str, int], Optional[str]]:
        """(eligible lanes, need per lane, pinned lane) for a request; raises
        the ApiError that refuses it.  Shared, so never changed by a caller."""
        key = (model, device)
        placed = self._placements.get(key)
        if placed is None:
            placed = self._place(model, device)  # a refusal is not kept: worked out again, and rare
            if len(self._placements) >= 1024:  # pinned loads name devices: bounded all the same
                self._placements.clear()
            self._placements[key] = placed
        return placed

    def _place(self, model: ModelConfig,
               device: Optional[str]) -> Tuple[List[str], Dict[str, int], Optional[str]]:
        lanes = self.lanes_for(model)
        missing = [lane for lane in lanes if lane not in self.scheduler.devices]
        if missing:  # a reload named a device group this node was not started with
            raise errors.ApiError(
                503, f"model {model.model_id!r} runs on the device group {missing[0]}, which this node did not "
                "have at start-up; restart the agent to use it", "server_error", "restart_required", 60)
        if device is not None and device not in lanes:
            holder = [lane for lane in lanes if device in self.groups.get(lane, [lane])]
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

    def unload(self, device: str) -> "Deferred[None]":
        """Stop ``device``'s child once the requests ahead of this one are
        done (queued like a switch; 429 when the device's queue is full)."""
        if self.draining:
            return defer.fail(errors.shutting_down())
        request = _Unload(Deferred(lambda d: self.scheduler.cancel(ticket) if ticket.state == QUEUED else None))
        try:
            ticket = self.scheduler.submit(UNLOAD, 1, device, context=request, lanes=[device])
        except QueueFull:
            return defer.fail(errors.queue_full(f"device {device}", self.config.max_pending_requests_per_device))
        return request.result

    def _unload_started(self, ticket: Ticket, request: _Unload, evicting: "Deferred[Any]") -> None:
        supervisor = self.supervisors[ticket.device]  # type: ignore[index]
        self._cancel_idle_timer(supervisor.name)

        def stopped(result: Any) -> Any:
            self.scheduler.finish(ticket)
            self.scheduler.model_unloaded(supervisor.name, UNLOAD)
            self._device_quiet(supervisor.name)
            if not request.result.called:
                request.result.callback(None)
            return None

        defer.gatherResults([evicting, supervisor.stop()], consumeErrors=True).addBoth(stopped).addErrback(
            lambda f: log.failure("unloading {device} failed", f, device=supervisor.name))

    def _evict(self, ticket: Ticket) -> "Deferred[Any]":
        """Stop the children of the lanes this ticket's start evicted (a
        device group taking its members, or a member taking its device back
        from the group); fires once they are all reaped."""
        stops = []
        for name in ticket.evict:
            self._cancel_idle_timer(name)
            log.info("stopping the child on {lane}: {device} needs its devices", lane=name, device=ticket.device)
            stops.append(self.supervisors[name].stop())
        return defer.gatherResults(stops, consumeErrors=True)

    def _cancel(self, ticket: Ticket, request: _Acquisition) -> None:
        request.cancelled = True
        self._stop_queue_timer(request)
        if ticket.state == QUEUED:
            self.scheduler.cancel(ticket)
        elif ticket.state == RUNNING and request.loading is not None and not request.loading.called:
            request.loading.cancel()

    def _ticket_started(self, ticket: Ticket) -> None:
        # The lanes this start evicted are no longer booked: their children
        # stop now, whatever becomes of the ticket (nearly every ticket evicts none).
        evicting = self._evict(ticket) if ticket.evict else None
        if isinstance(ticket.context, _Unload):
            self._unload_started(ticket, ticket.context, evicting or defer.succeed([]))
            return
        request: _Acquisition = ticket.context  # type: ignore[assignment]
        self._stop_queue_timer(request)
        if self.draining:  # started by a drain freeing its device: not begun, so refused
            self.scheduler.finish(ticket)
            self._refuse(request)
            return
        supervisor = self.supervisors[ticket.device]  # type: ignore[index]
        self._started(supervisor.name, request.model, self.reactor.seconds() - request.queued_at, request.share)
        if not ticket.evict:
            endpoint = supervisor.serving(request.model)
            if endpoint is not None:  # nearly every request: the child is ready, no Deferred to wait on
                lease = Lease(ticket, endpoint, supervisor, self._release, model=request.model)
                if request.result.called:  # cancelled meanwhile
                    lease.release()
                else:
                    request.result.callback(lease)
                return

        def load(result: Any) -> Any:
            if request.cancelled or request.result.called:  # gone while the evicted children stopped
                return Failure(defer.CancelledError())
            return supervisor.ensure(request.model)

        request.loading = evicting.addBoth(load) if evicting is not None else supervisor.ensure(request.model)

        def ready(endpoint: ChildEndpoint) -> None:
            lease = Lease(ticket, endpoint, supervisor, self._release, model=request.model)
            if request.result.called:  # cancelled meanwhile
                lease.release()
            else:
                request.result.callback(lease)

        def failed(f: Failure) -> None:
            if supervisor.loading_or_loaded != request.model.model_id:
                # Refused or failed: the device does not hold the model the
                # ticket booked, so the next request for another is no switch
                # behind it (a stale booking let the failing model's queued
                # requests overtake every other model's).
                self.scheduler.model_unloaded(supervisor.name, request.model.model_id)
            self.scheduler.finish(ticket)
            self._device_quiet(supervisor.name)
            if not request.result.called:
                request.result.errback(f)

        def broken(f: Failure) -> None:
            # A bug in the two callbacks above: logged, and the request is
            # answered (500) rather than left waiting for ever.
            log.failure("starting a request on {device} failed", f, device=supervisor.name)
            self.scheduler.finish(ticket)
            if not request.result.called:
                request.result.errback(f)

        request.loading.addCallbacks(ready, failed).addErrback(broken)

    def _release(self, lease: Lease) -> None:
        self.scheduler.finish(lease.ticket)
        self._device_quiet(lease.device)

    # -- a child that failed a request ---------------------------------------------------

    def check_child(self, lease: Lease, after: str) -> "Deferred[bool]":
        """A request on ``lease``'s child failed in a way that may mean the
        child is broken (no answer by the deadline, an answer gone silent, a
        refused connection): probe it and replace it if it fails -- but never
        under other requests it is still answering (they would be cut off);
        their own deadlines judge it then.  Fires True if it was replaced."""
        others = [t for t in self.scheduler.devices[lease.ticket.device].running  # type: ignore[index]
                  if t is not lease.ticket]
        if others:
            log.info("llama-server on {device} failed a request after {after}; not probed while it answers "
                     "{count} other request(s)", device=lease.device, after=after, count=len(others))
            return defer.succeed(False)
        return lease.supervisor.replace_if_unhealthy(after, generation=lease.endpoint.generation)

    def retry_endpoint(self, lease: Lease) -> "Deferred[ChildEndpoint]":
        """The child gave no answer at all (refused, or dropped before a
        byte): once it is checked (and replaced if it fails), where to send the
        request once more.  Inference has no side effects, so one retry is
        safe; a request that itself crashes the child costs a second crash.

        The retry asks for the lease's own model record (the one the request
        was admitted for), never the reloaded config's: a reload that changed
        the model's command line must not turn the retry into a switch that
        stops the child under the other requests it serves.  A model a reload
        removed is not started again: 503."""
        from rolemesh.reload import needs_new_child

        own = lease.model if lease.model is not None else lease.supervisor.model
        model_id = lease.endpoint.model_id
        if own is None or not any(m.model_id == model_id for m in self.config.models):
            return defer.fail(errors.ApiError(
                503, f"model {model_id!r} was removed from the configuration by a reload while the request ran; "
                     "its child gave no answer and it is not started again", "server_error", "model_removed"))
        held = lease.supervisor.model
        if held is not None and held is not own and held.model_id == model_id and not needs_new_child(own, held):
            own = held  # the same command line under a newer record (a reload changed roles, say)
        d = self.check_child(lease, "a refused connection")
        return d.addCallback(lambda _: lease.supervisor.ensure(own))

    def _device_quiet(self, device: str) -> None:
        if self._drained and self._all_idle():
            waiting, self._drained = self._drained, []
            for d in waiting:
                d.callback(None)
        if self.scheduler.is_idle(device):
            if self._retire_if_removed(device):
                return
            self._arm_idle_timer(device)
            self._arm_inference_probe(device)

    # -- inference probe (opt-in per model) -----------------------------------------------

    def _cancel_inference_probe(self, device: str) -> None:
        timer = self._inference_timers.pop(device, None)
        if timer is not None and timer.active():
            timer.cancel()

    def _arm_inference_probe(self, device: str) -> None:
        """After ``inference_probe_interval_s`` with no request, the idle
        device's child is asked for real work (see DeviceSupervisor.check_inference)."""
        self._cancel_inference_probe(device)
        supervisor = self.supervisors[device]
        model = supervisor.model
        if model is None or model.inference_probe_interval_s is None or not self.running:
            return
        if supervisor.state not in (READY, STARTING):
            return
        self._inference_timers[device] = self.reactor.callLater(
            model.inference_probe_interval_s, self._inference_probe, device)

    def _inference_probe(self, device: str) -> None:
        self._inference_timers.pop(device, None)
        supervisor = self.supervisors[device]
        if not self.scheduler.is_idle(device) or supervisor.state != READY or self.draining:
            return

        def again(_: Any) -> None:
            if self.scheduler.is_idle(device):
                self._arm_inference_probe(device)

        d = supervisor.check_inference().addCallback(again)
        d.addErrback(lambda f: log.failure("inference probe on {device} failed", f, device=device))

    # -- idle unload ------------------------------------------------------------------

    def _cancel_idle_timer(self, device: str) -> None:
        timer = self._idle_timers.pop(device, None)
        if timer is not None and timer.active():
            timer.cancel()

    def _arm_idle_timer(self, device: str) -> None:
        self._cancel_idle_timer(device)
        supervisor = self.supervisors[device]
        if supervisor.model is None or supervisor.state not in (READY, STARTING) or not self.running:
            return
        seconds = self.config.idle_unload_for(supervisor.model)
        if seconds is None:
            return
        self._idle_timers[device] = self.reactor.callLater(seconds, self._idle_unload, device)

    def _idle_unload(self, device: str) -> None:
        self._idle_timers.pop(device, None)
        supervisor = self.supervisors[device]
        if not self.scheduler.is_idle(device) or supervisor.state != READY:
            return
        assert supervisor.model is not None
        log.info("unloading {model} from {device}: idle", model=supervisor.model.model_id, device=device)
        self._emit("idle_unload", device=device, model=supervisor.model.model_id)
        supervisor.stop()

    # -- reload ---------------------------------------------------------------------

    def reconfigure(self, config: NodeConfig) -> None:
        """Adopt a reloaded config (see :mod:`rolemesh.reload`).

        New models are servable at once.  A device holding a model that left
        the config stops its child once no request runs or waits there.  A
        device holding a model whose llama-server command changed is unbooked,
        so the next request for it is a switch: it waits for the requests in
        flight, then restarts the child with the new command.  Other changes
        (roles, idle_unload_s) are adopted by the running child as it is.
        """
        from rolemesh.reload import needs_new_child

        self.config = config
        self._placements.clear()
        self.prefixes.resize(config.prefix_memory_entries if config.prefix_affinity else 0)
        self.scheduler.pending_limit = config.max_pending_requests_per_device
        current = {m.model_id: m for m in config.models}
        for name, supervisor in self.supervisors.items():
            held = supervisor.model
            if held is None:
                continue
            new = current.get(held.model_id)
            if new is not None and not needs_new_child(held, new):
                supervisor.model = new  # same command line: the running child serves it as is
            elif self.scheduler.devices[name].model == held.model_id:
                self.scheduler.model_unloaded(name, held.model_id)
            if self.scheduler.is_idle(name):
                self._retire_if_removed(name)

    def _retire_if_removed(self, device: str) -> bool:
        """Stop an idle device's child whose model left the config, or may no
        longer run there (a reload gave it other ``devices``)."""
        supervisor = self.supervisors[device]
        held = supervisor.loading_or_loaded
        if held is None:
            return False
        kept = self._kept.get(device)
        if kept is not None and kept[0] is self.config and kept[1] == held:
            return False  # already found still wanted under this config (asked after every request)
        current = next((m for m in self.config.models if m.model_id == held), None)
        if current is not None and device in self.lanes_for(current):
            self._kept[device] = (self.config, held)
            return False
        why = "removed from the configuration" if current is None else "moved to other devices"
        log.info("unloading {model} from {device}: {why}", model=held, device=device, why=why)
        self._cancel_idle_timer(device)
        supervisor.stop()
        return True

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
            self._loading_since[name] = self.reactor.seconds()
        if state in (STARTING, READY):
            if model in self.config.models:  # not a model a reload removed or changed
                self.scheduler.model_loaded(name, model.model_id, model.parallel)
        elif state in (STOPPED, FAILED):
            self.scheduler.model_unloaded(name, model.model_id)
        if state == READY and self.scheduler.is_idle(name):
            self._arm_idle_timer(name)
        self._emit("child_state", device=name, state=state, model=model.model_id)

    # -- metrics ------------------------------------------------------------------------

    def _sample(self) -> "Deferred[None]":
        """One metrics tick: the children's telemetry (on its own, never
        waited for) and the device sample."""
        self.feed.check()  # typed issues raised or cleared, queue pressure, since the last sample
        try:
            self.telemetry.sample()
        except Exception:
            log.failure("telemetry sample failed to start")
        return self.sample_metrics()

    def _telemetry_state(self, supervisor: DeviceSupervisor, queued: int,
                         metrics: Optional[DeviceMetrics]) -> Dict[str, Any]:
        """A device's routing figures (slots, queue, tokens/s), its typed
        issues and its load progress, for the heartbeat and the inventory."""
        telemetry = self.telemetry.latest(supervisor.name)
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
        telemetry = self.telemetry.latest(name)
        return {
            "slots": telemetry.slots_json() if telemetry is not None else None,
            "throughput": telemetry.throughput_json() if telemetry is not None else None,
        }

    def load_progress(self, device: str) -> Optional[Dict[str, Any]]:
        """How far the device's child has got loading (None unless it is
        starting), from the child's own output lines."""
        supervisor = self.supervisors[device]
        if supervisor.state != STARTING or supervisor.model is None:
            return None
        now = self.reactor.seconds()
        since = self._loading_since.get(device, now)
        return load_progress(list(supervisor.logs), supervisor.model.model_id, since).to_json(now)

    def sample_metrics(self) -> "Deferred[None]":
        """Take one metrics sample; a failed or slow one marks samples stale."""
        if self._sampling:
            return defer.succeed(None)
        self._sampling = True
        try:
            d = self.backend.sample(self.devices)
        except Exception as e:
            d = defer.fail(e)
        d.addTimeout(METRICS_TIMEOUT_S, self.reactor)

        def got(samples: List[DeviceMetrics]) -> None:
            self._placements.clear()  # a device's total may come from its sample
            for sample in samples:
                previous = self.metrics.get(sample.device)
                if sample.stale and previous is not None:
                    # The backend could not measure this device this time:
                    # keep the last figures, say they are stale and why.
                    sample = previous.marked_stale(sample.error or "sample failed")
                self.metrics[sample.device] = sample
                if sample.device in self.scheduler.devices:
                    self.scheduler.set_free_memory(sample.device, sample.memory_free_bytes)
            for group, members in self.groups.items():
                free = [self.metrics[m].memory_free_bytes if m in self.metrics else None for m in members]
                known = [f for f in free if f is not None]
                value = None if len(known) < len(free) else (min(known) if self._shared_memory() else sum(known))
                self.scheduler.set_free_memory(group, value)

        def failed(f: Failure) -> None:
            why = "timed out" if f.check(defer.TimeoutError, defer.CancelledError) else f.getErrorMessage()
            log.warn("device metrics sample failed: {why}", why=why)
            now = self.reactor.seconds()
            self._placements.clear()
            for device in self.devices:
                previous = self.metrics.get(device.name) or DeviceMetrics(
                    device.name, now, memory_total_bytes=device.memory_total_bytes
                )
                self.metrics[device.name] = previous.marked_stale(why)

        def done(_: Any) -> None:
            self._sampling = False

        d.addCallbacks(got, failed)
        # An error in the bookkeeping above is logged, not dropped; the loop goes on.
        d.addErrback(lambda f: log.failure("device metrics bookkeeping failed", f))
        return d.addBoth(done)

    # -- reporting ------------------------------------------------------------------------

    def device_states(self) -> List[Dict[str, Any]]:
        """Per-device state as the inventory and the heartbeat report it."""
        now = self.reactor.seconds()
        out = []
        for device in self.devices:
            supervisor = self.supervisors[device.name]
            book = self.scheduler.devices[device.name]
            metrics = self.metrics.get(device.name)
            snap = supervisor.snapshot()
            entry = device_state(
                device.name, snap["state"], now=now, model=snap["model"], port=snap["port"], pid=snap["pid"],
                in_flight=len(book.running), queued=len(book.queue), pending_limit=self.scheduler.pending_limit,
                restarts=snap["restarts"], metrics=metrics,
            )
            entry.update(self._telemetry_state(supervisor, len(book.queue), metrics))
            entry["group"] = self._group_on(device.name)
            out.append(entry)
        return out

    def inventory(self) -> Dict[str, Any]:
        states = {s["device"]: s for s in self.device_states()}
        devices = []
        for device in self.devices:
            entry = {"ref": device.to_json(), **states[device.name]}
            supervisor = self.supervisors[device.name]
            entry["last_error"] = supervisor.last_error
            entry["last_error_code"] = supervisor.last_error_code
            entry["warnings"] = supervisor.warnings
            entry["backoff"] = self._backoff_json(supervisor)
            entry.update(self._telemetry_blocks(device.name))
            devices.append(entry)
        warnings = [w for s in self.supervisors.values() for w in s.warnings]
        if self.config.exposed_without_key:
            warnings.append(f"listening on {self.config.listen_host} without an api_key: anyone who can reach "
                            "the port can use every model on this node")
        return {
            "node_id": self.config.node_id,
            "backend": self.backend.name,
            "draining": self.draining,
            "warnings": warnings,
            "devices": devices,
            "groups": self.group_states(),
            "models": [{**self.model_memory(m), "chat_template": chat_templates.describe_model(m)}
                       for m in self.config.models],
            "prefix_memory": {**self.prefixes.to_json(), "affinity": self.config.prefix_affinity,
                              "per_model_hit_rate": self.cache_hit_rates()},
        }

    def _backoff_json(self, supervisor: DeviceSupervisor) -> List[Dict[str, Any]]:
        """The models backing off on a device or group: until when (reactor
        seconds: POSIX time), the Retry-After they get now, and why."""
        now = self.reactor.seconds()
        return [backoff.to_json(now) for backoff in supervisor.backoffs()]

    def _group_on(self, device: str) -> Optional[str]:
        """The device group whose child holds (or is getting) ``device`` now."""
        for group, members in self.groups.items():
            if device in members and self.scheduler.devices[group].occupied:
                return group
        return None

    def group_states(self) -> List[Dict[str, Any]]:
        """Each device group: its members and its child, like a device's state."""
        out = []
        for group, members in self.groups.items():
            supervisor, book = self.supervisors[group], self.scheduler.devices[group]
            snap = supervisor.snapshot()
            out.append({
                "group": group, "members": list(members), "state": snap["state"], "model": snap["model"],
                "port": snap["port"], "pid": snap["pid"], "in_flight": len(book.running),
                "queued": len(book.queue), "pending_limit": self.scheduler.pending_limit,
                "restarts": snap["restarts"], "last_error": supervisor.last_error,
                "backoff": self._backoff_json(supervisor), "memory_total_bytes": self.capacity(group),
                **self._telemetry_state(supervisor, len(book.queue), None),
                **self._telemetry_blocks(group),
            })
        return out

    def model_memory(self, model: ModelConfig) -> Dict[str, Any]:
        """A model's memory estimate and the devices/groups that can hold it."""
        e = self.estimate_for(model)
        return {
            "model_id": model.model_id,
            "devices": self.lanes_for(model),
            "memory_estimate": e.to_json() if e is not None else None,
            "fits_on": self.fits_on(model),
        }
