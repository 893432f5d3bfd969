"""The dispatcher client's HTTP side: one bounded POST of a JSON body.

:class:`DispatcherExchange` posts to ``<base_url><path>`` with the node's
bearer token and says what came back -- ``(status, detail, body)``, status
None when no answer came within the time limit -- and never raises (but
for :class:`CancelledError` when the client stops).  Whatever it says is
token-free (:meth:`DispatcherExchange.scrub`).  It owns the HTTP client
(``http``, else a quiet treq on the reactor) and, for HTTPS, the pool whose
connections it closes on :meth:`DispatcherExchange.close`.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Protocol, Tuple

from treq.client import HTTPClient
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure
from twisted.web.client import HTTPConnectionPool
from twisted.web.iweb import IPolicyForHTTPS

from rolemesh import __version__
from rolemesh.base.interfaces import IHTTPClientReactor
from rolemesh.config.tls import DispatcherTLSPolicy, describe_tls_failure
from rolemesh.http.control_client import quiet_pool, quiet_treq

__all__ = ["DispatcherExchange", "PostsJSON"]

_MAX_DETAIL = 200


def _default_http(reactor: IHTTPClientReactor, timeout: float, tls_policy: Optional[IPolicyForHTTPS] = None,
                  pool: Optional[HTTPConnectionPool] = None) -> HTTPClient:
    """A treq ``HTTPClient`` on ``reactor`` with a bounded connect time.

    ``tls_policy`` (an ``IPolicyForHTTPS``, see
    :func:`rolemesh.config.tls.dispatcher_tls_policy`) decides how an https://
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
    :meth:`DispatcherExchange.close` (on the client's stop) aborts them.  The
    short cache time means a beat seldom reuses a connection the dispatcher
    may have dropped meanwhile.
    """
    pool = quiet_pool(reactor, persistent=True)
    pool.maxPersistentPerHost = 1
    pool.cachedConnectionTimeout = 1
    return pool


class PostsJSON(Protocol):
    """What the client needs of its HTTP client: treq's ``post`` (a
    ``treq.client.HTTPClient``, or ``treq.testing.StubTreq`` in tests),
    firing with treq's response (``.code``, ``.content()``)."""

    def post(self, url: str, /, *, json: Any = ..., headers: Any = ..., allow_redirects: bool = ...,
             reactor: Any = ...) -> Deferred[Any]: ...


class DispatcherExchange:
    """POSTs to one dispatcher, bounded by a timeout, with the node's token."""

    def __init__(self, base_url: str, token: Optional[str], reactor: IHTTPClientReactor,
                 http: Optional[PostsJSON] = None, request_timeout: float = 5.0,
                 tls_policy: Optional[DispatcherTLSPolicy] = None) -> None:
        self.base_url = base_url
        #: The bearer token (None: none is sent); never logged.
        self.token = token or None
        self._reactor = reactor
        #: HTTPS connections to close on stop (see :func:`_tls_pool`).
        self._pool = _tls_pool(reactor) if http is None and tls_policy is not None else None
        self.http: PostsJSON = http if http is not None else _default_http(reactor, request_timeout, tls_policy,
                                                                           self._pool)

    def headers(self) -> Dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": f"rolemesh-node-agent/{__version__}"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    async def post(self, path: str, payload: Dict[str, Any], timeout: float) -> Tuple[Optional[int], str, str]:
        """POST ``payload``; return ``(status, detail, body)``, status None if no answer.

        Never raises except :class:`CancelledError` when the service stops.
        The whole exchange, body included, is bounded by ``timeout``.
        """
        url = self.base_url + path

        async def exchange() -> Tuple[int, bytes]:
            response = await self.http.post(
                url,
                json=payload,
                headers=self.headers(),
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
            return None, self.describe(Failure()), ""
        finally:
            if timer.active():
                timer.cancel()
        text = body.decode("utf-8", "replace").strip()
        return code, self.scrub(text), text[:65536]

    def describe(self, failure: Failure) -> str:
        """A short, token-free account of why a request failed."""
        value = failure.value
        name = type(value).__name__
        reasons = getattr(value, "reasons", None)  # treq/Agent wrap the cause in a list
        if reasons:
            value = reasons[0].value
            name = type(value).__name__
        tls = describe_tls_failure(value)
        if tls is not None:
            return self.scrub(tls)
        text = str(value).strip()
        return self.scrub(f"{name}: {text}" if text else name)

    def scrub(self, text: str) -> str:
        """``text`` with the token masked, cut to a log line's length."""
        if self.token:
            text = text.replace(self.token, "***")
        return text[:_MAX_DETAIL]

    def close(self) -> Deferred[None]:
        """Abort kept HTTPS connections; fires once they are gone."""
        if self._pool is None:
            return succeed(None)
        closed: Deferred[None] = self._pool.closeCachedConnections()
        closed.addErrback(lambda failure: None)
        return closed
