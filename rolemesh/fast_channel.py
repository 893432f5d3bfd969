"""The client connection: the proxied routes without twisted.web's per-request cost.

twisted.web spends more CPU on each request than the agent's own work on it:
a line-by-line header parser, a ``Request`` with dozens of attributes, a
``Content-Type`` parse through ``email.headerregistry``, ``Headers``
normalisation, Klein's werkzeug routing.  For the three routes every
inference request takes (``POST /v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``), :class:`FastChannel` parses the request in one pass and
hands a :class:`FastRequest` -- the slice of ``IRequest`` the proxy route
uses -- to the route directly.  So it does for the ``GET`` routes clients
ask between them (``/v1/models``, ``/health``, ``/ready``): a connection an
OpenAI client pools, or a load balancer probes on, stays on the fast path.

Anything else goes to twisted.web unchanged: the first request on a
connection that is not a plain HTTP/1.1 request for one of those routes
with a ``Content-Length`` body within the limit, or no body for a ``GET``
(another route or method, HTTP/1.0, chunked or ``Expect: 100-continue``
bodies, a request head that did not arrive in one read, a malformed one)
hands the connection, with the bytes
read so far, to a regular :class:`~rolemesh.listener._GuardedChannel` for the
rest of its life.  So every error twisted.web answers today (400, 413, 405,
404, 408-by-abort) is still answered by the same code, and the fast path only
ever sees requests it can serve exactly as the slow path would.

What the slow path guarantees holds here too: an absolute deadline for
receiving each request (``request_read_timeout_s``; also closing connections
idle for ``idle_timeout_s``), the body size limit, the connection cap (in the
site), backpressure (the upstream transport is the client transport's
producer), and a client that disconnects cancels its request.
"""

from __future__ import annotations

import time
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Callable, Dict, ItemsView, List, Optional, Tuple

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.interfaces import IAddress, IDelayedCall, IProducer, IReactorTime
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http import RESPONSES, datetimeToString

from rolemesh.twisted_compat import write_now

if TYPE_CHECKING:  # the listener builds the channels: it imports this module
    from rolemesh.listener import GuardedSite

log = Logger()

#: A route of the fast path: called with the request, fires with the body to
#: send (bytes) or None once the answer is complete; never fails for a
#: reason the client caused (the route turns those into answers itself).
FastRoute = Callable[["FastRequest"], "Deferred[Optional[bytes]]"]

#: Longest request head the fast path parses (twisted.web's own limit is
#: 16 KiB; a longer head goes to it and gets its answer).
MAX_HEAD = 16384
_HEAD_END = b"\r\n\r\n"


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
        self._producer: Optional[IProducer] = None

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
        self._producer = producer
        self.transport.registerProducer(producer, streaming)

    def unregisterProducer(self) -> None:  # noqa: N802 - IRequest's name
        if self._producer is not None:
            self._producer = None
            self.transport.unregisterProducer()

    def loseConnection(self) -> None:  # noqa: N802 - IRequest's name
        self.transport.loseConnection()

    def connection_lost(self, reason: Failure) -> None:
        """The client went away before the answer was finished."""
        self.disconnected = True
        if self._producer is not None:
            self._producer = None
        waiters, self._finish_waiters = self._finish_waiters, []
        for d in waiters:
            d.errback(reason)


def parse_request_head(head: bytes) -> Optional[Tuple[bytes, bytes, Dict[bytes, bytes]]]:
    """``(method, path, headers)`` of an HTTP/1.1 request head the fast path
    can serve, else None (pure: the caller hands such a request to
    twisted.web, which answers whatever is wrong with it).

    Headers are ``{lower-case name: value}``; a repeated header, a folded
    line, a malformed line or a non-ASCII name makes it None.
    """
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[2] != b"HTTP/1.1":
        return None
    headers: Dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or not name.isascii():
            return None
        key = name.lower()
        if key in headers:
            return None
        headers[key] = value.strip()
    return parts[0], parts[1], headers


def fast_body_length(headers: Dict[bytes, bytes], limit: Optional[int], method: bytes = b"POST") -> Optional[int]:
    """The body length of a request the fast path can read, else None: a
    plain ``Content-Length`` within ``limit`` (a ``GET`` may send none: no
    body), no transfer coding, no ``Expect``, a UTF-8 ``Host``."""
    if b"transfer-encoding" in headers or b"expect" in headers or b"upgrade" in headers:
        return None
    raw = headers.get(b"content-length")
    if raw is None and method == b"GET":
        raw = b"0"
    if raw is None or not raw.isdigit() or len(raw) > 18:
        return None
    length = int(raw)
    if limit is not None and length > limit:
        return None
    host = headers.get(b"host")
    if host is not None:
        try:
            host.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return length


