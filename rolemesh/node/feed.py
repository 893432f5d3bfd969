"""The node's typed events: one source, two sinks.

:class:`NodeFeed` turns what the supervisors and the node already tell
(:mod:`rolemesh.base.events`: ``child_state``, ``crash``, ``load_failure``,
``idle_unload``, ``queue_full``...) and what the node's periodic sample
finds (typed issues, queue pressure, load progress from llama-server's
output) into :class:`NodeEvent` records -- frozen, each with a JSON form --
and hands them to its subscribers.  Two subscribe:

* ``GET /v1/node/events`` (:mod:`rolemesh.api.app`): one Server-Sent Event per
  record, with a bounded backlog per client (:class:`SSEClient`);
* the dispatcher client (:mod:`rolemesh.fleet.dispatcher`): coalesced deltas
  (:class:`DeltaBuffer`, pure), ``POST /v1/nodes/events``.

Event ``type`` values (see docs/api.md, "Events"):

``load_started``, ``load_progress``, ``ready``, ``failed`` (with the
diagnosis: ``code``, ``message``), ``unloaded``, ``switched`` (a load of
another model on a device that held one: ``previous_model``), ``draining``,
``dispatcher_up``, ``dispatcher_down``, ``issue_raised``, ``issue_cleared``
(``code``, ``message``), ``queue_pressure`` (``level`` ``high`` or
``normal``, ``queued``, ``limit``).  Every record has ``type``, ``time``
(POSIX seconds on the real reactor), ``device`` and ``model`` (either may be
null: ``draining`` is about the whole node) and ``id`` (the feed's own
counter, the SSE ``id:``).
"""

from __future__ import annotations

import collections
import itertools
import json
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Mapping, Optional, Protocol, Set, Tuple

import attr
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from rolemesh.base.events import Events
from rolemesh.event_loop.reactor import resolve_reactor

if TYPE_CHECKING:  # pragma: no cover
    from rolemesh.scheduling.scheduler import Scheduler

log = Logger(namespace="rolemesh.node_events")

LOAD_STARTED = "load_started"
LOAD_PROGRESS = "load_progress"
READY = "ready"
FAILED = "failed"
UNLOADED = "unloaded"
SWITCHED = "switched"
DRAINING = "draining"
DISPATCHER_UP = "dispatcher_up"
DISPATCHER_DOWN = "dispatcher_down"
ISSUE_RAISED = "issue_raised"
ISSUE_CLEARED = "issue_cleared"
QUEUE_PRESSURE = "queue_pressure"
SUPERSEDED = "superseded"

#: Every event type, in the order docs/api.md lists them.
EVENT_TYPES = (LOAD_STARTED, LOAD_PROGRESS, READY, FAILED, UNLOADED, SWITCHED, DRAINING, DISPATCHER_UP,
               DISPATCHER_DOWN, ISSUE_RAISED, ISSUE_CLEARED, QUEUE_PRESSURE, SUPERSEDED)
#: The types a dispatcher is sent (its own up/down it knows better than we do).
ROUTING_TYPES = frozenset(EVENT_TYPES) - {DISPATCHER_UP, DISPATCHER_DOWN}

#: Queue pressure is ``high`` from this share of ``max_pending_requests_per_device``
#: queued on a device, and ``normal`` again below QUEUE_NORMAL (hysteresis:
#: a queue hovering at the threshold does not flap).
QUEUE_HIGH = 0.8
QUEUE_NORMAL = 0.5
#: How often a loading device's output is read for progress (seconds).
PROGRESS_POLL_S = 0.25


@attr.s(auto_attribs=True, frozen=True)
class NodeEvent:
    """One change of the node's state."""

    type: str
    time: float
    device: Optional[str]
    model: Optional[str]
    id: int = 0
    #: The type's own fields (``state``, ``code``, ``message``, ``level``...).
    fields: Mapping[str, Any] = attr.ib(factory=dict)

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"type": self.type, "time": self.time, "device": self.device, "model": self.model,
                               "id": self.id}
        for key, value in self.fields.items():
            out.setdefault(key, value)
        return out


#: ``observer(event)``.
FeedObserver = Callable[[NodeEvent], None]


class WatchedDevice(Protocol):
    """What the feed reads of a device's supervisor (its ``last_error`` and
    ``last_error_code`` too, where it has them)."""

    @property
    def events(self) -> Events: ...

    @property
    def state(self) -> object: ...


