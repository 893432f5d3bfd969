"""Relay one request to a llama-server child and its answer back, unbuffered.

The upstream body is never collected: a :class:`_Relay` protocol writes each
chunk to the client as it arrives and registers the upstream transport as the
client's producer, so a slow client pauses llama-server's socket and a fast
one never waits for buffering.  When the client goes away, the route's
Deferred is cancelled (Klein does that) and the upstream connection is closed,
so llama-server stops generating.

Connections to children come from the proxy's own ``HTTPConnectionPool``;
llama-server closes its side after every streamed answer, so a request that
fails on a stale pooled connection before any byte was sent is retried once.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectError
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import HTTPConnectionPool, ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer, IResponse
from zope.interface import implementer

from rolemesh import errors
from rolemesh.http_client import quiet_agent, quiet_pool
from rolemesh.reactor import UsesReactor

log = Logger()

COMPLETE = "complete"
CLIENT_GONE = "client_gone"
STREAM_ERROR = "stream_error"
TRUNCATED = "truncated"

#: Response headers that describe one hop, not the answer.
HOP_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-authenticate",
        b"server",
        b"date",
        b"access-control-allow-origin",
    }
)


class UpstreamUnreachable(Exception):
    """The child gave no answer at all: refused, or the connection dropped
    before a byte of response (even on a fresh connection, a child that is
    dying can accept and then drop it).  The child is most likely gone; the
    request may go once to a fresh child -- inference has no side effects, so
    the worst case, a request that itself crashes the child, costs a second
    crash and then a 502."""

    def as_api_error(self) -> errors.ApiError:
        return errors.upstream_error(f"llama-server failed the request: {self}")


@implementer(IBodyProducer)
class BytesProducer:
    """An in-memory request body, written at once (no cooperator round-trip)."""

    def __init__(self, body: bytes) -> None:
        self._body = body
        self.length = len(body)

    def startProducing(self, consumer: Any) -> "Deferred[None]":
        consumer.write(self._body)
        return defer.succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


def _never_sent(failure: Failure) -> bool:
    """True when the request failed before llama-server could act on it."""
    from twisted.web._newclient import RequestNotSent, RequestTransmissionFailed, ResponseNeverReceived

    return bool(failure.check(RequestNotSent, RequestTransmissionFailed, ResponseNeverReceived))


def sse_error_event(message: str) -> bytes:
    """The event that ends a stream whose upstream died after it began."""
    body = {"error": {"message": message, "type": "server_error", "code": "upstream_error"}}
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


class _Relay(Protocol):
    """Copies an upstream body to the downstream request as it arrives."""

    def __init__(self, request: Any, finished: Deferred, on_first_byte: Optional[Callable[[], None]]) -> None:
        self._request = request
        self._finished = finished
        self._on_first_byte = on_first_byte

    def connectionMade(self) -> None:
        self._request.registerProducer(self.transport, True)

    def dataReceived(self, data: bytes) -> None:
        if self._on_first_byte is not None:
            notify, self._on_first_byte = self._on_first_byte, None
            notify()
        self._request.write(data)

    def abort(self) -> None:
        """The client went away: close the upstream connection."""
        if self.transport is not None:
            self.transport.stopProducing()  # type: ignore[attr-defined]  # a TransportProxyProducer

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        try:
            self._request.unregisterProducer()
        except Exception:
            pass
        # A bool, never the Failure: callback(Failure) would be an errback.
        self._finished.callback(bool(reason.check(ResponseDone, PotentialDataLoss)))


class Proxy(UsesReactor):
    """Sends requests to children over a persistent pool and relays answers."""

    def __init__(self, reactor: Any = None, max_per_host: int = 4, agent: Any = None) -> None:
        self._reactor = reactor
        self._max_per_host = max_per_host
        self._agent = agent
        self._pool: Optional[HTTPConnectionPool] = None

    @property
    def agent(self) -> Any:
        if self._agent is None:
            self._pool = quiet_pool(self.reactor, persistent=True)
            self._pool.maxPersistentPerHost = self._max_per_host
            self._pool.retryAutomatically = False
            self._agent = quiet_agent(self.reactor, persistent=True, pool=self._pool)
        return self._agent

    def close(self) -> "Deferred[None]":
        """Close pooled connections (on stop)."""
        if self._pool is None:
            return defer.succeed(None)
        return self._pool.closeCachedConnections()

    def _send(self, url: bytes, body: bytes, headers: Headers) -> "Deferred[IResponse]":
        return self.agent.request(b"POST", url, headers, BytesProducer(body))

    def forward(
        self,
        request: Any,
        base_url: str,
        path: str,
        body: bytes,
        streaming: bool,
        timeout: Optional[float] = None,
        on_first_byte: Optional[Callable[[], None]] = None,
    ) -> "Deferred[str]":
        """Relay ``body`` to ``base_url + path`` and the answer to ``request``.

        Fires with how the relay ended (``COMPLETE``, ``CLIENT_GONE``,
        ``STREAM_ERROR`` -- an SSE error event was sent --, or ``TRUNCATED`` --
        the answer broke off after its headers went out), and errbacks with an
        ApiError (502/504) when nothing was sent to the client yet.
        Cancelling it closes the upstream connection.
        """
        url = (base_url + path).encode("ascii")
        headers = Headers({b"content-type": [b"application/json"], b"accept": [b"*/*"]})
        relay: list = []
        state = {"timed_out": False, "cancelled": False}

        def cancel(d: Deferred) -> None:
            state["cancelled"] = True
            if relay:
                relay[0].abort()
            else:
                upstream.cancel()  # also reaches a Deferred it is chained to

        result: Deferred = Deferred(cancel)
        upstream = self._send(url, body, headers)

        def retry_stale(failure: Failure) -> Any:
            if _never_sent(failure) and not result.called and not state["cancelled"]:
                if self._pool is not None:
                    # Other idle connections to that child are as stale as the
                    # one that failed: the retry must open a fresh one.
                    self._pool.closeCachedConnections()
                log.debug("retrying on a fresh connection after {error}", error=failure.value)
                return self._send(url, body, headers)
            return failure

        upstream.addErrback(retry_stale)

        # A non-streaming answer must be complete by the deadline; a stream
        # must have begun by then (a hung child would otherwise hold the slot
        # for ever), after which it may run as long as it produces.
        timer = None
        if timeout is not None:

            def expire() -> None:
                state["timed_out"] = True
                cancel(result)

            timer = self.reactor.callLater(timeout, expire)

        def stop_timer(r: Any) -> Any:
            if timer is not None and timer.active():
                timer.cancel()
            return r

        def got_response(response: IResponse) -> "Deferred[Any]":
            if streaming:
                stop_timer(None)
            request.setResponseCode(response.code, response.phrase)
            for name, values in response.headers.getAllRawHeaders():
                if name.lower() not in HOP_HEADERS:
                    request.responseHeaders.setRawHeaders(name, values)
            event_stream = (response.headers.getRawHeaders(b"content-type") or [b""])[0].startswith(
                b"text/event-stream"
            )
            if event_stream:
                request.responseHeaders.removeHeader(b"content-length")
                request.setHeader(b"x-accel-buffering", b"no")
                request.setHeader(b"cache-control", b"no-cache")
            finished: Deferred = Deferred()  # fires True (whole body) or False (cut off)
            protocol = _Relay(request, finished, on_first_byte)
            relay.append(protocol)
            response.deliverBody(protocol)
            return finished.addCallback(lambda outcome: (outcome, event_stream))

        def relayed(outcome_and_kind: Any) -> None:
            outcome, event_stream = outcome_and_kind
            if result.called:
                return
            if outcome is True:
                result.callback(COMPLETE)
            elif self._client_gone(request):
                result.callback(CLIENT_GONE)
            elif event_stream and not state["timed_out"]:
                request.write(sse_error_event("llama-server closed the stream before it ended"))
                result.callback(STREAM_ERROR)
            else:
                result.callback(TRUNCATED)

        def failed(failure: Failure) -> None:
            if result.called:
                return
            if state["timed_out"]:
                result.errback(
                    errors.ApiError(
                        504,
                        f"llama-server did not {'start its stream' if streaming else 'answer'} within "
                        f"{timeout:g}s (request_timeout_s)",
                        "server_error",
                        "upstream_timeout",
                    )
                )
            elif failure.check(defer.CancelledError) or state["cancelled"]:
                # Agent fails a cancelled request with ResponseNeverReceived
                # ([CancelledError]), not CancelledError: still the client's doing.
                result.callback(CLIENT_GONE)
            elif failure.check(ConnectError) or _never_sent(failure):
                result.errback(UpstreamUnreachable(_describe(failure)))
            else:
                result.errback(errors.upstream_error(f"llama-server failed the request: {_describe(failure)}"))

        upstream.addCallback(got_response).addCallbacks(relayed, failed).addBoth(stop_timer)
        upstream.addErrback(lambda f: log.failure("proxy bookkeeping failed", f))
        return result

    @staticmethod
    def _client_gone(request: Any) -> bool:
        return bool(getattr(request, "_disconnected", False) or getattr(request, "finished", False))


def _describe(failure: Failure) -> str:
    reasons = getattr(failure.value, "reasons", None)
    if reasons:
        return "; ".join(r.getErrorMessage() for r in reasons)
    return failure.getErrorMessage() or getattr(failure.type, "__name__", "error")
