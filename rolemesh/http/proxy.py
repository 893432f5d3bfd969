"""Relay one request to a llama-server child and its answer back, unbuffered.

The upstream body is never collected: a :class:`_Relay` protocol writes each
chunk to the client as it arrives and registers the upstream transport as the
client's producer, so a slow client pauses llama-server's socket and a fast
one never waits for buffering.  When the client goes away, the route's
Deferred is cancelled (Klein does that) and the upstream connection is closed,
so llama-server stops generating.

Requests go to children through :class:`rolemesh.http.child_client.ChildAgent`, a
lean HTTP/1.1 client with its own pool of kept-alive connections per child;
llama-server closes its side after every streamed answer, so a request that
fails on a stale pooled connection before any byte was sent is retried once.
"""

from __future__ import annotations

import json
from typing import Callable, Optional, Sequence, Tuple, Union

import attr
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectError
from twisted.internet.interfaces import IConsumer, IDelayedCall
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer, IResponse
from zope.interface import implementer

from rolemesh.base import errors
from rolemesh.base.interfaces import ChildRequester, IHTTPClientReactor, ProxiedRequest
from rolemesh.event_loop.reactor import UsesReactor
from rolemesh.event_loop.twisted_compat import client_disconnected, never_sent
from rolemesh.http.child_client import ChildAgent
from rolemesh.http.prompt_cache import anthropic_usage, prompt_timings

log = Logger(namespace="rolemesh.proxy")

COMPLETE = "complete"
CLIENT_GONE = "client_gone"
STREAM_ERROR = "stream_error"
TRUNCATED = "truncated"
STALLED = "stalled"

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


#: A good ``stream_coalesce_ms`` (as seconds) where the agent's CPU is the
#: ceiling: once a stream has begun, the events llama-server writes within
#: this long are relayed together -- one wake-up, read and write for several
#: tokens instead of one each.  The first event goes at once; a later one
#: waits at most this long.  Off unless configured: by default every read is
#: relayed as it arrives.
STREAM_COALESCE_S = 0.008

#: How an OpenAI stream's last event ends what the client is sent: ``data:
#: [DONE]`` on a line of its own and the blank line after it (a JSON string
#: holds no raw newline, so no token's text can look like it).  The child
#: writes nothing after it but the chunked body's end, so it is always at the
#: end of a read: one compare per event, not a search.
_DONE_END = b"\ndata: [DONE]\n\n"
_DONE_LEN = len(_DONE_END)

#: The last event of each API's stream, as the line that names it: the
#: stream is whole once the blank line after it is in.  OpenAI's chat and
#: completions end with ``data: [DONE]`` (the compare above); Anthropic's
#: Messages with ``message_stop``, OpenAI's Responses with
#: ``response.completed`` (or ``response.failed`` / ``response.incomplete``,
#: the other ends of a response), neither with ``[DONE]``.
DONE = b"[DONE]"
STREAM_ENDS = {
    "messages": (b"\nevent: message_stop\n",),
    "responses": (b"\nevent: response.completed\n", b"\nevent: response.failed\n",
                  b"\nevent: response.incomplete\n"),
}

#: Bytes of the read before the last one kept to find a ``timings`` object
#: that two reads split (the object is about 350 bytes).
TIMINGS_SPAN = 4096

#: Told ``(cache_n, prompt_n)`` of an answer's ``timings`` (rolemesh.http.prompt_cache).
TimingsCallback = Callable[[int, int], None]

#: The headers of every request to a child (never changed: shared).
_REQUEST_HEADERS = Headers({b"content-type": [b"application/json"], b"accept": [b"*/*"]})

#: How much of a stream's beginning ``RequestShape.first_read`` may be shown.
FIRST_READ_BYTES = 4096


