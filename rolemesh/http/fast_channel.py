"""The client connection: one strict parser for every request, and the
proxied routes without twisted.web's per-request cost.

Every byte a client sends is parsed by llhttp (``httptools``, what uvicorn
uses: Node.js's parser, maintained and fuzzed by others), and every head is
checked against :mod:`rolemesh.http.request_head` and the API's
:class:`~rolemesh.base.interfaces.HeadPolicy` before a byte of its body is kept:
malformed or ambiguous framing is a 400 (or 431, 417, 501, 505) and a
close; a request without a valid key, for no route, or with a body over the
limit is answered (401, 404, 413) from its head, and when a body follows,
it is read and dropped within bounds (:mod:`rolemesh.http.lingering`), then the
connection closes.  So no unauthenticated body is held, and no two parsers
can disagree on where a request ends.

What passes is served in order, one answer at a time, in a loop (never by
recursion):

- the routes every inference request takes (``POST /v1/chat/completions``,
  ``/v1/completions``, ``/v1/embeddings``, ...), the ``GET`` routes clients
  ask between them (``/v1/models``, ``/health``, ``/ready``) and the
  scrapers' ``/metrics`` are handed a
  :class:`FastRequest`, the slice of ``IRequest`` the proxy uses, at once;
- anything else (other routes, a query string, HTTP/1.0, or every request
  with ``fast_path: false``) is written again, canonically (one
  ``Content-Length``, no transfer coding, no expectation), to a twisted.web
  ``HTTPChannel`` behind this one, so Klein answers it; that channel never
  sees the client's own bytes.

Bounded by construction: the channel is its transport's producer (a client
that does not read its answers stops being read, and so does the upstream
relay feeding it); parsed requests waiting for their turn are capped in
number and bytes (reading pauses above that); each request must arrive
whole within ``request_read_timeout_s`` of the connection's wait for it
beginning (``idle_timeout_s`` for an idle keep-alive connection), whichever
path serves it.

The parsing and the head checks are :mod:`rolemesh.http.request_reader`
(:class:`FastChannel`'s base), the twisted.web side :mod:`rolemesh.http.bridge`;
this module answers, in order, and writes the fast path's answers.
"""

from __future__ import annotations

import time
from http import HTTPStatus
from typing import (
    Any,
    Callable,
    Dict,
    ItemsView,
    List,
    Optional,
    Tuple,
)

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.interfaces import (
    IAddress,
    IDelayedCall,
    IProducer,
    IPushProducer,
    IReactorTime,
)
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http import RESPONSES, datetimeToString
from zope.interface import implementer

from rolemesh.base.errors import answer_headers
from rolemesh.base.interfaces import ChannelSite
from rolemesh.event_loop.twisted_compat import write_now
from rolemesh.http.bridge import BridgeChannel, BridgeTransport, canonical_copy
from rolemesh.http.request_reader import (
    MAX_QUEUED,
    QUEUE_FULL,
    WRITES_BLOCKED,
    Incoming,
    RequestReader,
)

log = Logger(namespace="rolemesh.fast_channel")

#: A route of the fast path: called with the request, fires with the body to
#: send (bytes) or None once the answer is complete; never fails for a
#: reason the client caused (the route turns those into answers itself).
FastRoute = Callable[["FastRequest"], "Deferred[Optional[bytes]]"]

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _phrase(code: int, _cache: Dict[int, bytes] = {}) -> bytes:  # noqa: B006 - a deliberate cache
    """The reason phrase of ``code`` (twisted.web's table lacks some, such as 429)."""
    phrase = _cache.get(code)
    if phrase is None:
        phrase = RESPONSES.get(code)
        if phrase is None:
            try:
                phrase = HTTPStatus(code).phrase.encode("ascii")
            except ValueError:
                phrase = b"Unknown Status"
        _cache[code] = phrase
    return phrase


def _canonical(name: bytes, _cache: Dict[bytes, bytes] = {}) -> bytes:  # noqa: B006 - a deliberate cache
    """``content-type`` -> ``Content-Type``, as twisted.web writes names."""
    canonical = _cache.get(name)
    if canonical is None:
        canonical = b"-".join(part.capitalize() for part in name.split(b"-"))
        if len(_cache) < 256:
            _cache[name] = canonical
    return canonical