class WatchedNode(Protocol):
    """What :meth:`NodeFeed.watch` reads of the node it publishes:
    :class:`~rolemesh.node.node.Node`, whose module imports this one."""

    @property
    def supervisors(self) -> Mapping[str, WatchedDevice]: ...

    @property
    def events(self) -> Events: ...

    @property
    def scheduler(self) -> Scheduler: ...

    @property
    def running(self) -> int: ...

    def device_states(self) -> List[Dict[str, Any]]: ...

    def load_progress(self, device: str) -> Optional[Dict[str, Any]]: ...


class NodeFeed:
    """Publishes :class:`NodeEvent` records to its observers, in order.

    ``publish`` is the one entry point; :meth:`watch` wires a node's existing
    events to it.  An observer that raises is logged; the others are still
    told.
    """

    def __init__(self, reactor: Optional[IReactorTime] = None) -> None:
        self._reactor = reactor
        self._observers: List[FeedObserver] = []
        self._ids = itertools.count(1)
        self._node: Optional[WatchedNode] = None
        #: device -> the model it last held (for ``switched``).
        self._held: Dict[str, str] = {}
        #: device -> codes of the issues raised and not cleared.
        self._issues: Dict[str, Dict[str, Optional[str]]] = {}
        #: devices whose queue pressure is high.
        self._pressed: Set[str] = set()
        #: device -> the last load step told.
        self._steps: Dict[str, str] = {}
        #: devices told ``failed`` since their last ``load_started`` (one per failure).
        self._failed: Set[str] = set()
        self._progress_call: Optional[IDelayedCall] = None

    @property
    def reactor(self) -> IReactorTime:
        if self._reactor is None:
            self._reactor = resolve_reactor(None)
        return self._reactor

    def subscribe(self, observer: FeedObserver) -> Callable[[], None]:
        """Tell ``observer(event)`` of every event from now on; returns the unsubscriber."""
        self._observers.append(observer)

        def unsubscribe() -> None:
            if observer in self._observers:
                self._observers.remove(observer)

        return unsubscribe

    def __len__(self) -> int:
        return len(self._observers)

    def publish(self, type: str, device: Optional[str] = None, model: Optional[str] = None,
                **fields: Any) -> NodeEvent:
        event = NodeEvent(type, self.reactor.seconds(), device, model, next(self._ids), fields)
        for observer in list(self._observers):
            try:
                observer(event)
            except Exception:
                log.failure("observer of node event {type} failed", type=type)
        return event

    # -- wiring a node ---------------------------------------------------------

    def watch(self, node: WatchedNode) -> None:
        """Publish ``node``'s changes: its supervisors' states and failures,
        its drain and idle unloads (through ``node.events``)."""
        self._node = node
        for supervisor in node.supervisors.values():
            supervisor.events.subscribe(self._supervisor_event)
        node.events.subscribe(self._node_event)

    def _supervisor_event(self, event: str, **fields: Any) -> None:
        device: str = fields.get("device") or ""
        model: Optional[str] = fields.get("model")
        if event in ("crash", "load_failure", "load_timeout"):
            supervisor = self._node.supervisors.get(device) if self._node is not None else None
            code = getattr(supervisor, "last_error_code", None) or event
            message = getattr(supervisor, "last_error", None)
            state = getattr(supervisor, "state", None)
            self._failed.add(device)
            self.publish(FAILED, device, model, state=None if state is None else str(state), code=code,
                         message=(message or event)[:300])
            return
        if event != "child_state":
            return
        state, previous = str(fields["state"]), str(fields.get("previous"))
        if state == "starting":
            self._steps.pop(device, None)
            self._failed.discard(device)
            held = self._held.get(device)
            if held is not None and model is not None and held != model:
                self.publish(SWITCHED, device, model, state=state, previous_model=held)
            self.publish(LOAD_STARTED, device, model, state=state)
            self._arm_progress()
        elif state == "ready":
            self.publish(READY, device, model, state=state)
        elif state == "stopped" and previous in ("stopping", "ready", "starting"):
            self.publish(UNLOADED, device, model, state=state)
        elif state == "failed" and previous != "failed" and device not in self._failed:
            self._failed.add(device)
            supervisor = self._node.supervisors.get(device) if self._node is not None else None
            self.publish(FAILED, device, model, state=state,
                         code=getattr(supervisor, "last_error_code", None) or "failed",
                         message=(getattr(supervisor, "last_error", None) or "failed")[:300])
        if model is not None and state in ("starting", "ready"):
            self._held[device] = model

    def _node_event(self, event: str, **fields: Any) -> None:
        if event == DRAINING:
            self.publish(DRAINING, None, None, state="draining")
        elif event == SUPERSEDED:  # a reload replaced the command of the device's running child
            self.publish(SUPERSEDED, fields.get("device"), fields.get("model"), state=str(fields.get("state")))
        elif event in ("queue_full", "queue_wait", "queue_timeout"):
            self.check_queues(fields.get("device"))

    # -- what the periodic sample finds -------------------------------------------

    def check(self) -> None:
        """Compare the node's typed issues and queues with what was told;
        publish the differences.  Called after every metrics sample; never raises."""
        try:
            self.check_issues()
            self.check_queues()
        except Exception:
            log.failure("checking the node's state for events failed")

    def check_issues(self) -> None:
        node = self._node
        if node is None:
            return
        for entry in node.device_states():
            device = entry["device"]
            now = {i["code"]: i.get("message") for i in entry.get("issues") or ()}
            before = self._issues.get(device, {})
            for code in now.keys() - before.keys():
                self.publish(ISSUE_RAISED, device, entry.get("model"), code=code, message=now[code])
            for code in before.keys() - now.keys():
                self.publish(ISSUE_CLEARED, device, entry.get("model"), code=code, message=before[code])
            self._issues[device] = now

    def check_queues(self, only: Optional[str] = None) -> None:
        """Queue pressure crossing a threshold, on every device (or ``only``
        that one: a request's own event, on the request path)."""
        node = self._node
        if node is None:
            return
        limit = node.scheduler.pending_limit
        books = node.scheduler.devices
        items = books.items() if only is None or only not in books else ((only, books[only]),)
        for device, book in items:
            queued = len(book.queue)
            share = queued / limit if limit else 0.0
            model = getattr(book, "model", None)
            if device not in self._pressed and share >= QUEUE_HIGH:
                self._pressed.add(device)
                self.publish(QUEUE_PRESSURE, device, model, level="high", queued=queued, limit=limit)
            elif device in self._pressed and share < QUEUE_NORMAL:
                self._pressed.discard(device)
                self.publish(QUEUE_PRESSURE, device, model, level="normal", queued=queued, limit=limit)

    def _arm_progress(self) -> None:
        if self._progress_call is None or not self._progress_call.active():
            self._progress_call = self.reactor.callLater(PROGRESS_POLL_S, self._poll_progress)

    def _poll_progress(self) -> None:
        """Tell each loading device's new load step; again while one loads."""
        self._progress_call = None
        node = self._node
        if node is None or not node.running:
            return
        loading = False
        try:
            for name, supervisor in node.supervisors.items():
                if str(supervisor.state) != "starting":
                    continue
                loading = True
                progress = node.load_progress(name)
                if progress is None or progress.get("step") == self._steps.get(name):
                    continue
                self._steps[name] = progress["step"]
                self.publish(LOAD_PROGRESS, name, progress.get("model"), state="starting",
                             **{k: v for k, v in progress.items() if k != "model"})
        except Exception:
            log.failure("reading load progress for events failed")
        if loading:
            self._arm_progress()

    def stop(self) -> None:
        if self._progress_call is not None and self._progress_call.active():
            self._progress_call.cancel()
        self._progress_call = None


