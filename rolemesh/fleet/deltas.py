"""Deltas to the dispatcher: ``POST /v1/nodes/events`` (see
docs/dispatcher-protocol.md).

While the node is registered with a dispatcher that takes events, each
change on the node's feed that routing depends on (``ROUTING_TYPES``) is
held for the coalescing window, then sent with the next ``seq``: a burst is
one message, one in flight at a time, bounded (more changes than the buffer
keeps: the full heartbeat goes instead).  Whether the dispatcher takes
events is learnt from its registration answer, else from an empty events
body (the probe: 404 says no).  A change that cannot be sent is dropped, not
queued: the next full heartbeat (with its ``last_seq``) heals the gap.

:class:`DeltaSender` does this for a :class:`DeltaHost` (the dispatcher
client: whether it runs, its heartbeat cadence, its result hook) over a
:class:`~rolemesh.fleet.link.DispatcherLink` (registered? which node
id?) and a POST function (:meth:`DispatcherExchange.post
<rolemesh.fleet.exchange.DispatcherExchange.post>`).
"""

from __future__ import annotations

from typing import Any, Callable, Coroutine, Dict, List, Optional, Protocol, Tuple

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from rolemesh.fleet.link import DispatcherLink
from rolemesh.fleet.protocol import EVENTS_PATH, FORGOTTEN, OK, RequestKind, classify, json_object
from rolemesh.node.feed import ROUTING_TYPES, DeltaBuffer, NodeEvent, NodeFeed
from rolemesh.node.payloads import events_payload, with_last_seq

__all__ = ["DeltaHost", "DeltaSender", "Post"]

#: POST ``(path, payload, timeout)``: ``(status, detail, body)``, status None if no answer.
Post = Callable[[str, Dict[str, Any], float], Coroutine[Any, Any, Tuple[Optional[int], str, str]]]


class DeltaHost(Protocol):
    """What the deltas need of the dispatcher client."""

    running: Any
    #: The heartbeat interval without events.
    interval: float

    @property
    def beat_interval(self) -> float: ...

    def beat_soon(self, within: float) -> None:
        """Bring the next heartbeat forward to at most ``within`` seconds from now."""

    def report(self, kind: RequestKind, ok: bool) -> None:
        """Tell the result hook how a request went."""

    def take_interval(self, body: str) -> None:
        """Learn the heartbeat interval an answer asks for, if any."""