def _one_line(text: bytes) -> bytes:
    if b"\n" in text or b"\r" in text:
        return text.replace(b"\r\n", b" ").replace(b"\r", b" ").replace(b"\n", b" ")
    return text


class ResponseHeaders:
    """The response headers: the three methods of ``Headers`` the proxy uses,
    kept as ``{lower-case name: [values]}``."""

    __slots__ = ("_headers",)

    def __init__(self) -> None:
        self._headers: Dict[bytes, List[bytes]] = {}

    def setRawHeaders(self, name: bytes, values: List[bytes]) -> None:  # noqa: N802 - Headers' name
        # A line break in a name or value would end the head early (response
        # splitting): replaced by a space, as twisted.web's Headers do.  (The
        # checks are inline for the usual header, one value without one.)
        if len(values) == 1:
            value = values[0]
            if not (b"\n" in value or b"\r" in value or b"\n" in name or b"\r" in name):
                self._headers[name.lower()] = [value]
                return
        self._headers[_one_line(name).lower()] = [_one_line(v) for v in values]

    def removeHeader(self, name: bytes) -> None:  # noqa: N802 - Headers' name
        self._headers.pop(name.lower(), None)

    def getRawHeaders(self, name: bytes, default: Optional[List[bytes]] = None) -> Optional[List[bytes]]:  # noqa: N802
        return self._headers.get(name.lower(), default)

    def hasHeader(self, name: bytes) -> bool:  # noqa: N802 - Headers' name
        return name.lower() in self._headers

    def items(self) -> ItemsView[bytes, List[bytes]]:
        return self._headers.items()