def sse_frame(event: NodeEvent) -> bytes:
    """One Server-Sent Event: ``id:``, ``event:`` and one ``data:`` line of JSON."""
    data = json.dumps(event.to_json(), separators=(",", ":"), sort_keys=True)
    return f"id: {event.id}\nevent: {event.type}\ndata: {data}\n\n".encode()


#: An SSE comment line, sent when nothing else was: keeps proxies and the
#: listener's idle timeout from closing a quiet stream.
KEEPALIVE_FRAME = b": keep-alive\n\n"


# ---------------------------------------------------------------------------
# Coalescing deltas for the dispatcher (pure)


def coalesce_key(event: NodeEvent) -> Tuple[Any, ...]:
    """What a newer event replaces: a device's state, its last failure, its
    load progress, one issue code, its queue pressure; the node's draining."""
    if event.type in (ISSUE_RAISED, ISSUE_CLEARED):
        return (event.device, "issue", event.fields.get("code"))
    if event.type == LOAD_PROGRESS:
        return (event.device, "progress")
    if event.type == QUEUE_PRESSURE:
        return (event.device, "queue")
    if event.type == DRAINING:
        return (None, "draining")
    if event.type == SUPERSEDED:  # the state events of the cut-over that follows do not replace it
        return (event.device, "superseded")
    if event.type == FAILED:  # its diagnosis survives the unload or restart that follows it
        return (event.device, "failed")
    return (event.device, "state")


