"""Registration with, and heartbeats to, a RoleMesh dispatcher.

The dispatcher is advisory for this node: whatever it does (refuse
connections, hang, answer 5xx, reject our token, forget us), the agent keeps
serving locally.  So every request here is bounded by a timeout, every
failure is absorbed and turned into a retry, and the log speaks once per
change of the dispatcher's health, not once per attempt.

The decisions (how long to wait, what a status code means) are pure and live
in :class:`~rolemesh.backoff.Backoff` and :func:`classify`; :class:`DispatcherClient` only does
the I/O, on an injected reactor with an injected ``treq``-like client, so the
tests drive it with ``task.Clock`` and ``treq.testing.StubTreq``.
"""

from __future__ import annotations

import json
import random as _random
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

from treq.client import HTTPClient
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import HTTPConnectionPool
from twisted.web.iweb import IPolicyForHTTPS

from rolemesh import __version__
from rolemesh.backoff import Backoff
from rolemesh.config import is_loopback
from rolemesh.control_client import quiet_pool, quiet_treq
from rolemesh.enums import StrEnum
from rolemesh.event_loop.reactor import resolve_reactor
from rolemesh.interfaces import IHTTPClientReactor
from rolemesh.node_events import DISPATCHER_DOWN, DISPATCHER_UP, ROUTING_TYPES, DeltaBuffer, NodeEvent, NodeFeed
from rolemesh.payloads import deregistration_payload, events_payload, with_last_seq
from rolemesh.tls import DispatcherTLSPolicy, describe_tls_failure

REGISTER_PATH = "/v1/nodes/register"
HEARTBEAT_PATH = "/v1/nodes/heartbeat"
DEREGISTER_PATH = "/v1/nodes/deregister"
EVENTS_PATH = "/v1/nodes/events"

#: Changes are held this long before they go, so a burst is one message.
COALESCE_S = 0.2
#: The bounds of a heartbeat interval a dispatcher may ask for in its answer
#: (``{"heartbeat_interval_s": N}``): back-pressure, never silence.
MIN_ASKED_INTERVAL_S = 1.0
MAX_ASKED_INTERVAL_S = 300.0


class RequestKind(StrEnum):
    """The three requests the client sends."""

    REGISTER = "register"
    HEARTBEAT = "heartbeat"
    DEREGISTER = "deregister"
    EVENTS = "events"


class Outcome(StrEnum):
    """What one answer (or the lack of one) means; see :func:`classify`."""

    OK = "ok"
    FORGOTTEN = "forgotten"
    AUTH = "auth"
    REJECTED = "rejected"
    TRANSIENT = "transient"


class DispatcherState(StrEnum):
    """Values of :attr:`DispatcherClient.state` (shown by ``/ready``, the
    systemd status line and the ``rolemesh_dispatcher_state`` metric)."""

    UNREGISTERED = "unregistered"
    REGISTERED = "registered"
    UNREACHABLE = "unreachable"


OK = Outcome.OK
FORGOTTEN = Outcome.FORGOTTEN
AUTH = Outcome.AUTH
REJECTED = Outcome.REJECTED
TRANSIENT = Outcome.TRANSIENT

UNREGISTERED = DispatcherState.UNREGISTERED
REGISTERED = DispatcherState.REGISTERED
UNREACHABLE = DispatcherState.UNREACHABLE

_TRANSIENT_CODES = frozenset({408, 425, 429})
_MAX_DETAIL = 200