@attr.s(frozen=True, slots=True, auto_attribs=True)
class RequestShape:
    """How a request that is not a JSON POST to an OpenAI route goes to the
    child and comes back: its method and headers (None: a JSON POST's), and
    the lines that name its stream's last event (:data:`STREAM_ENDS`)."""

    method: bytes = b"POST"
    headers: Optional[Headers] = None
    stream_ends: Tuple[bytes, ...] = ()
    #: Whose stream it is (``openai``, ``anthropic``, ``responses``): how a cut one is ended.
    api: str = "openai"
    #: Told a stream's first bytes (where its completion id is) until it says it found what
    #: it looks for (True) or FIRST_READ_BYTES came: the first event may come in pieces.
    first_read: Optional[Callable[[bytes], bool]] = None


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
        #: Public: :class:`rolemesh.http.child_client.ChildAgent` sends it as is.
        self.body = body
        self.length = len(body)

    def startProducing(self, consumer: IConsumer) -> "Deferred[None]":
        consumer.write(self.body)
        return defer.succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


def _never_sent(failure: Failure) -> bool:
    """True when the request failed before llama-server could act on it."""
    return never_sent(failure)


def tell_timings(timings: TimingsCallback, found: Optional[Tuple[int, int]]) -> None:
    """Tell ``timings`` the figures ``found`` (:func:`prompt_timings`), if
    any; a bug in it is logged, never the relay's (or the request's) end."""
    if found is not None:
        try:
            timings(*found)
        except Exception:
            log.failure("counting an answer's prompt tokens failed")


def sse_error_event(message: str, api: str = "openai") -> bytes:
    """The event that ends a stream whose upstream died after it began, as
    the stream's API writes one: OpenAI's chat an error object and
    ``[DONE]``; Anthropic's and the Responses API an ``error`` event (each
    SDK raises it as an error)."""
    error = {"message": message, "type": "server_error", "code": "upstream_error"}
    if api == "anthropic":
        body = {"type": "error", "error": {"type": "api_error", "message": message}}
        return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"
    if api == "responses":
        return b"event: error\ndata: " + json.dumps({"type": "error", "error": error}).encode() + b"\n\n"
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\ndata: [DONE]\n\n"


