"""Registration with, and heartbeats to, a RoleMesh dispatcher.

The dispatcher is advisory for this node: whatever it does (refuse
connections, hang, answer 5xx, reject our token, forget us), the agent keeps
serving locally.  So every request here is bounded by a timeout, every
failure is absorbed and turned into a retry, and the log speaks once per
change of the dispatcher's health, not once per attempt.

:class:`DispatcherClient` is the loop (register, heartbeat, deregister) and
composes its parts: what messages and answers mean, pure
(:mod:`rolemesh.fleet.protocol`: :func:`classify`, the paths, the
states), the connection's state machine with its back-off
(:mod:`rolemesh.fleet.link`, over :class:`~rolemesh.base.backoff.Backoff`),
the HTTP exchange (:mod:`rolemesh.fleet.exchange`) and the deltas
(:mod:`rolemesh.fleet.deltas`); the bodies are built by
:mod:`rolemesh.node.payloads`.  Everything runs on an injected reactor with an
injected ``treq``-like client, so the tests drive it with ``task.Clock`` and
``treq.testing.StubTreq``.
"""

from __future__ import annotations

import random as _random
from typing import Any, Callable, Dict, Optional

from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from rolemesh.base.backoff import Backoff
from rolemesh.base.interfaces import IHTTPClientReactor
from rolemesh.config.tls import DispatcherTLSPolicy
from rolemesh.event_loop.reactor import resolve_reactor
from rolemesh.fleet.deltas import DeltaSender
from rolemesh.fleet.exchange import DispatcherExchange, PostsJSON
from rolemesh.fleet.link import DispatcherLink
from rolemesh.fleet.protocol import (
    AUTH,
    COALESCE_S,
    DEREGISTER_PATH,
    EVENTS_PATH,
    FORGOTTEN,
    HEARTBEAT_PATH,
    MAX_ASKED_INTERVAL_S,
    MIN_ASKED_INTERVAL_S,
    OK,
    REGISTER_PATH,
    REGISTERED,
    REJECTED,
    TRANSIENT,
    UNREACHABLE,
    UNREGISTERED,
    DispatcherState,
    Outcome,
    RequestKind,
    asked_interval,
    classify,
    plaintext_off_loopback,
    without_userinfo,
)
from rolemesh.node.feed import NodeFeed
from rolemesh.node.payloads import deregistration_payload

__all__ = [
    "AUTH", "COALESCE_S", "DEREGISTER_PATH", "EVENTS_PATH", "FORGOTTEN", "HEARTBEAT_PATH", "MAX_ASKED_INTERVAL_S",
    "MIN_ASKED_INTERVAL_S", "OK", "REGISTERED", "REGISTER_PATH", "REJECTED", "TRANSIENT", "UNREACHABLE",
    "UNREGISTERED", "Backoff", "DispatcherClient", "DispatcherState", "Outcome", "PostsJSON", "RequestKind",
    "asked_interval", "classify", "plaintext_off_loopback",
]