def classify(kind: str, code: Optional[int]) -> Outcome:
    """What the dispatcher's answer to a ``kind`` request means.

    ``code`` is the HTTP status, or ``None`` when no answer came (connection
    refused, reset, timeout).  ``kind`` is a :class:`RequestKind`.  Returns
    one of ``OK``, ``FORGOTTEN`` (the dispatcher no longer knows the node:
    register again), ``AUTH`` (our token was refused:
    a configuration error), ``REJECTED`` (any other refusal, e.g. a wrong base
    URL or a payload it does not accept) or ``TRANSIENT`` (down, overloaded
    or slow: retry with backoff).
    """
    if code is None:
        return TRANSIENT
    if 200 <= code < 300:
        return OK
    if code in (404, 410) and kind in (RequestKind.HEARTBEAT, RequestKind.DEREGISTER):
        return FORGOTTEN
    if code == 410 and kind == RequestKind.EVENTS:  # 404 there: a dispatcher without the route (see _events_answer)
        return FORGOTTEN
    if code in (401, 403):
        return AUTH
    if code in _TRANSIENT_CODES or code >= 500:
        return TRANSIENT
    return REJECTED


def _default_http(reactor: IHTTPClientReactor, timeout: float, tls_policy: Optional[IPolicyForHTTPS] = None,
                  pool: Optional[HTTPConnectionPool] = None) -> HTTPClient:
    """A treq ``HTTPClient`` on ``reactor`` with a bounded connect time.

    ``tls_policy`` (an ``IPolicyForHTTPS``, see
    :func:`rolemesh.tls.dispatcher_tls_policy`) decides how an https://
    dispatcher is verified and which client certificate is shown; without
    it treq's default applies (the system trust store).

    Non-persistent connections: one short request every few seconds does not
    need a pool, a POST on a stale kept-alive connection would fail (and read
    as an outage), and nothing lingers on the reactor after shutdown.  The
    connections are quiet so each beat does not log "Starting factory" /
    "Stopping factory".
    """
    if tls_policy is None:
        return quiet_treq(reactor, persistent=False, connect_timeout=timeout)
    return quiet_treq(reactor, connect_timeout=timeout, pool=pool or _tls_pool(reactor), tls_policy=tls_policy)


def _tls_pool(reactor: IReactorTime) -> HTTPConnectionPool:
    """The pool for HTTPS to the dispatcher: connections the client closes itself.

    A TLS connection still exchanging close_notify when the reactor shuts
    down can make Twisted's TLS layer log an unhandled error, so finished
    connections are kept (briefly) in this pool and
    :meth:`DispatcherClient.stopService` aborts them before it returns.  The
    short cache time means a beat seldom reuses a connection the dispatcher
    may have dropped meanwhile.
    """
    pool = quiet_pool(reactor, persistent=True)
    pool.maxPersistentPerHost = 1
    pool.cachedConnectionTimeout = 1
    return pool




def plaintext_off_loopback(url: str) -> bool:
    """True for an ``http://`` URL whose host is not loopback: the token and
    every payload would cross the network in the clear."""
    scheme, sep, rest = url.partition("://")
    if scheme.lower() != "http" or not sep:
        return False
    host = rest.partition("/")[0].rpartition("@")[2]
    if host.startswith("["):
        host = host[: host.find("]") + 1]
    else:
        host = host.partition(":")[0]
    return not is_loopback(host)


def asked_interval(body: str) -> Optional[float]:
    """The ``heartbeat_interval_s`` a dispatcher's JSON answer asks for,
    clamped to [MIN_ASKED_INTERVAL_S, MAX_ASKED_INTERVAL_S]; None if it asks none."""
    answer = _json_object(body)
    value = answer.get("heartbeat_interval_s")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    return min(MAX_ASKED_INTERVAL_S, max(MIN_ASKED_INTERVAL_S, float(value)))


def _json_object(body: str) -> Dict[str, Any]:
    try:
        answer = json.loads(body) if body else {}
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


def _without_userinfo(url: str) -> str:
    """``url`` with any ``user:password@`` removed, for logs."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    host, slash, path = rest.partition("/")
    return f"{scheme}://{host.rpartition('@')[2]}{slash}{path}"


class PostsJSON(Protocol):
    """What the client needs of its HTTP client: treq's ``post`` (a
    ``treq.client.HTTPClient``, or ``treq.testing.StubTreq`` in tests),
    firing with treq's response (``.code``, ``.content()``)."""

    def post(self, url: str, /, *, json: Any = ..., headers: Any = ..., allow_redirects: bool = ...,
             reactor: Any = ...) -> Deferred[Any]: ...


