"""Admission: a request's way to a ticket on a lane.  ``acquire`` places the
model (refusing it at once when it can never run: too large, backing off on
every lane, its tenant at its cap, the node draining), queues it (429 when
full) with the lane that served its prompt's prefix preferred, and bounds its
wait in the queue (503 ``queue_timeout``); ``lease_now`` leases a ready
child at once, without a Deferred, where the request would start there and
then.  Cancelling a waiting request's Deferred (a client that went away)
leaves the queue at once.  What happens once a ticket may run is
:mod:`rolemesh.node.leases`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from rolemesh.base import errors
from rolemesh.children.supervisor import DeviceSupervisor
from rolemesh.config.file import ModelConfig, NodeConfig
from rolemesh.event_loop.reactor import UsesReactor
from rolemesh.node.leases import Acquisition, Lease, Pin, UnloadRequest, stop_queue_timer
from rolemesh.scheduling.books import QUEUED, RUNNING, QueueFull, Ticket
from rolemesh.scheduling.fairqueue import DEFAULT_SHARE, Share
from rolemesh.scheduling.placement import Placed
from rolemesh.scheduling.prefix import PrefixMemory, prefix_hashes
from rolemesh.scheduling.scheduler import UNLOAD, Scheduler
from rolemesh.scheduling.tenants import tenant_limit

log = Logger(namespace="rolemesh.admission")


class Admission(UsesReactor[IReactorTime]):
    """acquire / lease_now / unload, with tenant caps, prefix preference and queue timeouts."""

    def __init__(
        self,
        scheduler: Scheduler,
        supervisors: Mapping[str, DeviceSupervisor],
        config: Callable[[], NodeConfig],
        place: Callable[[ModelConfig, Optional[str]], Placed],
        prefixes: PrefixMemory,
        draining: Callable[[], bool],
        loaded_on: Callable[[str], List[str]],
        warm: Callable[[ModelConfig], object],
        started: Callable[[str, ModelConfig, float, Share], None],
        release: Callable[[Lease], None],
        emit: Callable[..., None],
        reactor: Optional[IReactorTime] = None,
    ) -> None:
        self._scheduler = scheduler
        self._supervisors = supervisors
        self._config = config
        #: (eligible lanes, need per lane, pinned lane), or the refusal (rolemesh.scheduling.placement).
        self._place = place
        #: Which device last served each prompt prefix (prefix affinity).
        self._prefixes = prefixes
        self._draining = draining
        self._loaded_on = loaded_on
        #: Reads a model's GGUF ahead while a switch to it waits (rolemesh.children.readahead).
        self._warm = warm
        self._started = started
        self._release = release
        self._emit = emit
        self._reactor = reactor
        #: model id -> [prefix lookups, hits].
        self._prefix_counts: Dict[str, List[int]] = {}

    def acquire(self, model: ModelConfig, device: Optional[str] = None, share: Share = DEFAULT_SHARE,
                prompt: Optional[Mapping[str, Any]] = None) -> "Deferred[Lease]":
        if self._draining():
            return defer.fail(errors.shutting_down())
        try:
            lanes, need, device = self._place(model, device)
            lanes = self._not_backing_off(model, lanes, device)
        except errors.ApiError as e:
            return defer.fail(e)
        capped = self._capped(share)
        if capped is not None:
            self._emit("tenant_limit", tenant=share.tenant)
            return defer.fail(capped)
        hashes = self._hashes(lanes, prompt) if device is None else None
        prefer = self._prefer(model, hashes)
        request = Acquisition(model, Deferred(lambda d: self._cancel(ticket, request)),
                              queued_at=self.reactor.seconds(), share=share)
        config = self._config()
        try:
            ticket = self._scheduler.submit(model.model_id, model.parallel, device, context=request,
                                            lanes=lanes, need=need, share=share, prefer=prefer,
                                            max_imbalance=config.prefix_affinity_max_imbalance,
                                            replicas=model.max_replicas)
        except QueueFull:
            self._emit("queue_full", model=model.model_id)
            where = f"device {device}" if device else "every device that can take it"
            return defer.fail(errors.queue_full(where, config.max_pending_requests_per_device))
        if hashes:
            self._prefixes.remember(hashes, ticket.device)  # type: ignore[arg-type]  # set by submit
        if ticket.state == QUEUED:
            request.queue_timer = self.reactor.callLater(
                config.queue_timeout_s, self._queue_timed_out, ticket, request)
            if not self._loaded_on(model.model_id):  # a switch is coming: warm the page cache meanwhile
                self._warm(model)
        return request.result

    def lease_now(self, model: ModelConfig, share: Share = DEFAULT_SHARE,
                  prompt: Optional[Mapping[str, Any]] = None) -> Optional[Lease]:
        """A lease at once, without a Deferred, when the request would start
        there and then on a ready child of ``model`` (see
        :meth:`Scheduler.admit`: nearly every request on a node serving its
        models); else None, and nothing changed: :meth:`acquire` then, which
        queues, loads, switches or refuses."""
        if self._draining():
            return None
        try:
            lanes, need, _ = self._place(model, None)
        except errors.ApiError:
            return None  # acquire() refuses it, the same way
        if share.max_concurrent is not None and self._capped(share) is not None:
            return None  # acquire() refuses it
        hashes = self._hashes(lanes, prompt)
        prefer = self._prefer(model, hashes)
        supervisors = self._supervisors
        ticket = self._scheduler.admit(model.model_id, model.parallel, lanes, need,
                                       ready=lambda lane: supervisors[lane].serving(model) is not None,
                                       share=share, prefer=prefer,
                                       max_imbalance=self._config().prefix_affinity_max_imbalance,
                                       replicas=model.max_replicas)
        if ticket is None:
            return None  # acquire() looks the prefix up again: a rare second lookup
        supervisor = supervisors[ticket.device]  # type: ignore[index]
        endpoint = supervisor.serving(model)
        assert endpoint is not None  # ready() said so, a moment ago
        if hashes:
            self._prefixes.remember(hashes, supervisor.name)
        self._started(supervisor.name, model, 0.0, share)
        return Lease(ticket, endpoint, supervisor, self._release, model=model)

    def pin_now(self, model: ModelConfig) -> Optional[Pin]:
        """A ready child of ``model`` for a use that takes no generation slot
        (tokenize, count tokens, apply a template), pinned so that no switch
        replaces it meanwhile; None when no lane has one ready (or the node
        drains): :meth:`acquire` then, which loads it."""
        if self._draining():
            return None
        try:
            lanes, _, _ = self._place(model, None)
        except errors.ApiError:
            return None  # acquire() refuses it, the same way
        supervisors = self._supervisors
        lane = self._scheduler.pin(model.model_id, lanes,
                                   ready=lambda name: supervisors[name].serving(model) is not None)
        if lane is None:
            return None
        endpoint = supervisors[lane].serving(model)
        assert endpoint is not None  # ready() said so, a moment ago
        return Pin(lane, endpoint, self._scheduler.unpin)

    def pin_child(self, device: str, pid: int, generation: int) -> Optional[Pin]:
        """Pin ``device``'s child if it is still the one with ``pid`` and
        ``generation`` and ready (a follow-up to state that child holds);
        None when it has stopped or another child took its place."""
        supervisor = self._supervisors.get(device)
        model = supervisor.model if supervisor is not None else None
        if model is None or self._draining():
            return None
        endpoint = supervisor.serving(model)  # type: ignore[union-attr]  # not None: it has a model
        if endpoint is None or (endpoint.pid, endpoint.generation) != (pid, generation):
            return None
        if self._scheduler.pin(model.model_id, [device], ready=lambda _: True) is None:
            return None
        return Pin(device, endpoint, self._scheduler.unpin)

    def unload(self, device: str) -> "Deferred[None]":
        """Stop ``device``'s child once the requests ahead of this one are
        done (queued like a switch; 429 when the device's queue is full)."""
        if self._draining():
            return defer.fail(errors.shutting_down())
        scheduler = self._scheduler
        request = UnloadRequest(Deferred(lambda d: scheduler.cancel(ticket) if ticket.state == QUEUED else None))
        try:
            ticket = scheduler.submit(UNLOAD, 1, device, context=request, lanes=[device])
        except QueueFull:
            return defer.fail(errors.queue_full(f"device {device}", self._config().max_pending_requests_per_device))
        return request.result

    def cache_hit_rates(self) -> Dict[str, Optional[float]]:
        """Per model: the share of prefix lookups that found the device holding
        the prompt's beginning (the heartbeat's ``cache_hit_rate``)."""
        return {model.model_id: (lambda c: c[1] / c[0] if c and c[0] else None)(
            self._prefix_counts.get(model.model_id)) for model in self._config().models}

    def _not_backing_off(self, model: ModelConfig, lanes: List[str], device: Optional[str]) -> List[str]:
        """The lanes where ``model`` is not backing off (a back-off belongs to
        the model and the device it failed on); raises the refusal (503 with
        Retry-After: the soonest next attempt) when it backs off on them all,
        so that no switch is booked for a load that would be refused."""
        supervisors = self._supervisors
        refusals = {lane: supervisors[lane].refusal(model) for lane in ([device] if device else lanes)}
        if not any(refusals.values()):
            return lanes
        open_lanes = [lane for lane, refusal in refusals.items() if refusal is None]
        if not open_lanes:
            raise min((r for r in refusals.values() if r is not None), key=lambda r: r.retry_after or 0)
        return lanes if device else open_lanes

    def _capped(self, share: Share) -> Optional[errors.ApiError]:
        """429 ``tenant_limit`` when the tenant already has its cap of requests queued or running."""
        cap = share.max_concurrent
        if cap is not None and self._scheduler.tenant_pending.get(share.tenant, 0) >= cap:
            return tenant_limit(share.tenant, cap)
        return None

    def _hashes(self, lanes: List[str], prompt: Optional[Mapping[str, Any]]) -> Optional[List[int]]:
        """The prompt's prefix hashes, where affinity can choose (several lanes); else None."""
        if prompt is None or len(lanes) < 2 or not self._prefixes.entries:
            return None
        return prefix_hashes(prompt) or None

    def _prefer(self, model: ModelConfig, hashes: Optional[List[int]]) -> Optional[str]:
        """The device that served the prompt's longest remembered prefix (counted per model)."""
        if not hashes:
            return None
        found = self._prefixes.lookup(hashes)
        counts = self._prefix_counts.get(model.model_id)
        if counts is None:
            counts = self._prefix_counts[model.model_id] = [0, 0]
        counts[0] += 1
        counts[1] += found is not None
        return found

    def _queue_timed_out(self, ticket: Ticket, request: Acquisition) -> None:
        request.queue_timer = None
        if ticket.state != QUEUED or request.result.called:
            return
        self._scheduler.cancel(ticket)
        seconds = self._config().queue_timeout_s
        log.warn("a request for {model} waited {seconds:g}s in the queue of {device}; answered 503 queue_timeout",
                 model=request.model.model_id, seconds=seconds, device=ticket.device)
        self._emit("queue_timeout", model=request.model.model_id)
        request.result.errback(errors.queue_timeout(f"device {ticket.device}", seconds))

    def _cancel(self, ticket: Ticket, request: Acquisition) -> None:
        request.cancelled = True
        stop_queue_timer(request)
        if ticket.state == QUEUED:
            self._scheduler.cancel(ticket)
        elif ticket.state == RUNNING and request.loading is not None and not request.loading.called:
            request.loading.cancel()
