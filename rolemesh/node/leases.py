"""A ticket that may run, turned into a :class:`Lease`: the child's endpoint
at once when it is ready, else once the device's supervisor has loaded the
model (after the children of the lanes the start evicts have stopped); an
unload's ticket stops the child instead.  Releasing a lease frees the
ticket; a lease whose child gave no answer is checked and retried here.

The records of a request waiting for its lease (:class:`Acquisition`) and of
an operator's unload (:class:`UnloadRequest`) are the scheduler tickets'
contexts; :mod:`rolemesh.node.admission` makes them.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import attr
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from rolemesh.base import errors
from rolemesh.children.state import READY, STARTING
from rolemesh.children.supervisor import DeviceSupervisor
from rolemesh.children.views import ChildEndpoint
from rolemesh.config.file import ModelConfig, NodeConfig
from rolemesh.event_loop.reactor import UsesReactor
from rolemesh.scheduling.books import Ticket
from rolemesh.scheduling.fairqueue import DEFAULT_SHARE, Share
from rolemesh.scheduling.scheduler import UNLOAD, Scheduler

log = Logger(namespace="rolemesh.leases")


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


class Pin:
    """A use of a ready child that takes no generation slot (a token
    utility): the lane it pinned (:meth:`Scheduler.pin`) and the child's
    endpoint; ``release()`` unpins it, once."""

    __slots__ = ("device", "endpoint", "_unpin")

    def __init__(self, device: str, endpoint: ChildEndpoint, unpin: Callable[[str], None]) -> None:
        self.device = device
        self.endpoint = endpoint
        self._unpin: Optional[Callable[[str], None]] = unpin

    def release(self) -> None:
        unpin, self._unpin = self._unpin, None
        if unpin is not None:
            unpin(self.device)


@attr.s(eq=False, auto_attribs=True)
class Acquisition:
    """A request's wait for its lease: the context of its ticket."""

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
class UnloadRequest:
    """An operator's unload of a device: the context of its ticket."""

    result: Deferred


def stop_queue_timer(request: object) -> None:
    timer = getattr(request, "queue_timer", None)  # an Acquisition's, while it waits
    if timer is not None:
        request.queue_timer = None  # type: ignore[attr-defined]
        if timer.active():
            timer.cancel()


def refuse(request: object) -> None:
    """Answer a ticket's waiter (an Acquisition or UnloadRequest) 503 shutting_down."""
    stop_queue_timer(request)
    result = getattr(request, "result", None)
    if result is not None and not result.called:
        result.errback(errors.shutting_down())


def refuse_waiting(scheduler: Scheduler) -> None:
    """Answer every request that has not begun -- queued, or waiting on a
    model load -- 503 ``shutting_down`` (a drain begins)."""
    for book in list(scheduler.devices.values()):
        for ticket in list(book.queue):
            scheduler.cancel(ticket)
            refuse(ticket.context)
        for ticket in list(book.running):
            request = ticket.context
            if isinstance(request, Acquisition) and request.loading is not None and not request.loading.called:
                refuse(request)
                request.loading.cancel()  # frees the ticket through its errback