class _Relay(Protocol):
    """Copies an upstream body to the downstream request as it arrives;
    tells ``ended(whole)`` how the body ended.

    ``watch_done`` (an event stream): ``answered`` turns True once the
    stream's ``data: [DONE]`` was written to the client -- the client has its
    whole answer then, whatever happens to the connections after it;
    ``ends``: the lines that name another API's last event instead
    (:data:`STREAM_ENDS`), answered once the blank line after one is out.

    ``timings``: told the answer's prompt-token figures, once, from its
    ``timings`` (:func:`rolemesh.http.prompt_cache.prompt_timings` over its last
    two reads): a stream's when its ``[DONE]`` is in, else at the body's end."""

    def __init__(self, request: ProxiedRequest, ended: Callable[[bool], None], clock: Callable[[], float],
                 on_first: Optional[Callable[[], None]] = None,
                 watch_done: bool = False, timings: Optional[TimingsCallback] = None,
                 ends: Sequence[bytes] = (), usage_first: bool = False,
                 first_read: Optional[Callable[[bytes], bool]] = None) -> None:
        self._request = request
        self._first_read = first_read
        self._first_bytes = b""
        self._ended = ended
        self._clock = clock
        #: Told of the first read, once.
        self._on_first = on_first
        #: When the last read came (``clock``): what the idle deadline checks,
        #: instead of a timer moved on every event.
        self.last_read = clock()
        self.answered = False
        self._timings = timings
        #: The last read and the one before it (where the timings are).
        self._last = self._before = b""
        #: The last bytes written (for a [DONE] split across reads; the
        #: stream begins at a line start); None when not watching, or once answered.
        self._tail: Optional[bytes] = b"\n" if watch_done and not ends else None
        #: Another API's last-event lines, and the bytes kept to find one split by a read.
        self._ends = tuple(ends) if watch_done else ()
        self._end_tail = b"\n"
        #: Whether the last event has begun (its blank line ends the stream).
        self._final = False
        #: The prompt-token figures are in the first read's ``usage`` (Anthropic's stream).
        self._usage_first = usage_first and timings is not None

    def connectionMade(self) -> None:
        self._request.registerProducer(self.transport, True)  # type: ignore[arg-type]  # a TransportProxyProducer

    def dataReceived(self, data: bytes) -> None:
        if self._on_first is not None:
            first, self._on_first = self._on_first, None
            first()
        self.last_read = self._clock()
        self._request.write(data)
        if self._first_read is not None:
            self._first_bytes = (self._first_bytes + data)[:FIRST_READ_BYTES]
            if self._first_read(self._first_bytes) or len(self._first_bytes) >= FIRST_READ_BYTES:
                self._first_read, self._first_bytes = None, b""
        if self._usage_first:
            self._usage_first = False
            timings, self._timings = self._timings, None
            tell_timings(timings, anthropic_usage(data))  # type: ignore[arg-type]  # set: usage_first
        self._before, self._last = self._last, data
        tail = self._tail
        if tail is not None:
            end = data[-_DONE_LEN:] if len(data) >= _DONE_LEN else (tail + data)[-_DONE_LEN:]
            if end == _DONE_END:
                self._answered()
            else:
                self._tail = end
        elif self._ends and not self.answered:
            self._watch_end(data)

    def _answered(self) -> None:
        self.answered, self._tail = True, None
        if self._timings is not None:
            self._found_timings()

    def _watch_end(self, data: bytes) -> None:
        """Another API's stream: its last event's line, then the blank line
        that ends that event (a JSON ``data:`` line holds no raw newline)."""
        seen = self._end_tail + data
        if not self._final:
            found = -1
            for line in self._ends:
                at = seen.find(line)
                if at >= 0:
                    found = at + len(line)
                    break
            if found < 0:
                self._end_tail = seen[-40:]
                return
            self._final, seen = True, seen[found - 1:]
        if b"\n\n" in seen:
            self._answered()
        else:
            self._end_tail = seen[-1:]

    def _found_timings(self) -> None:
        """Tell ``timings`` what the last reads say (once; nothing if they have none)."""
        timings, self._timings = self._timings, None
        assert timings is not None
        last, before = self._last, self._before
        self._last = self._before = b""
        found = prompt_timings(last)
        if found is None and before:  # split by a read (rare), or in the read before [DONE]
            found = prompt_timings(before[-TIMINGS_SPAN:] + last)
        tell_timings(timings, found)

    def abort(self) -> None:
        """Close the upstream connection (the client went away, or a deadline passed)."""
        if self.transport is not None:
            self.transport.stopProducing()  # type: ignore[attr-defined]  # a TransportProxyProducer

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        try:
            self._request.unregisterProducer()
        except Exception:
            pass
        whole = isinstance(reason.value, (ResponseDone, PotentialDataLoss))  # Failure.check, cheaper
        if self._timings is not None:
            self._found_timings()
        self._ended(whole)