class FastChannel(Protocol):
    """A client connection that serves ``routes`` (``(method, path)`` ->
    route) itself and hands anything else, for good, to the twisted.web
    channel ``make_fallback()`` builds."""

    def __init__(self, site: "GuardedSite", routes: Dict[Tuple[bytes, bytes], FastRoute],
                 make_fallback: Callable[[], Protocol]) -> None:
        self.site = site
        self._routes = routes
        self._make_fallback = make_fallback
        self._reactor = site.reactor
        self._buffer = b""
        #: While a body arrives in several reads: the bytes the request needs
        #: in all (0: not waiting), and its reads so far.
        self._need = 0
        self._parts: List[bytes] = []
        self._size = 0
        #: The request being answered (at most one: pipelined requests wait in _buffer).
        self._current: Optional[FastRequest] = None
        self._current_result: Optional[Deferred] = None
        #: The twisted.web channel the connection was handed to, if it was.
        self._fallback: Optional[Protocol] = None
        self._paused = False
        self._closed = False
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
        self._waiting_since = self._reactor.seconds()
        limit = self._limit_s
        if limit is not None and self._deadline is None:
            self._deadline = self._reactor.callLater(limit, self._check_deadline)

    def _check_deadline(self) -> None:
        self._deadline = None
        if self._waiting_since is None or self._closed or self._fallback is not None:
            return
        limit = self._limit_s or 0.0
        left = self._waiting_since + limit - self._reactor.seconds()
        if left > 0:
            self._deadline = self._reactor.callLater(left, self._check_deadline)
            return
        if self._buffer or self._need:
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
        self._wait_for_request()

    def date(self) -> bytes:
        """The ``Date`` header's value, computed once a second."""
        return self.site.http_date()

    def dataReceived(self, data: bytes) -> None:  # noqa: N802 - Twisted's name
        if self._fallback is not None:
            self._fallback.dataReceived(data)
            return
        if self._need:  # a body on its way in several reads: joined once, when whole
            self._parts.append(data)
            self._size += len(data)
            if self._size < self._need:
                return
            self._buffer, self._parts, self._need = b"".join(self._parts), [], 0
        else:
            self._buffer = self._buffer + data if self._buffer else data
        if self._current is None:
            self._next_request()
        elif not self._paused:
            # A pipelined request: wait until the current answer is done,
            # as twisted.web does.
            self._paused = True
            self.transport.pauseProducing()  # type: ignore[union-attr]

    def _next_request(self) -> None:
        buffer = self._buffer
        end = buffer.find(_HEAD_END)
        if end < 0:
            if buffer:
                self._hand_off()
            return
        parsed = parse_request_head(buffer[:end]) if end <= MAX_HEAD else None
        if parsed is None:
            self._hand_off()
            return
        method, path, headers = parsed
        route = self._routes.get((method, path))
        length = fast_body_length(headers, self.site.max_body_bytes, method) if route is not None else None
        if route is None or length is None:
            self._hand_off()
            return
        start = end + 4
        if len(buffer) - start < length:  # the rest of the body is on its way; the deadline runs
            self._need, self._parts, self._size, self._buffer = start + length, [buffer], len(buffer), b""
            return
        self._buffer = buffer[start + length:]
        self._waiting_since = None
        request = FastRequest(self, method, path, headers, buffer[start:start + length])
        connection = headers.get(b"connection")
        if connection is not None and connection.lower() == b"close":
            request._close_after = True
        self._current = request
        self._answer(request, route)

    def _answer(self, request: FastRequest, route: FastRoute) -> None:
        try:
            result = route(request)
        except Exception:
            result = defer.fail()
        self._current_result = result
        result.addCallbacks(self._answered, self._route_failed, callbackArgs=(request,), errbackArgs=(request,))

    def _answered(self, body: Optional[bytes], request: FastRequest) -> None:
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
        if request is not self._current:
            return
        self._current = None
        if request._close_after:
            self.transport.loseConnection()  # type: ignore[union-attr]
            return
        self._wait_for_request()
        if self._paused:
            self._paused = False
            self.transport.resumeProducing()  # type: ignore[union-attr]
        if self._buffer:
            self._next_request()

    def _hand_off(self) -> None:
        """Give the connection, and what it has sent so far, to twisted.web."""
        self._cancel_deadline()
        self._waiting_since = None
        fallback = self._fallback = self._make_fallback()
        fallback.makeConnection(self.transport)
        data, self._buffer = self._buffer, b""
        if self._paused:
            self._paused = False
            self.transport.resumeProducing()  # type: ignore[union-attr]
        fallback.dataReceived(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:  # noqa: N802 - Twisted's name
        self._closed = True
        self._cancel_deadline()
        if self._fallback is not None:
            self._fallback.connectionLost(reason)
            return
        self.site.open_connections -= 1
        request, self._current = self._current, None
        if request is not None and not request.finished:
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


__all__ = ["FastChannel", "FastRequest", "FastRoute", "HttpDate", "ResponseHeaders", "fast_body_length",
           "parse_request_head"]