class DispatcherClient(Service):
    """Registers the node, heartbeats it, and deregisters it on shutdown.

    ``registration`` and ``heartbeat`` are called just before each request to
    build its JSON body (see :mod:`rolemesh.payloads`), so every beat carries
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

    log = Logger()

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
        self.base_url = base_url.rstrip("/")
        #: The base URL without any user:password, for logs and status pages.
        self.display_url = _without_userinfo(self.base_url)
        self._token = token or None
        self._registration = registration
        self._heartbeat = heartbeat
        self.interval = float(interval)
        self._reactor = reactor
        self.on_result = on_result
        self._connect(http, request_timeout, deregister_timeout, tls_policy)
        self._retry_policy(backoff_base, backoff_cap, slow_retry, random)
        self._start_books()
        self._events_books(feed, full_interval, coalesce)

    def _events_books(self, feed: Optional[NodeFeed], full_interval: Optional[float], coalesce: float) -> None:
        """Deltas (``POST /v1/nodes/events``) from ``feed``; none without one."""
        #: The node's events, sent as deltas while the dispatcher takes them.
        self.feed = feed
        #: The full heartbeat's interval while it does (else ``interval``).
        self.full_interval = float(full_interval) if full_interval is not None else self.interval
        self.coalesce = float(coalesce)
        #: Whether the dispatcher takes events: None until it answered one.
        self.events_accepted: Optional[bool] = None
        #: The ``seq`` of the last events body sent (0: none yet).
        self.events_seq = 0
        self.events_ok = 0
        self.events_failed = 0
        #: A heartbeat interval the dispatcher asked for (clamped), or None.
        self.asked_interval: Optional[float] = None
        self._deltas = DeltaBuffer()
        self._flush_call: Optional[IDelayedCall] = None
        self._delta_inflight: Optional[Deferred[Any]] = None
        self._unsubscribe_feed: Optional[Callable[[], None]] = None
        self._told_state: Optional[DispatcherState] = None

    @property
    def beat_interval(self) -> float:
        """Seconds from one heartbeat to the next now: what the dispatcher
        asked for, else the full interval while it takes events, else ``interval``."""
        if self.asked_interval is not None:
            return self.asked_interval
        return self.full_interval if self.events_accepted else self.interval

    def _connect(self, http: Optional[PostsJSON], request_timeout: float, deregister_timeout: float,
                 tls_policy: Optional[DispatcherTLSPolicy]) -> None:
        """The HTTP client (``http``, else a quiet treq on the reactor) and its time limits."""
        #: The :class:`rolemesh.tls.DispatcherTLSPolicy` (None: treq's default
        #: for https://); its ``reload_for`` is the config-reload hook.
        self.tls_policy = tls_policy
        #: HTTPS connections to close on stop (see :func:`_tls_pool`).
        self._pool = _tls_pool(self._reactor) if http is None and tls_policy is not None else None
        self._http: PostsJSON = (http if http is not None
                      else _default_http(self._reactor, request_timeout, tls_policy, self._pool))
        self.request_timeout = float(request_timeout)
        self.deregister_timeout = float(deregister_timeout)

    def _retry_policy(self, backoff_base: Optional[float], backoff_cap: Optional[float], slow_retry: Optional[float],
                      random: Callable[[], float]) -> None:
        """Back-off after transient failures; the slow retry after refusals."""
        cap = float(backoff_cap) if backoff_cap is not None else self.interval
        base = float(backoff_base) if backoff_base is not None else min(1.0, cap / 4)
        self._backoff = Backoff(base, cap, random)
        #: Delay between attempts once the dispatcher refused us (401/403/4xx).
        self.slow_retry = float(slow_retry) if slow_retry is not None else max(60.0, 10 * self.interval)

    def _start_books(self) -> None:
        """The state, counters and loop bookkeeping of a client that has not sent anything yet."""
        self.state: DispatcherState = UNREGISTERED
        #: ``reactor.seconds()`` of the last answered-OK request, or None.
        self.last_success: Optional[float] = None
        self.heartbeats_ok = 0
        self.heartbeats_failed = 0
        self.registrations_ok = 0
        self.registrations_failed = 0

        self._registered = False
        self._maybe_known = False
        self._node_id: Optional[str] = None
        self._problem: Optional[Outcome] = None
        self._problem_since: Optional[float] = None
        self._failed_attempts = 0
        self._builder_broken = False
        self._call: Optional[IDelayedCall] = None
        self._inflight: Optional[Deferred[Any]] = None
        self._register_again = False

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
        if self.feed is not None:
            self._unsubscribe_feed = self.feed.subscribe(self._on_event)
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
        self._stop_deltas()
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.cancel()
        if not self._maybe_known:
            return self._close_connections(None)
        d = Deferred.fromCoroutine(self._deregister())

        def swallow(failure: Failure) -> None:
            self.log.info("dispatcher deregistration skipped: {reason}", reason=self._describe(failure))

        d.addErrback(swallow)
        d.addBoth(self._close_connections)
        return d

    def _close_connections(self, _: object) -> Deferred[None]:
        """Abort kept HTTPS connections; fires once they are gone."""
        if self._pool is None:
            return succeed(None)
        closed: Deferred[None] = self._pool.closeCachedConnections()
        closed.addErrback(lambda failure: None)
        return closed

    def reregister(self, token: Optional[str]) -> None:
        """Register afresh now (after a config reload: the payload, the
        token or both may have changed); heartbeats follow as usual."""
        self._token = token or None
        self._registered = False
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
            self._tell_state()
            if self._register_again:  # a reregister() came while this step ran
                self._register_again = False
                self._registered = False
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
        if self._registered:
            return await self._beat()
        return await self._register()

    async def _register(self) -> float:
        started = self._reactor.seconds()
        payload = self._build("registration", self._registration)
        if payload is None:
            return self.slow_retry
        if isinstance(payload.get("node_id"), str):
            self._node_id = payload["node_id"]
        self._maybe_known = True
        code, detail, detail_body = await self._exchange(REGISTER_PATH, payload, self.request_timeout)
        if not self.running:
            raise CancelledError()  # stopped while the request was cancelled: report nothing
        outcome = classify(RequestKind.REGISTER, code)
        self._report(RequestKind.REGISTER, outcome == OK)
        if outcome == OK:
            self.registrations_ok += 1
            self._registered = True
            self._succeeded()
            self.log.info(
                "registered with dispatcher {dispatcher} as node {node_id}",
                dispatcher=self.display_url,
                node_id=self._node_id,
            )
            if self.feed is not None:
                return self._registered_with_events(detail_body)
            return started + self.interval - self._reactor.seconds()
        self.registrations_failed += 1
        return self._failed(RequestKind.REGISTER, outcome, code, detail)

    async def _beat(self) -> float:
        started = self._reactor.seconds()
        payload = self._build("heartbeat", self._heartbeat)
        if payload is None:
            return self.interval
        if self.events_accepted:
            self._deltas.clear()  # this full state supersedes the changes not sent yet
            payload = with_last_seq(payload, self.events_seq)
        code, detail, body = await self._exchange(HEARTBEAT_PATH, payload, self.request_timeout)
        if not self.running:
            raise CancelledError()  # stopped while the request was cancelled: report nothing
        outcome = classify(RequestKind.HEARTBEAT, code)
        self._report(RequestKind.HEARTBEAT, outcome == OK)
        if outcome == OK:
            self.heartbeats_ok += 1
            self._succeeded()
            self._take_interval(body)
            return started + self.beat_interval - self._reactor.seconds()
        self.heartbeats_failed += 1
        if outcome == FORGOTTEN:
            # The dispatcher is up (it answered) but lost us, e.g. it restarted.
            self._registered = False
            self.state = UNREGISTERED
            self.last_success = self._reactor.seconds()
            self._backoff.reset()
            self._recovered()
            self.log.info(
                "dispatcher does not know node {node_id} (HTTP {code}); registering again",
                node_id=self._node_id,
                code=code,
            )
            return 0.0
        return self._failed(RequestKind.HEARTBEAT, outcome, code, detail)

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

    # ------------------------------------------------------------------
    # Health bookkeeping: log on change only

    def _succeeded(self) -> None:
        self.state = REGISTERED if self._registered else UNREGISTERED
        self.last_success = self._reactor.seconds()
        self._backoff.reset()
        self._recovered()

    def _recovered(self) -> None:
        problem = self._problem
        if problem is None:
            return
        since = self._problem_since if self._problem_since is not None else self._reactor.seconds()
        fields = {
            "dispatcher": self.display_url,
            "down_s": round(self._reactor.seconds() - since, 3),
            "failed_attempts": self._failed_attempts,
        }
        if problem == TRANSIENT:
            self.log.info(
                "dispatcher reachable again after {down_s}s and {failed_attempts} failed attempts", **fields
            )
        else:
            self.log.info("dispatcher accepts this node again after {down_s}s", **fields)
        self._problem = None
        self._problem_since = None
        self._failed_attempts = 0

    def _failed(self, kind: RequestKind, outcome: Outcome, code: Optional[int], detail: str) -> float:
        """Record a failed request; log only if the kind of failure changed."""
        self.state = UNREACHABLE
        self._failed_attempts += 1
        if outcome == TRANSIENT:
            delay = self._backoff.next_delay()
        else:
            delay = self.slow_retry
        if outcome != self._problem:
            if self._problem is None:
                self._problem_since = self._reactor.seconds()
            self._problem = outcome
            reason = detail if code is None else (f"HTTP {code}: {detail}" if detail else f"HTTP {code}")
            fields = {"dispatcher": self.display_url, "request": kind, "code": code, "reason": reason}
            if outcome == TRANSIENT:
                self.log.warn(  # noqa: G010 - twisted.logger.Logger has warn(), not warning()
                    "dispatcher unreachable ({reason}); retrying in the background "
                    "with backoff up to {cap}s, local serving continues",
                    cap=self._backoff.cap,
                    **fields,
                )
            elif outcome == AUTH:
                self.log.error(
                    "configuration error: dispatcher rejected our token (HTTP {code} on {request}); "
                    "check dispatcher_token; retrying every {retry_s}s",
                    retry_s=self.slow_retry,
                    **fields,
                )
            else:
                self.log.error(
                    "dispatcher rejected the {request} request ({reason}); "
                    "check dispatcher_base_url; retrying every {retry_s}s",
                    retry_s=self.slow_retry,
                    **fields,
                )
        return delay

    def _report(self, kind: RequestKind, ok: bool) -> None:
        if self.on_result is None:
            return
        try:
            self.on_result(kind, ok)
        except Exception:  # noqa: BLE001 - a metrics hook must not stop the heartbeats
            self.log.failure("dispatcher on_result hook failed")

    # ------------------------------------------------------------------
    # HTTP

    def _headers(self) -> Dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": f"rolemesh-node-agent/{__version__}"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    async def _post(self, path: str, payload: Dict[str, Any], timeout: float) -> Tuple[Optional[int], str]:
        """POST ``payload``; return ``(status, detail)``, status None if no answer."""
        code, detail, _ = await self._exchange(path, payload, timeout)
        return code, detail

    async def _exchange(self, path: str, payload: Dict[str, Any],
                        timeout: float) -> Tuple[Optional[int], str, str]:
        """POST ``payload``; return ``(status, detail, body)``, status None if no answer.

        Never raises except :class:`CancelledError` when the service stops.
        The whole exchange, body included, is bounded by ``timeout``.
        """
        url = self.base_url + path

        async def exchange() -> Tuple[int, bytes]:
            response = await self._http.post(
                url,
                json=payload,
                headers=self._headers(),
                allow_redirects=False,
                reactor=self._reactor,
            )
            body = await response.content()
            return response.code, body

        d = Deferred.fromCoroutine(exchange())
        timed_out = []

        def expire() -> None:
            timed_out.append(True)
            d.cancel()

        timer = self._reactor.callLater(timeout, expire)
        try:
            code, body = await d
        except CancelledError:
            raise
        except Exception:  # noqa: BLE001 - any failure means "no answer"; never raise
            # A cancelled Agent request surfaces as ResponseNeverReceived, not
            # CancelledError, so the timer's flag is what tells a timeout apart.
            if timed_out:
                return None, f"no answer within {timeout:g}s", ""
            return None, self._describe(Failure()), ""
        finally:
            if timer.active():
                timer.cancel()
        text = body.decode("utf-8", "replace").strip()
        return code, self._scrub(text), text[:65536]

    def _describe(self, failure: Failure) -> str:
        """A short, token-free account of why a request failed."""
        value = failure.value
        name = type(value).__name__
        reasons = getattr(value, "reasons", None)  # treq/Agent wrap the cause in a list
        if reasons:
            value = reasons[0].value
            name = type(value).__name__
        tls = describe_tls_failure(value)
        if tls is not None:
            return self._scrub(tls)
        text = str(value).strip()
        return self._scrub(f"{name}: {text}" if text else name)

    def _scrub(self, text: str) -> str:
        if self._token:
            text = text.replace(self._token, "***")
        return text[:_MAX_DETAIL]

    async def _deregister(self) -> None:
        node_id = self._node_id
        if node_id is None:
            payload = self._build("registration", self._registration)
            node_id = payload.get("node_id") if payload else None
        if not isinstance(node_id, str):
            return
        payload = deregistration_payload(node_id)
        code, detail = await self._post(DEREGISTER_PATH, payload, self.deregister_timeout)
        outcome = classify(RequestKind.DEREGISTER, code)
        self._report(RequestKind.DEREGISTER, outcome in (OK, FORGOTTEN))
        self._registered = False
        self._maybe_known = False
        self.state = UNREGISTERED
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
    # Deltas: POST /v1/nodes/events (see docs/dispatcher-protocol.md)

    def _registered_with_events(self, body: str) -> float:
        """After a registration: learn whether the dispatcher takes events
        (its answer's ``events``, else an empty events body: 404 says no),
        and send the full state at once -- a restarted dispatcher knows
        nothing of us."""
        answer = _json_object(body)
        self._deltas.clear()
        self.events_accepted = None  # perhaps another dispatcher now: ask again
        self._take_interval(body)
        if isinstance(answer.get("events"), bool):
            self._events_verdict(answer["events"], "its registration answer")
        elif self.events_accepted is None:
            self._send_delta([])  # the probe
        return 0.0

    def _take_interval(self, body: str) -> None:
        asked = asked_interval(body)
        if asked is not None and asked != self.asked_interval:
            self.log.info("dispatcher asks for a heartbeat every {asked}s", asked=asked)
            self.asked_interval = asked

    def _events_verdict(self, accepted: bool, how: str) -> None:
        if accepted == self.events_accepted:
            return
        self.events_accepted = accepted
        if accepted:
            self.log.info("dispatcher takes events ({how}): changes go at once, full state every {interval}s",
                          how=how, interval=self.beat_interval)
        else:
            self._deltas.clear()
            self.log.info("dispatcher does not take events ({how}): heartbeats only, every {interval}s",
                          how=how, interval=self.beat_interval)
            self._beat_soon(self.interval)

    def _beat_soon(self, within: float) -> None:
        """Bring the next heartbeat forward to at most ``within`` seconds from now."""
        call = self._call
        if call is None or not call.active() or self._inflight is not None:
            return
        if call.getTime() - self._reactor.seconds() > within:
            call.cancel()
            self._schedule(within)

    def _on_event(self, event: NodeEvent) -> None:
        """A change of the node: held for the coalescing window, then sent."""
        if event.type not in ROUTING_TYPES or not self.running:
            return
        if not self._registered or self.events_accepted is False:
            return  # the registration's full heartbeat, or the next heartbeat, carries it
        self._deltas.add(event)
        if self._flush_call is None and self._delta_inflight is None:
            self._flush_call = self._reactor.callLater(self.coalesce, self._flush)

    def _flush(self) -> None:
        self._flush_call = None
        if not self.running or not self._deltas or self._delta_inflight is not None:
            return
        if self._deltas.overflowed:  # more changes than kept: full state instead
            self._deltas.clear()
            self._beat_soon(0)
            return
        self._send_delta([e.to_json() for e in self._deltas.take()])

    def _send_delta(self, events: List[Dict[str, Any]]) -> None:
        if self._node_id is None:
            return
        self.events_seq += 1
        payload = events_payload(self._node_id, self.events_seq, self._reactor.seconds(), events)
        d = Deferred.fromCoroutine(self._exchange(EVENTS_PATH, payload, self.request_timeout))
        self._delta_inflight = d

        def answered(result: Tuple[Optional[int], str, str]) -> None:
            self._delta_inflight = None
            self._events_answer(*result)
            if self.running and self._deltas and self._flush_call is None:
                self._flush_call = self._reactor.callLater(self.coalesce, self._flush)

        def failed(failure: Failure) -> None:
            self._delta_inflight = None
            if not failure.check(CancelledError):
                self.log.failure("sending events to the dispatcher failed", failure)

        d.addCallbacks(answered, failed).addErrback(
            lambda f: self.log.failure("dispatcher events bookkeeping failed", f))

    def _events_answer(self, code: Optional[int], detail: str, body: str) -> None:
        if not self.running:
            return
        outcome = classify(RequestKind.EVENTS, code)
        self._report(RequestKind.EVENTS, outcome == OK)
        if outcome == OK:
            self.events_ok += 1
            self.last_success = self._reactor.seconds()
            self._take_interval(body)
            self._events_verdict(True, f"HTTP {code} on {EVENTS_PATH}")
            return
        self.events_failed += 1
        if code == 404:
            self._events_verdict(False, f"HTTP 404 on {EVENTS_PATH}")
        elif outcome == FORGOTTEN:
            self.log.info("dispatcher does not know node {node_id} (HTTP {code} on events); registering again",
                          node_id=self._node_id, code=code)
            self._registered = False
            self._beat_soon(0)
        # Otherwise (down, slow, refusing): these changes are dropped, not
        # queued; the next heartbeat's full state (and its last_seq) heals the gap.

    def _tell_state(self) -> None:
        """``dispatcher_up``/``dispatcher_down`` on the node's feed, on change."""
        state = self.state
        if self.feed is None or state == self._told_state or state == UNREGISTERED:
            return
        self._told_state = state
        self.feed.publish(DISPATCHER_UP if state == REGISTERED else DISPATCHER_DOWN, None, None,
                          dispatcher=self.display_url, state=str(state))

    def _stop_deltas(self) -> None:
        if self._unsubscribe_feed is not None:
            self._unsubscribe_feed()
            self._unsubscribe_feed = None
        if self._flush_call is not None and self._flush_call.active():
            self._flush_call.cancel()
        self._flush_call = None
        inflight, self._delta_inflight = self._delta_inflight, None
        if inflight is not None:
            inflight.cancel()
        self._deltas.clear()