class DeltaSender:
    """The node's changes, coalesced and sent as deltas while the dispatcher takes them."""

    def __init__(self, host: DeltaHost, link: DispatcherLink, post: Post, clock: IReactorTime, feed: NodeFeed,
                 coalesce: float, request_timeout: float, log: Optional[Logger] = None) -> None:
        self._host = host
        self._link = link
        self._post = post
        self._clock = clock
        self.log = log if log is not None else Logger(namespace="rolemesh.fleet.dispatcher.DispatcherClient")
        #: The node's events, sent as deltas while the dispatcher takes them.
        self.feed = feed
        self.coalesce = float(coalesce)
        self.request_timeout = request_timeout
        #: Whether the dispatcher takes events: None until it answered one.
        self.events_accepted: Optional[bool] = None
        #: The ``seq`` of the last events body sent (0: none yet).
        self.events_seq = 0
        self.events_ok = 0
        self.events_failed = 0
        #: The changes not sent yet.
        self.buffer = DeltaBuffer()
        self._flush_call: Optional[IDelayedCall] = None
        self._inflight: Optional[Deferred[Any]] = None
        self._unsubscribe: Optional[Callable[[], None]] = None

    def start(self) -> None:
        self._unsubscribe = self.feed.subscribe(self._on_event)

    def registered(self, body: str) -> None:
        """After a registration: learn whether the dispatcher takes events
        (its answer's ``events``, else an empty events body: 404 says no).
        The registration's full heartbeat follows at once: a restarted
        dispatcher knows nothing of us."""
        answer = json_object(body)
        self.buffer.clear()
        self.events_accepted = None  # perhaps another dispatcher now: ask again
        self._host.take_interval(body)
        if isinstance(answer.get("events"), bool):
            self._verdict(answer["events"], "its registration answer")
        elif self.events_accepted is None:
            self._send([])  # the probe

    def full_state(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        """A heartbeat's body as sent while the dispatcher takes events: its
        full state supersedes the changes not sent yet, and says the last ``seq``."""
        if not self.events_accepted:
            return payload
        self.buffer.clear()
        return with_last_seq(payload, self.events_seq)

    def _verdict(self, accepted: bool, how: str) -> None:
        if accepted == self.events_accepted:
            return
        self.events_accepted = accepted
        if accepted:
            self.log.info("dispatcher takes events ({how}): changes go at once, full state every {interval}s",
                          how=how, interval=self._host.beat_interval)
        else:
            self.buffer.clear()
            self.log.info("dispatcher does not take events ({how}): heartbeats only, every {interval}s",
                          how=how, interval=self._host.beat_interval)
            self._host.beat_soon(self._host.interval)

    def _on_event(self, event: NodeEvent) -> None:
        """A change of the node: held for the coalescing window, then sent."""
        if event.type not in ROUTING_TYPES or not self._host.running:
            return
        if not self._link.registered or self.events_accepted is False:
            return  # the registration's full heartbeat, or the next heartbeat, carries it
        self.buffer.add(event)
        if self._flush_call is None and self._inflight is None:
            self._flush_call = self._clock.callLater(self.coalesce, self._flush)

    def _flush(self) -> None:
        self._flush_call = None
        if not self._host.running or not self.buffer or self._inflight is not None:
            return
        if self.buffer.overflowed:  # more changes than kept: full state instead
            self.buffer.clear()
            self._host.beat_soon(0)
            return
        self._send([e.to_json() for e in self.buffer.take()])

    def _send(self, events: List[Dict[str, Any]]) -> None:
        node_id = self._link.node_id
        if node_id is None:
            return
        self.events_seq += 1
        payload = events_payload(node_id, self.events_seq, self._clock.seconds(), events)
        d = Deferred.fromCoroutine(self._post(EVENTS_PATH, payload, self.request_timeout))
        self._inflight = d

        def answered(result: Tuple[Optional[int], str, str]) -> None:
            self._inflight = None
            self._answer(*result)
            if self._host.running and self.buffer and self._flush_call is None:
                self._flush_call = self._clock.callLater(self.coalesce, self._flush)

        def failed(failure: Failure) -> None:
            self._inflight = None
            if not failure.check(CancelledError):
                self.log.failure("sending events to the dispatcher failed", failure)

        d.addCallbacks(answered, failed).addErrback(
            lambda f: self.log.failure("dispatcher events bookkeeping failed", f))

    def _answer(self, code: Optional[int], detail: str, body: str) -> None:
        if not self._host.running:
            return
        outcome = classify(RequestKind.EVENTS, code)
        self._host.report(RequestKind.EVENTS, outcome == OK)
        if outcome == OK:
            self.events_ok += 1
            self._link.last_success = self._clock.seconds()
            self._host.take_interval(body)
            self._verdict(True, f"HTTP {code} on {EVENTS_PATH}")
            return
        self.events_failed += 1
        if code == 404:
            self._verdict(False, f"HTTP 404 on {EVENTS_PATH}")
        elif outcome == FORGOTTEN:
            self.log.info("dispatcher does not know node {node_id} (HTTP {code} on events); registering again",
                          node_id=self._link.node_id, code=code)
            self._link.registered = False
            self._host.beat_soon(0)
        # Otherwise (down, slow, refusing): these changes are dropped, not
        # queued; the next heartbeat's full state (and its last_seq) heals the gap.

    def stop(self) -> None:
        """Stop listening to the feed; cancel what waits or is in flight."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._flush_call is not None and self._flush_call.active():
            self._flush_call.cancel()
        self._flush_call = None
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.cancel()
        self.buffer.clear()