class Forward:
    """One request on its way to a child and back: its deadlines and how it ended.

    Two deadlines: ``timeout`` (``request_timeout_s``) bounds a non-streaming
    answer as a whole and a stream until its headers; ``idle_timeout``
    (``stream_idle_timeout_s``) bounds every silence once an answer has begun,
    so a child that hangs mid-answer cannot hold its slot for ever.
    """

    def __init__(self, proxy: "Proxy", request: ProxiedRequest, url: bytes, body: bytes, streaming: bool,
                 timeout: Optional[float], idle_timeout: Optional[float],
                 on_first_byte: Optional[Callable[[], None]], ended: Callable[[Union[str, Failure]], None],
                 on_timings: Optional[TimingsCallback] = None, shape: Optional["RequestShape"] = None) -> None:
        self.proxy = proxy
        #: The method, headers and last-event lines of a request that is not a
        #: JSON POST to an OpenAI route (None: one that is, nearly every one).
        self.shape = shape
        self.stream_ends: Sequence[bytes] = shape.stream_ends if shape is not None else ()
        self.request = request
        self.url = url
        self.body = body
        self.streaming = streaming
        self.timeout = timeout
        self.idle_timeout = idle_timeout
        self.on_first_byte = on_first_byte
        #: Told the prompt-token figures of a 2xx answer's ``timings``, if it has them.
        self.on_timings = on_timings
        #: Told how it ended, once: an outcome (COMPLETE, ...) or a Failure.
        self._ended = ended
        self.done = False
        self.relay: Optional[_Relay] = None
        self.event_stream = False
        self.body_ended = False
        self.cancelled = False
        #: Which deadline passed: None, "request" or "idle".
        self.expired: Optional[str] = None
        self._deadline: Optional[IDelayedCall] = None
        self._idle: Optional[IDelayedCall] = None
        self._upstream: Optional[Deferred] = None

    def start(self) -> "Forward":
        if self.timeout is not None:
            self._deadline = self.proxy.reactor.callLater(self.timeout, self._expire, "request")
        self._send(fresh=False)
        return self

    def _end(self, outcome: Union[str, Failure]) -> None:
        if not self.done:
            self.done = True
            self._ended(outcome)

    @property
    def answered(self) -> bool:
        """The client has its whole answer: a stream's ``data: [DONE]`` was
        written to it (only the chunked body's end may be missing)."""
        return self.relay is not None and self.relay.answered

    def cancel(self) -> None:
        """The client went away: close the upstream connection (llama-server
        stops generating); ends as CLIENT_GONE, or with CancelledError if the
        connection is still closing -- or as COMPLETE once the client had its
        whole answer (the openai SDK closes right after ``[DONE]``, without
        reading the end of the chunked body)."""
        if self.done:
            return
        self.cancelled = True
        self._abort_upstream()
        if self.answered:
            self._stop_timers()
            self._end(COMPLETE)
        else:
            self._end(Failure(defer.CancelledError()))

    def _send(self, fresh: bool) -> None:
        """Send the request: on a pooled connection, or (``fresh``) on one of
        its own -- the one retry, after a pooled connection turned out stale."""
        self._upstream = self.proxy._send(self.url, self.body, fresh=fresh, shape=self.shape)
        self._upstream.addCallbacks(self._got_response, self._send_failed, errbackArgs=(fresh,))
        self._upstream.addErrback(self._bug)

    # -- deadlines ---------------------------------------------------------------

    def _expire(self, which: str) -> None:
        if which == "request":
            self._deadline = None
        else:
            self._idle = None
        if self.done:
            return
        if which == "idle" and self.relay is not None:
            # The relay notes when each read came; the timer is moved here,
            # once per idle_timeout at most, not on every event.
            left = self.relay.last_read + self.idle_timeout - self.proxy.reactor.seconds()  # type: ignore[operator]
            if left > 0:
                self._idle = self.proxy.reactor.callLater(left, self._expire, "idle")
                return
        self.expired = which
        self._abort_upstream()

    def _first_data(self) -> None:
        if self.on_first_byte is not None:
            notify, self.on_first_byte = self.on_first_byte, None
            notify()

    def _stop_timers(self) -> None:
        for timer in (self._deadline, self._idle):
            if timer is not None and timer.active():
                timer.cancel()
        self._deadline = self._idle = None

    # -- the exchange -------------------------------------------------------------

    def _abort_upstream(self) -> None:
        if self.relay is not None:
            self.relay.abort()
        elif self._upstream is not None:
            self._upstream.cancel()  # also reaches a Deferred it is chained to

    def _send_failed(self, failure: Failure, fresh: bool) -> None:
        if (not fresh and _never_sent(failure) and not self.done and not self.cancelled
                and self.expired is None):
            # The pooled connection was stale (llama-server closes after each
            # stream): once more on a fresh connection of its own, leaving
            # other children's pooled connections alone.
            log.debug("retrying on a fresh connection after {error}", error=failure.value)
            self._send(fresh=True)
            return
        self._stop_timers()
        self._failed(failure)

    def _bug(self, failure: Failure) -> None:
        """A bug in handling the answer: logged, and the request still ends."""
        log.failure("proxy bookkeeping failed", failure)
        self._stop_timers()
        self._failed(failure)

    def _body_ended(self, whole: bool) -> None:
        self.body_ended = True
        self._stop_timers()
        try:
            self._relayed(whole)
        except Exception:  # a bug here must not leave the request waiting for ever
            self._bug(Failure())

    def _got_response(self, response: IResponse) -> None:
        request = self.request
        if self.streaming and self._deadline is not None:
            # A stream has begun: from now on only silences are bounded.
            if self._deadline.active():
                self._deadline.cancel()
            self._deadline = None
        request.setResponseCode(response.code, response.phrase)
        for name, values in response.headers.getAllRawHeaders():
            if name.lower() not in HOP_HEADERS:
                request.responseHeaders.setRawHeaders(name, values)
        self.event_stream = (response.headers.getRawHeaders(b"content-type") or [b""])[0].startswith(
            b"text/event-stream"
        )
        if self.event_stream:
            request.responseHeaders.removeHeader(b"content-length")
            request.setHeader(b"x-accel-buffering", b"no")
            request.setHeader(b"cache-control", b"no-cache")
        whole = getattr(response, "whole_body", None)  # ChildAgent's answers have it; others deliver
        body = whole() if whole is not None else None
        timings = self.on_timings if 200 <= response.code < 300 else None
        if body is not None:
            if timings is not None:
                found = prompt_timings(body)
                if found is None and self.shape is not None and self.shape.api == "anthropic":
                    found = anthropic_usage(body)
                tell_timings(timings, found)
            if body:
                self._first_data()
                request.write(body)
            self._body_ended(True)
            return
        self.relay = _Relay(request, self._body_ended, self.proxy.reactor.seconds,
                            self._first_data if self.on_first_byte is not None else None,
                            watch_done=self.event_stream,
                            timings=timings, ends=self.stream_ends,
                            usage_first=self.shape is not None and self.shape.api == "anthropic",
                            first_read=self.shape.first_read if self.shape is not None else None)
        response.deliverBody(self.relay)
        if self.idle_timeout is not None and not self.body_ended:
            # Not for an answer that came whole with its head (most non-streamed ones).
            self._idle = self.proxy.reactor.callLater(self.idle_timeout, self._expire, "idle")

    def _relayed(self, whole: bool) -> None:
        if self.done:
            return
        if whole or self.answered:  # after [DONE] the client needs nothing more of the child
            self._end(COMPLETE)
        elif self.proxy._client_gone(self.request):
            self._end(CLIENT_GONE)
        elif self.expired == "idle":
            silence = f"llama-server sent nothing for {self.idle_timeout:g}s (stream_idle_timeout_s)"
            self._end_cut_answer(silence)
            self._end(STALLED)
        elif self.event_stream and self.expired is None:
            self._end_cut_answer("llama-server closed the stream before it ended")
            self._end(STREAM_ERROR)
        else:
            self._end_cut_answer(None)
            self._end(TRUNCATED)

    def _end_cut_answer(self, why: Optional[str]) -> None:
        """A stream gets an SSE error event and ``[DONE]``; a body that broke
        off is ended by aborting the client's connection, so the client sees
        a cut answer, never a clean end of a partial one."""
        if self.event_stream and why is not None:
            self.request.write(sse_error_event(why, self.shape.api if self.shape is not None else "openai"))
        else:
            _abort_client(self.request)

    def _failed(self, failure: Failure) -> None:
        if self.done:
            return
        if self.expired == "request":
            what = "start its stream" if self.streaming else "answer"
            self._end(Failure(
                errors.ApiError(504, f"llama-server did not {what} within {self.timeout:g}s (request_timeout_s)",
                                "server_error", "upstream_timeout")
            ))
        elif failure.check(defer.CancelledError) or self.cancelled:
            # Agent fails a cancelled request with ResponseNeverReceived
            # ([CancelledError]), not CancelledError: still the client's doing.
            self._end(CLIENT_GONE)
        elif failure.check(ConnectError) or _never_sent(failure):
            self._end(Failure(UpstreamUnreachable(_describe(failure))))
        else:
            self._end(Failure(errors.upstream_error(f"llama-server failed the request: {_describe(failure)}")))