class _Body:
    """``request.content``: the body, already whole in memory."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    def read(self) -> bytes:
        return self._data

    def seek(self, offset: int, whence: int = 0) -> int:
        return 0


class FastRequest:
    """One request on a :class:`FastChannel`: the part of twisted.web's
    ``IRequest`` that the proxy route and the relay use."""

    body_too_large = False
    #: The head policy (the API key) passed it already: the route need not ask again.
    key_checked = False
    startedWriting = False
    finished = False
    disconnected = False
    _chunked = False
    _close_after = False

    def __init__(self, channel: "FastChannel", method: bytes, path: bytes,
                 headers: Dict[bytes, bytes], body: bytes) -> None:
        self.channel = channel
        #: The client's TCP or TLS transport: an ITransport and an IConsumer
        #: (and abortConnection), which no one Twisted interface declares.
        self.transport: Any = channel.transport
        self.method = method
        self.path = self.uri = path
        self._headers = headers
        self.content = _Body(body)
        self.code = 200
        self.code_message = b"OK"
        self.responseHeaders = ResponseHeaders()
        self._finish_waiters: List[Deferred] = []

    # -- the request ---------------------------------------------------------

    def getHeader(self, name: bytes) -> Optional[bytes]:  # noqa: N802 - IRequest's name
        return self._headers.get(name.lower())

    def getClientAddress(self) -> IAddress:  # noqa: N802 - IRequest's name
        return self.transport.getPeer()

    # -- the response ---------------------------------------------------------

    def setResponseCode(self, code: int, message: Optional[bytes] = None) -> None:  # noqa: N802 - IRequest's name
        self.code = code
        self.code_message = message or _phrase(code)

    def setHeader(self, name: bytes, value: bytes) -> None:  # noqa: N802 - IRequest's name
        self.responseHeaders.setRawHeaders(name, [value])

    def _head(self, body_length: Optional[int]) -> bytes:
        fields = self.responseHeaders._headers  # this module's own class: its dict, not its methods
        if b"content-length" not in fields:
            if body_length is not None:
                fields[b"content-length"] = [b"%d" % body_length]
            elif self.code not in (204, 304):
                self._chunked = True
                fields[b"transfer-encoding"] = [b"chunked"]
        if self._close_after:
            fields[b"connection"] = [b"close"]
        lines = [b"HTTP/1.1 %d %s\r\n" % (self.code, self.code_message), b"Date: ", self.channel.date(), b"\r\n"]
        for name, values in fields.items():
            canonical = _canonical(name)
            for value in values:
                lines += (canonical, b": ", value, b"\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    def write(self, data: bytes) -> None:
        if self.finished or self.disconnected:
            return
        transport = self.transport
        if not self.startedWriting:
            self.startedWriting = True
            head = self._head(None)
            if self._chunked:
                write_now(transport, head + (b"%x\r\n%s\r\n" % (len(data), data) if data else b""))
            else:
                write_now(transport, head + data)
        elif not data:
            return
        elif self._chunked:
            write_now(transport, b"%x\r\n%s\r\n" % (len(data), data))
        else:
            write_now(transport, data)

    def finish(self, body: Optional[bytes] = None) -> None:
        """End the answer (with ``body`` as all of it, when nothing was written yet)."""
        if self.finished or self.disconnected:
            return
        if not self.startedWriting:
            self.startedWriting = True
            data = body or b""
            write_now(self.transport, self._head(len(data)) + data)
        elif self._chunked:
            write_now(self.transport, b"0\r\n\r\n")
        self.finished = True
        waiters, self._finish_waiters = self._finish_waiters, []
        for d in waiters:
            d.callback(None)
        self.channel.request_done(self)

    def notifyFinish(self) -> "Deferred[None]":  # noqa: N802 - IRequest's name
        d: Deferred = Deferred()
        if self.finished:
            d.callback(None)
        elif self.disconnected:
            d.errback(Failure(ConnectionLost("the client closed the connection")))
        else:
            self._finish_waiters.append(d)
        return d

    def registerProducer(self, producer: IProducer, streaming: bool) -> None:  # noqa: N802 - IRequest's name
        self.channel.register_answer_producer(producer)

    def unregisterProducer(self) -> None:  # noqa: N802 - IRequest's name
        self.channel.register_answer_producer(None)

    def loseConnection(self) -> None:  # noqa: N802 - IRequest's name
        self.channel.close()

    def connection_lost(self, reason: Failure) -> None:
        """The client went away before the answer was finished."""
        self.disconnected = True
        waiters, self._finish_waiters = self._finish_waiters, []
        for d in waiters:
            d.errback(reason)


@implementer(IPushProducer)
class FastChannel(RequestReader):
    """A client connection: parses every request strictly (its base,
    :class:`~rolemesh.http.request_reader.RequestReader`), serves ``routes``
    (``(method, path)`` -> route) itself and the rest through the
    twisted.web channel ``make_bridge()`` builds."""

    def __init__(self, site: ChannelSite, routes: Dict[Tuple[bytes, bytes], FastRoute],
                 make_bridge: Callable[[], BridgeChannel]) -> None:
        super().__init__(site)
        self.site = site
        self._routes = routes
        self._make_bridge = make_bridge
        self._bridge: Optional[BridgeChannel] = None
        #: The request being answered (a FastRequest, or the Incoming given to twisted.web).
        self._current: Optional[object] = None
        self._current_result: Optional[Deferred] = None
        #: Close once the current answer is done (the last request was refused or said close).
        self._last = False
        self._pumping = False
        self._writes_blocked = False
        #: What feeds the current answer (the relay's upstream): paused while the client does not read.
        self._answer_producer: Optional[IProducer] = None
        #: The connection is gone (connectionLost was called).
        self.lost = False
        #: Since when the connection waits for (the rest of) a request; None while answering.
        self._waiting_since: Optional[float] = None
        self._deadline: Optional[IDelayedCall] = None
        #: How long the connection may wait for (the rest of) a request.
        self._limit_s = self._limit()

    # -- deadlines: one timer per connection, moved only when it fires --------

    def _limit(self) -> Optional[float]:
        limits = [s for s in (self.site.request_read_timeout, self.site.timeOut) if s]
        return min(limits) if limits else None

    def _wait_for_request(self) -> None:
        if self._waiting_since is not None or self._linger is not None:
            return
        self._waiting_since = self._reactor.seconds()
        limit = self._limit_s
        if limit is not None and self._deadline is None:
            self._deadline = self._reactor.callLater(limit, self._check_deadline)

    def _check_deadline(self) -> None:
        self._deadline = None
        if self._waiting_since is None or self._closed:
            return
        limit = self._limit_s or 0.0
        left = self._waiting_since + limit - self._reactor.seconds()
        if left > 0:
            self._deadline = self._reactor.callLater(left, self._check_deadline)
            return
        if self._queue:
            log.info("closing a client connection that did not read its answers within {seconds:g}s",
                     seconds=limit)
        elif self._head_size or self._size:
            log.info("closing a client connection that did not send its request within {seconds:g}s",
                     seconds=limit)
        self.transport.abortConnection()  # type: ignore[union-attr]

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            if self._deadline.active():
                self._deadline.cancel()
            self._deadline = None

    # -- the connection -------------------------------------------------------

    def connectionMade(self) -> None:  # noqa: N802 - Twisted's name
        self.transport.registerProducer(self, True)  # type: ignore[union-attr]
        self._wait_for_request()

    def date(self) -> bytes:
        """The ``Date`` header's value, computed once a second."""
        return self.site.http_date()

    # -- answering, in order ----------------------------------------------------

    def _pump(self) -> None:
        """Answer queued requests in order while nothing is being answered
        and the client reads: a loop, however many are pipelined, whether
        they are answered at once or later."""
        if self._pumping:
            return
        self._pumping = True
        try:
            queue = self._queue
            while self._current is None and queue and not self._writes_blocked and not self._closed:
                incoming = queue.popleft()
                self._queued_bytes -= incoming.size
                self._waiting_since = None
                self._serve(incoming)
        finally:
            self._pumping = False
        if self._read_paused & QUEUE_FULL and len(self._queue) <= MAX_QUEUED // 2:
            self._resume_reading(QUEUE_FULL)
        if self._current is None and not self._closed:
            self._wait_for_request()  # for the next request, or for the client to read its answers
            if self._continue_owed and not self._queue:
                self._continue_owed = False
                self.transport.write(_CONTINUE)  # type: ignore[union-attr]

    def _serve(self, incoming: Incoming) -> None:
        self._last = not incoming.keep_alive
        refusal = incoming.refusal
        if refusal is not None:
            request = FastRequest(self, incoming.method, incoming.target, incoming.headers, b"")
            request._close_after = self._last
            self._current = request
            if b"origin" in incoming.headers:
                self._allow_origin(request, incoming.headers[b"origin"])
            request.setResponseCode(refusal.status)
            request.setHeader(b"content-type", b"application/json")
            for name, value in answer_headers(refusal):
                request.setHeader(name, value)
            request.finish(refusal.json(incoming.target))
            return
        route = self._routes.get((incoming.method, incoming.target)) if incoming.version == "1.1" else None
        if route is None:
            self._bridge_request(incoming)
            return
        request = FastRequest(self, incoming.method, incoming.target, incoming.headers, incoming.body)
        request._close_after = self._last
        if b"origin" in incoming.headers:  # a browser's request (CORS)
            self._allow_origin(request, incoming.headers[b"origin"])
        request.key_checked = self._policy is not None  # it passed refuse_head
        self._current = request
        try:
            result = route(request)
        except Exception:
            result = defer.fail()
        self._current_result = result
        result.addCallbacks(self._route_succeeded, self._route_failed, callbackArgs=(request,), errbackArgs=(request,))

    def _allow_origin(self, request: FastRequest, origin: bytes) -> None:
        """``Access-Control-Allow-Origin`` for an origin the policy allows."""
        allowed = self._policy.cors_origin(origin) if self._policy is not None else None
        if allowed is not None:
            request.setHeader(b"access-control-allow-origin", allowed)
            request.setHeader(b"vary", b"Origin")

    def _route_succeeded(self, body: Optional[bytes], request: FastRequest) -> None:
        if request is self._current:
            self._current_result = None
        if not request.finished and not request.disconnected:
            if body is not None and request.startedWriting:
                request.write(body)
                body = None
            request.finish(body)

    def _route_failed(self, failure: Failure, request: FastRequest) -> None:
        if request is self._current:
            self._current_result = None
        if request.disconnected or failure.check(defer.CancelledError):
            return
        log.failure("unexpected error answering {path}", failure, path=request.path)
        self.transport.abortConnection()  # type: ignore[union-attr]

    def request_done(self, request: FastRequest) -> None:
        """``request`` finished its answer: the next request may begin."""
        if request is self._current:
            self._answer_done()

    def _answer_done(self) -> None:
        self._current = None
        self._answer_producer = None
        if self._last:
            if self._linger is not None:  # its body still comes: closed when that ends
                self._linger_closes = True
                return
            self.close()
            return
        self._pump()

    def close(self) -> None:
        """Close once what is written is sent (the transport lets go of
        this producer first: a TLS transport would wait for it)."""
        if not self._closed:
            self._closed = True
            self._cancel_deadline()
            self.transport.unregisterProducer()  # type: ignore[union-attr]
            self.transport.loseConnection()  # type: ignore[union-attr]

    # -- twisted.web, for the rest --------------------------------------------

    def _bridge_request(self, incoming: Incoming) -> None:
        """Hand ``incoming`` to twisted.web, written again canonically."""
        bridge = self._bridge
        if bridge is None:
            bridge = self._bridge = self._make_bridge()
            bridge.owner = self
            bridge.makeConnection(BridgeTransport(self, self.transport))  # type: ignore[arg-type]
        self._current = incoming
        bridge.dataReceived(canonical_copy(incoming))

    def bridged_done(self) -> None:
        """twisted.web finished answering the request it was given."""
        if isinstance(self._current, Incoming):
            self._answer_done()

    # -- flow control: the transport's producer ---------------------------------

    def register_answer_producer(self, producer: Optional[IProducer]) -> None:
        """What writes the current answer: paused while the client does not read."""
        self._answer_producer = producer
        if producer is not None and self._writes_blocked:
            producer.pauseProducing()  # type: ignore[attr-defined]

    def pauseProducing(self) -> None:  # noqa: N802 - IPushProducer's name
        """The client's send buffer is full: stop reading it and stop what feeds the answer."""
        self._writes_blocked = True
        self._pause_reading(WRITES_BLOCKED)
        if self._answer_producer is not None:
            self._answer_producer.pauseProducing()  # type: ignore[attr-defined]
        if self._bridge is not None and isinstance(self._current, Incoming):
            self._bridge.pauseProducing()

    def resumeProducing(self) -> None:  # noqa: N802 - IPushProducer's name
        self._writes_blocked = False
        self._resume_reading(WRITES_BLOCKED)
        if self._answer_producer is not None:
            self._answer_producer.resumeProducing()  # type: ignore[attr-defined]
        if self._bridge is not None and isinstance(self._current, Incoming):
            self._bridge.resumeProducing()
        self._pump()

    def stopProducing(self) -> None:  # noqa: N802 - IPushProducer's name
        if self._answer_producer is not None:
            self._answer_producer.stopProducing()

    def connectionLost(self, reason: Failure = connectionDone) -> None:  # noqa: N802 - Twisted's name
        if self.lost:
            return
        self.lost = True
        self._closed = True
        self._stopped = True
        self._cancel_deadline()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        self.site.open_connections -= 1
        self._queue.clear()
        if self._bridge is not None:
            self._bridge.connectionLost(reason)
        request, self._current = self._current, None
        if isinstance(request, FastRequest) and not request.finished:
            request.connection_lost(reason if reason.check(ConnectionLost) else
                                    Failure(ConnectionLost(str(reason.value) if not reason.check(ConnectionDone)
                                                           else "the client closed the connection")))
            result, self._current_result = self._current_result, None
            if result is not None:
                result.cancel()  # as Klein does: the route's work stops


class HttpDate:
    """The ``Date`` header's value, formatted once per second of ``clock``."""

    def __init__(self, clock: IReactorTime) -> None:
        self._clock = clock
        self._second = -1
        self._value = b""

    def __call__(self) -> bytes:
        second = int(self._clock.seconds())
        if second != self._second:
            self._second = second
            self._value = datetimeToString(second if second > 0 else time.time())
        return self._value


__all__ = ["FastChannel", "FastRequest", "FastRoute", "HttpDate", "ResponseHeaders"]