class DeltaBuffer:
    """The events not yet sent, newest per :func:`coalesce_key` (so it holds
    at most a few entries per device however many changes come), capped at
    ``limit`` entries: past it the oldest go and :attr:`overflowed` says the
    dispatcher must be given full state."""

    def __init__(self, limit: int = 512) -> None:
        self.limit = limit
        self._pending: "collections.OrderedDict[Tuple[Any, ...], NodeEvent]" = collections.OrderedDict()
        self.overflowed = False
        #: Changes taken in since the last take(), coalesced or not.
        self.added = 0

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, event: NodeEvent) -> None:
        key = coalesce_key(event)
        self._pending.pop(key, None)
        self._pending[key] = event
        self.added += 1
        while len(self._pending) > self.limit:
            self._pending.popitem(last=False)
            self.overflowed = True

    def take(self) -> List[NodeEvent]:
        """The pending events, oldest first; the buffer is empty after."""
        out = list(self._pending.values())
        self._pending.clear()
        self.added = 0
        return out

    def clear(self) -> None:
        self._pending.clear()
        self.added = 0
        self.overflowed = False


class SSEClient:
    """One ``GET /v1/node/events`` reader: writes each event as it comes,
    a keep-alive comment when the stream was quiet, and is cut off (the
    connection closed) when more than ``max_backlog`` bytes wait because it
    does not read -- a slow reader never makes the agent buffer without bound.

    It is the request's streaming producer: twisted.web pauses it when the
    socket's buffer is full; while paused, frames wait here.
    """

    def __init__(self, request: Any, feed: NodeFeed, reactor: IReactorTime, keepalive_s: float = 15.0,
                 max_backlog: int = 256 * 1024) -> None:
        self._request = request
        self._reactor = reactor
        self._keepalive_s = keepalive_s
        self.max_backlog = max_backlog
        self._backlog: Deque[bytes] = collections.deque()
        self._backlog_bytes = 0
        self._paused = False
        self.closed = False
        self.cut_off = False
        self._quiet = True
        self._unsubscribe = feed.subscribe(self.send)
        request.registerProducer(self, True)
        self._keepalive: Optional[IDelayedCall] = reactor.callLater(keepalive_s, self._tick)
        request.notifyFinish().addBoth(self._gone)

    # IPushProducer
    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        while self._backlog and not self._paused and not self.closed:
            frame = self._backlog.popleft()
            self._backlog_bytes -= len(frame)
            self._request.write(frame)

    def stopProducing(self) -> None:
        self._close()

    def send(self, event: NodeEvent) -> None:
        self._write(sse_frame(event))

    def _write(self, frame: bytes) -> None:
        if self.closed:
            return
        self._quiet = False
        if not self._paused and not self._backlog:
            self._request.write(frame)
            return
        self._backlog.append(frame)
        self._backlog_bytes += len(frame)
        if self._backlog_bytes > self.max_backlog:
            log.info("events reader cut off: {bytes} bytes waiting for it to read", bytes=self._backlog_bytes)
            self.cut_off = True
            transport = getattr(getattr(self._request, "channel", None), "transport", None)
            self._close()
            if transport is not None:
                transport.abortConnection() if hasattr(transport, "abortConnection") else transport.loseConnection()

    def _tick(self) -> None:
        self._keepalive = None
        if self.closed:
            return
        if self._quiet:
            self._write(KEEPALIVE_FRAME)
        self._quiet = True
        self._keepalive = self._reactor.callLater(self._keepalive_s, self._tick)

    def _gone(self, _: object) -> None:
        self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._unsubscribe()
        self._backlog.clear()
        self._backlog_bytes = 0
        if self._keepalive is not None and self._keepalive.active():
            self._keepalive.cancel()
        self._keepalive = None
        try:
            self._request.unregisterProducer()
        except Exception:  # noqa: BLE001 - already gone
            pass