def _abort_client(request: ProxiedRequest) -> None:
    transport = getattr(getattr(request, "channel", None), "transport", None) or getattr(request, "transport", None)
    abort = getattr(transport, "abortConnection", None)
    if abort is not None:
        abort()
    else:
        request.loseConnection()


class Proxy(UsesReactor[IHTTPClientReactor]):
    """Sends requests to children over a persistent pool and relays answers."""

    def __init__(self, reactor: Optional[IHTTPClientReactor] = None, max_per_host: int = 4,
                 agent: Optional[ChildRequester] = None, fresh_agent: Optional[ChildRequester] = None,
                 coalesce_s: float = 0.0) -> None:
        self._reactor = reactor
        self._max_per_host = max_per_host
        self._coalesce_s = coalesce_s
        self._agent = agent
        self._fresh_agent = fresh_agent if fresh_agent is not None else agent
        self._pool: Optional[ChildAgent] = None

    @property
    def agent(self) -> ChildRequester:
        if self._agent is None:
            self._pool = ChildAgent(self.reactor, persistent=True, max_per_host=self._max_per_host,
                                    coalesce_s=self._coalesce_s)
            self._agent = self._pool
        return self._agent

    @property
    def fresh_agent(self) -> ChildRequester:
        """Requests on a connection of their own (the retry after a stale one)."""
        if self._fresh_agent is None:
            self._fresh_agent = ChildAgent(self.reactor, persistent=False, coalesce_s=self._coalesce_s)
        return self._fresh_agent

    def close(self) -> "Deferred[None]":
        """Close pooled connections (on stop)."""
        if self._pool is None:
            return defer.succeed(None)
        return self._pool.closeCachedConnections()

    def _send(self, url: bytes, body: bytes, fresh: bool, shape: Optional[RequestShape] = None
              ) -> "Deferred[IResponse]":
        agent = self.fresh_agent if fresh else self.agent
        if shape is None:
            return agent.request(b"POST", url, _REQUEST_HEADERS, BytesProducer(body))
        return agent.request(shape.method, url, shape.headers or _REQUEST_HEADERS,
                             BytesProducer(body) if body or shape.method not in (b"GET", b"HEAD") else None)

    def forward(
        self,
        request: ProxiedRequest,
        base_url: str,
        path: str,
        body: bytes,
        streaming: bool,
        timeout: Optional[float] = None,
        on_first_byte: Optional[Callable[[], None]] = None,
        idle_timeout: Optional[float] = None,
        on_timings: Optional[TimingsCallback] = None,
        shape: Optional[RequestShape] = None,
    ) -> "Deferred[str]":
        """Relay ``body`` to ``base_url + path`` and the answer to ``request``.

        Fires with how the relay ended: ``COMPLETE``; ``CLIENT_GONE``;
        ``STREAM_ERROR`` (the stream broke off: an SSE error event was sent);
        ``TRUNCATED`` (a body broke off after its headers went out: the
        client's connection was aborted); ``STALLED`` (the answer went silent
        for ``idle_timeout``: ended as either of the previous two, and the
        child deserves a probe).  Errbacks with an ApiError (502/504) when
        nothing was sent to the client yet.  Cancelling it closes the
        upstream connection.  ``on_timings`` is told ``(cache_n, prompt_n)``
        of a 2xx answer's ``timings`` (where llama-server reports them),
        before the outcome.
        """
        result: "Deferred[str]" = Deferred(lambda _: exchange.cancel())
        exchange = self.start(request, base_url, path, body, streaming, timeout, on_first_byte, idle_timeout,
                              ended=lambda outcome: result.callback(outcome),  # a Failure errbacks
                              on_timings=on_timings, shape=shape)
        return result

    def start(
        self,
        request: ProxiedRequest,
        base_url: str,
        path: str,
        body: bytes,
        streaming: bool,
        timeout: Optional[float],
        on_first_byte: Optional[Callable[[], None]],
        idle_timeout: Optional[float],
        ended: Callable[[Union[str, Failure]], None],
        on_timings: Optional[TimingsCallback] = None,
        shape: Optional[RequestShape] = None,
    ) -> "Forward":
        """:meth:`forward` without its Deferred (the request path's own,
        which runs for every request): ``ended`` is told the outcome or the
        Failure once, maybe before this returns; ``cancel()`` the returned
        exchange when the client goes away."""
        url = (base_url + path).encode("ascii")
        return Forward(self, request, url, body, streaming, timeout, idle_timeout, on_first_byte, ended,
                       on_timings, shape).start()

    @staticmethod
    def _client_gone(request: ProxiedRequest) -> bool:
        return client_disconnected(request) or bool(getattr(request, "finished", False))


def _describe(failure: Failure) -> str:
    reasons = getattr(failure.value, "reasons", None)
    if reasons:
        return "; ".join(r.getErrorMessage() for r in reasons)
    return failure.getErrorMessage() or getattr(failure.type, "__name__", "error")