class LeaseStarts(UsesReactor[IReactorTime]):
    """Starts the scheduler's tickets (its ``on_start``), releases leases,
    and checks or retries a lease's child."""

    def __init__(
        self,
        scheduler: Scheduler,
        supervisors: Mapping[str, DeviceSupervisor],
        config: Callable[[], NodeConfig],
        draining: Callable[[], bool],
        started: Callable[[str, ModelConfig, float, Share], None],
        quiet: Callable[[str], None],
        cancel_idle: Callable[[str], None],
        needs_new_child: Callable[[ModelConfig, ModelConfig], bool],
        reactor: Optional[IReactorTime] = None,
    ) -> None:
        self._scheduler = scheduler
        self._supervisors = supervisors
        self._config = config
        self._draining = draining
        #: A request begins on a device: (device, model, seconds it waited, share).
        self._started = started
        #: A ticket ended on a device (its timers, the drain, a retired model).
        self._quiet = quiet
        self._cancel_idle = cancel_idle
        #: Whether a model record needs another child than the one of an
        #: older record of it (rolemesh.node.reload.needs_new_child).
        self._needs_new_child = needs_new_child
        self._reactor = reactor

    def start(self, ticket: Ticket) -> None:
        """The scheduler lets ``ticket`` run."""
        # The lanes this start evicted are no longer booked: their children
        # stop now, whatever becomes of the ticket (nearly every ticket evicts none).
        evicting = self._evict(ticket) if ticket.evict else None
        if isinstance(ticket.context, UnloadRequest):
            self._unload_started(ticket, ticket.context, evicting or defer.succeed([]))
            return
        request: Acquisition = ticket.context  # type: ignore[assignment]
        stop_queue_timer(request)
        if self._draining():  # started by a drain freeing its device: not begun, so refused
            self._scheduler.finish(ticket)
            refuse(request)
            return
        supervisor = self._supervisors[ticket.device]  # type: ignore[index]
        self._started(supervisor.name, request.model, self.reactor.seconds() - request.queued_at, request.share)
        model = request.model
        if ticket.model_id != model.model_id and not (supervisor.state in (STARTING, READY)
                                                       and supervisor.model == model):
            # Admitted under a record a reload replaced, and its child is gone
            # (crashed, say): never start the replaced command again.
            model = next((m for m in self._config().models if m.model_id == model.model_id), model)
        if not ticket.evict:
            endpoint = supervisor.serving(model)
            if endpoint is not None:  # nearly every request: the child is ready, no Deferred to wait on
                self._hand_over(ticket, request, endpoint, supervisor, model)
                return
        self._load(ticket, request, supervisor, model, evicting)

    def _hand_over(self, ticket: Ticket, request: Acquisition, endpoint: ChildEndpoint,
                   supervisor: DeviceSupervisor, model: ModelConfig) -> None:
        lease = Lease(ticket, endpoint, supervisor, self.release, model=model)
        if request.result.called:  # cancelled meanwhile
            lease.release()
        else:
            request.result.callback(lease)

    def _load(self, ticket: Ticket, request: Acquisition, supervisor: DeviceSupervisor, model: ModelConfig,
              evicting: Optional[Deferred]) -> None:
        """Start ``model`` on the ticket's device (after the evicted children
        stopped), then hand the lease over, or pass the failure on."""

        def load(result: Any) -> Any:
            if request.cancelled or request.result.called:  # gone while the evicted children stopped
                return Failure(defer.CancelledError())
            return supervisor.ensure(model)

        request.loading = evicting.addBoth(load) if evicting is not None else supervisor.ensure(model)

        def failed(f: Failure) -> None:
            if supervisor.loading_or_loaded != model.model_id or ticket.model_id != model.model_id:
                # Refused or failed: the device does not hold the model the
                # ticket booked, so the next request for another is no switch
                # behind it (a stale booking let the failing model's queued
                # requests overtake every other model's).
                self._scheduler.model_unloaded(supervisor.name, ticket.model_id)
            self._scheduler.finish(ticket)
            self._quiet(supervisor.name)
            if not request.result.called:
                request.result.errback(f)

        def broken(f: Failure) -> None:
            # A bug in the two callbacks above: logged, and the request is
            # answered (500) rather than left waiting for ever.
            log.failure("starting a request on {device} failed", f, device=supervisor.name)
            self._scheduler.finish(ticket)
            if not request.result.called:
                request.result.errback(f)

        request.loading.addCallbacks(
            lambda endpoint: self._hand_over(ticket, request, endpoint, supervisor, model), failed,
        ).addErrback(broken)

    def release(self, lease: Lease) -> None:
        self._scheduler.finish(lease.ticket)
        self._quiet(lease.device)

    def _unload_started(self, ticket: Ticket, request: UnloadRequest, evicting: "Deferred[Any]") -> None:
        supervisor = self._supervisors[ticket.device]  # type: ignore[index]
        self._cancel_idle(supervisor.name)

        def stopped(result: Any) -> Any:
            self._scheduler.finish(ticket)
            self._scheduler.model_unloaded(supervisor.name, UNLOAD)
            self._quiet(supervisor.name)
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
            self._cancel_idle(name)
            log.info("stopping the child on {lane}: {device} needs its devices", lane=name, device=ticket.device)
            stops.append(self._supervisors[name].stop())
        return defer.gatherResults(stops, consumeErrors=True)

    # -- a child that failed a request ---------------------------------------------------

    def check_child(self, lease: Lease, after: str) -> "Deferred[bool]":
        """A request on ``lease``'s child failed in a way that may mean the
        child is broken (no answer by the deadline, an answer gone silent, a
        refused connection): probe it and replace it if it fails -- but never
        under other requests it is still answering (they would be cut off);
        their own deadlines judge it then.  Fires True if it was replaced."""
        others = [t for t in self._scheduler.devices[lease.ticket.device].running  # type: ignore[index]
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
        own = lease.model if lease.model is not None else lease.supervisor.model
        model_id = lease.endpoint.model_id
        if own is None or not any(m.model_id == model_id for m in self._config().models):
            return defer.fail(errors.ApiError(
                503, f"model {model_id!r} was removed from the configuration by a reload while the request ran; "
                     "its child gave no answer and it is not started again", "server_error", "model_removed"))
        held = lease.supervisor.model
        if held is not None and held is not own and held.model_id == model_id and not self._needs_new_child(own, held):
            own = held  # the same command line under a newer record (a reload changed roles, say)
        d = self.check_child(lease, "a refused connection")
        return d.addCallback(lambda _: lease.supervisor.ensure(own))