class DispatcherClient(Service):
    """Registers the node, heartbeats it, and deregisters it on shutdown.

    ``registration`` and ``heartbeat`` are called just before each request to
    build its JSON body (see :mod:`rolemesh.node.payloads`), so every beat carries
    the node's current state.  One request is in flight at a time; the next
    one is scheduled on ``reactor`` when it ends: ``interval`` after the start
    of a successful one, a jittered backoff (capped at ``backoff_cap``,
    default ``interval``) after a transient failure, ``slow_retry`` after the
    dispatcher refused us (bad token, bad URL), and at once after a heartbeat
    the dispatcher did not recognise (404/410), which re-registers.

    ``http`` is a ``treq``-like object: its ``post(url, json=, headers=,
    allow_redirects=, reactor=)`` returns a Deferred response with
    ``.code`` and ``.content()``.  The token is sent as a bearer token and is
    never logged.
    """

    def __init__(
        self,
        base_url: str,
        token: Optional[str],
        registration: Callable[[], Dict[str, Any]],
        heartbeat: Callable[[], Dict[str, Any]],
        interval: float,
        reactor: Optional[IHTTPClientReactor] = None,
        http: Optional[PostsJSON] = None,
        request_timeout: float = 5.0,
        *,
        backoff_base: Optional[float] = None,
        backoff_cap: Optional[float] = None,
        slow_retry: Optional[float] = None,
        deregister_timeout: float = 2.0,
        random: Callable[[], float] = _random.random,
        on_result: Optional[Callable[[str, bool], None]] = None,
        tls_policy: Optional[DispatcherTLSPolicy] = None,
        feed: Optional[NodeFeed] = None,
        full_interval: Optional[float] = None,
        coalesce: float = COALESCE_S,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be positive, got {interval!r}")
        reactor = resolve_reactor(reactor)  # the HTTP client needs it now
        #: The namespace operators' log filters know (from the module's first
        #: home; a class attribute would take this module's path).
        self.log = Logger(namespace="rolemesh.dispatcher.DispatcherClient")
        self.base_url = base_url.rstrip("/")
        #: The base URL without any user:password, for logs and status pages.
        self.display_url = without_userinfo(self.base_url)
        self._registration = registration
        self._heartbeat = heartbeat
        self.interval = float(interval)
        self._reactor = reactor
        self.on_result = on_result
        self._connect(token, http, request_timeout, deregister_timeout, tls_policy)
        #: Where the client stands with the dispatcher; its back-off and slow retry.
        self.link = self._new_link(backoff_base, backoff_cap, slow_retry, random)
        self.heartbeats_ok = self.heartbeats_failed = self.registrations_ok = self.registrations_failed = 0
        self._builder_broken = False
        self._call: Optional[IDelayedCall] = None
        self._inflight: Optional[Deferred[Any]] = None
        self._register_again = False
        self._events_books(feed, full_interval, coalesce)

    def _connect(self, token: Optional[str], http: Optional[PostsJSON], request_timeout: float,
                 deregister_timeout: float, tls_policy: Optional[DispatcherTLSPolicy]) -> None:
        """The HTTP side (``http``, else a quiet treq on the reactor) and its time limits."""
        #: The :class:`rolemesh.config.tls.DispatcherTLSPolicy` (None: treq's default
        #: for https://); its ``reload_for`` is the config-reload hook.
        self.tls_policy = tls_policy
        self.request_timeout = float(request_timeout)
        self.deregister_timeout = float(deregister_timeout)
        self.exchange = DispatcherExchange(self.base_url, token, self._reactor, http, self.request_timeout,
                                           tls_policy)

    def _new_link(self, backoff_base: Optional[float], backoff_cap: Optional[float], slow_retry: Optional[float],
                  random: Callable[[], float]) -> DispatcherLink:
        """Back-off after transient failures; the slow retry after refusals."""
        cap = float(backoff_cap) if backoff_cap is not None else self.interval
        base = float(backoff_base) if backoff_base is not None else min(1.0, cap / 4)
        slow = float(slow_retry) if slow_retry is not None else max(60.0, 10 * self.interval)
        return DispatcherLink(self.display_url, self._reactor, Backoff(base, cap, random), slow, self.log)

    def _events_books(self, feed: Optional[NodeFeed], full_interval: Optional[float], coalesce: float) -> None:
        """Deltas (``POST /v1/nodes/events``) from ``feed``; none without one."""
        #: The node's events; with a feed, changes go as deltas while the dispatcher takes them.
        self.feed = feed
        #: The full heartbeat's interval while it does (else ``interval``).
        self.full_interval = float(full_interval) if full_interval is not None else self.interval
        #: A heartbeat interval the dispatcher asked for (clamped), or None.
        self.asked_interval: Optional[float] = None
        self.deltas = (DeltaSender(self, self.link, self.exchange.post, self._reactor, feed, coalesce,
                                   self.request_timeout, self.log) if feed is not None else None)

    @property
    def state(self) -> DispatcherState:
        """Registered, unregistered or unreachable (``/ready``, the systemd
        status line, the ``rolemesh_dispatcher_state`` metric)."""
        return self.link.state

    @property
    def last_success(self) -> Optional[float]:
        """``reactor.seconds()`` of the last answered-OK request, or None."""
        return self.link.last_success

    @property
    def slow_retry(self) -> float:
        """Delay between attempts once the dispatcher refused us (401/403/4xx)."""
        return self.link.slow_retry

    @property
    def events_accepted(self) -> Optional[bool]:
        """Whether the dispatcher takes events: None until it answered one (or without a feed)."""
        return self.deltas.events_accepted if self.deltas is not None else None

    @property
    def beat_interval(self) -> float:
        """Seconds from one heartbeat to the next now: what the dispatcher
        asked for, else the full interval while it takes events, else ``interval``."""
        if self.asked_interval is not None:
            return self.asked_interval
        return self.full_interval if self.events_accepted else self.interval

    def __repr__(self) -> str:
        return f"<DispatcherClient {self.display_url} state={self.state}>"

    # ------------------------------------------------------------------
    # Service

    def startService(self) -> None:
        """Start registering in the background; never blocks start-up."""
        super().startService()
        if plaintext_off_loopback(self.base_url):
            self.log.warn(  # noqa: G010 - twisted.logger.Logger has warn(), not warning()
                "dispatcher_base_url {dispatcher} is plain http:// to another host: credentials and node "
                "state cross the network unencrypted and the dispatcher is not authenticated; use https://",
                dispatcher=self.display_url,
            )
        if self.deltas is not None:
            self.deltas.start()
        self._schedule(0)

    def stopService(self) -> Deferred[None]:
        """Stop the loop, then deregister (best effort, short timeout).

        The returned Deferred always succeeds, so a dead dispatcher never
        holds up or fails the agent's shutdown.
        """
        super().stopService()
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None
        if self.deltas is not None:
            self.deltas.stop()
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.cancel()
        if not self.link.maybe_known:
            return self.exchange.close()
        d = Deferred.fromCoroutine(self._deregister())

        def swallow(failure: Failure) -> None:
            self.log.info("dispatcher deregistration skipped: {reason}", reason=self.exchange.describe(failure))

        d.addErrback(swallow)
        d.addBoth(lambda _: self.exchange.close())
        return d

    def reregister(self, token: Optional[str]) -> None:
        """Register afresh now (after a config reload: the payload, the
        token or both may have changed); heartbeats follow as usual."""
        self.exchange.token = token or None
        self.link.registered = False
        if not self.running:
            return
        if self._inflight is not None:
            self._register_again = True
            return
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._schedule(0)

    # ------------------------------------------------------------------
    # The loop

    def _schedule(self, delay: float) -> None:
        if self.running:
            self._call = self._reactor.callLater(max(0.0, delay), self._tick)

    def _tick(self) -> None:
        """Run one step; it never fails, except by being cancelled on stop."""
        self._call = None
        if not self.running:
            return
        d = Deferred.fromCoroutine(self._step())
        self._inflight = d

        def done(delay: float) -> None:
            self._inflight = None
            self.link.tell(self.feed)
            if self._register_again:  # a reregister() came while this step ran
                self._register_again = False
                self.link.registered = False
                delay = 0.0
            self._schedule(delay)

        def failed(failure: Failure) -> None:
            self._inflight = None
            if failure.check(CancelledError) and not self.running:
                return
            self.log.failure("dispatcher client step failed unexpectedly", failure)
            self._schedule(self.slow_retry)

        def broken(failure: Failure) -> None:
            # An error in done() itself (addCallbacks does not hand it to
            # failed()): say so, and keep the loop going.
            self._inflight = None
            self.log.failure("dispatcher client loop failed; retrying in {delay:g}s", failure,
                             delay=self.slow_retry)
            if self._call is None or not self._call.active():
                self._schedule(self.slow_retry)

        d.addCallbacks(done, failed).addErrback(broken)

    async def _step(self) -> float:
        if self.link.registered:
            return await self._beat()
        return await self._register()

    async def _register(self) -> float:
        started = self._reactor.seconds()
        payload = self._build("registration", self._registration)
        if payload is None:
            return self.slow_retry
        if isinstance(payload.get("node_id"), str):
            self.link.node_id = payload["node_id"]
        self.link.maybe_known = True
        code, detail, body = await self.exchange.post(REGISTER_PATH, payload, self.request_timeout)
        if not self.running:
            raise CancelledError()  # stopped while the request was cancelled: report nothing
        outcome = classify(RequestKind.REGISTER, code)
        self.report(RequestKind.REGISTER, outcome == OK)
        if outcome == OK:
            self.registrations_ok += 1
            self.link.registered = True
            self.link.succeeded()
            self.log.info(
                "registered with dispatcher {dispatcher} as node {node_id}",
                dispatcher=self.display_url,
                node_id=self.link.node_id,
            )
            if self.deltas is not None:
                self.deltas.registered(body)
                return 0.0  # the full state at once: a restarted dispatcher knows nothing of us
            return started + self.interval - self._reactor.seconds()
        self.registrations_failed += 1
        return self.link.failed(RequestKind.REGISTER, outcome, code, detail)

    async def _beat(self) -> float:
        started = self._reactor.seconds()
        payload = self._build("heartbeat", self._heartbeat)
        if payload is None:
            return self.interval
        if self.deltas is not None:
            payload = self.deltas.full_state(payload)
        code, detail, body = await self.exchange.post(HEARTBEAT_PATH, payload, self.request_timeout)
        if not self.running:
            raise CancelledError()  # stopped while the request was cancelled: report nothing
        outcome = classify(RequestKind.HEARTBEAT, code)
        self.report(RequestKind.HEARTBEAT, outcome == OK)
        if outcome == OK:
            self.heartbeats_ok += 1
            self.link.succeeded()
            self.take_interval(body)
            return started + self.beat_interval - self._reactor.seconds()
        self.heartbeats_failed += 1
        if outcome == FORGOTTEN:
            self.link.forgotten()
            self.log.info(
                "dispatcher does not know node {node_id} (HTTP {code}); registering again",
                node_id=self.link.node_id,
                code=code,
            )
            return 0.0
        return self.link.failed(RequestKind.HEARTBEAT, outcome, code, detail)

    def _build(self, what: str, builder: Callable[[], Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """Call a payload builder; a broken one is logged once, not per beat."""
        try:
            payload = builder()
        except Exception:  # noqa: BLE001 - a caller bug must not stop the heartbeats
            if not self._builder_broken:
                self._builder_broken = True
                self.log.failure("could not build the {what} payload for the dispatcher", what=what)
            return None
        self._builder_broken = False
        return payload

    async def _deregister(self) -> None:
        node_id = self.link.node_id
        if node_id is None:
            payload = self._build("registration", self._registration)
            node_id = payload.get("node_id") if payload else None
        if not isinstance(node_id, str):
            return
        payload = deregistration_payload(node_id)
        code, detail, _ = await self.exchange.post(DEREGISTER_PATH, payload, self.deregister_timeout)
        outcome = classify(RequestKind.DEREGISTER, code)
        self.report(RequestKind.DEREGISTER, outcome in (OK, FORGOTTEN))
        self.link.deregistered()
        if outcome == OK:
            self.log.info("deregistered node {node_id} from dispatcher {dispatcher}",
                          node_id=node_id, dispatcher=self.display_url)
        elif outcome == FORGOTTEN:
            self.log.info("dispatcher {dispatcher} has no registration to remove (HTTP {code}); fine",
                          dispatcher=self.display_url, code=code)
        else:
            self.log.info("dispatcher deregistration failed (best effort, ignored): {reason}",
                          reason=detail if code is None else f"HTTP {code}: {detail}")

    # ------------------------------------------------------------------
    # What the parts ask of the loop (rolemesh.fleet.deltas.DeltaHost)

    def report(self, kind: RequestKind, ok: bool) -> None:
        """Tell ``on_result`` how a request went; a hook that fails is logged."""
        if self.on_result is None:
            return
        try:
            self.on_result(kind, ok)
        except Exception:  # noqa: BLE001 - a metrics hook must not stop the heartbeats
            self.log.failure("dispatcher on_result hook failed")

    def take_interval(self, body: str) -> None:
        """Learn the heartbeat interval the dispatcher's answer asks for, if any."""
        asked = asked_interval(body)
        if asked is not None and asked != self.asked_interval:
            self.log.info("dispatcher asks for a heartbeat every {asked}s", asked=asked)
            self.asked_interval = asked

    def beat_soon(self, within: float) -> None:
        """Bring the next heartbeat forward to at most ``within`` seconds from now."""
        call = self._call
        if call is None or not call.active() or self._inflight is not None:
            return
        if call.getTime() - self._reactor.seconds() > within:
            call.cancel()
            self._schedule(within)
