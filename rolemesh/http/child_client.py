"""A lean HTTP/1.1 client for the agent's own llama-server children: the
requests the proxy relays (probes, telemetry and the dispatcher use
:mod:`rolemesh.http.control_client`).

``twisted.web.client.Agent`` is general (any server, TLS, redirects, a
request and a response state machine of several objects, a pool keyed by
endpoint); per 1-token request it cost about as much CPU as the rest of the
agent's request path together.  Children are always plain HTTP on a literal
address the agent chose, and the proxy needs only this: POST a body, get
status and headers, then the body as it arrives, with the upstream socket as
the downstream's push producer.  :class:`ChildAgent` does that as an
``IAgent``, so the proxy (and its tests' fake agents) keep one interface:

* the request goes out in one ``write`` (request line, headers and body);
* the answer's head is parsed in one pass; a chunked body is decoded per
  segment received, so the several SSE events one ``recv`` holds reach the
  body protocol as one ``dataReceived``;
* connections are kept per child (``max_per_host`` idle ones) and reused
  while the child keeps them open; one that carried a chunked (streamed)
  answer is closed instead, since llama-server closes its side after every
  stream anyway (a request that still fails before any byte of an answer,
  on a connection the child closed meanwhile, is retried by the proxy on a
  fresh connection, once).

It reads strictly (RFC 9110, 9112): CRLF lines of token names and text
values, one Content-Length of digits (repeated only as the same number), a
Transfer-Encoding of ``chunked`` alone and never with a length, chunk sizes
of hex digits; anything else fails the answer (the proxy's 502
upstream_error).  A HEAD answer has no body.  A connection goes back to the
pool only once the whole answer was read and the whole request written: a
child that answered early must not read the next request as this one's rest.

Failures look like ``Agent``'s, which the proxy classifies:
``ResponseNeverReceived`` when the connection closed before any byte of an
answer, ``ResponseFailed`` when it closed mid-answer, the endpoint's
``ConnectError`` when the child refused, ``CancelledError`` when cancelled;
a body ends with ``ResponseDone``, ``PotentialDataLoss`` (no framing: ended
by the close) or ``ResponseFailed``.
"""

from __future__ import annotations

import re
from typing import Dict, Iterator, List, Optional, Tuple, Union

from twisted.internet import tcp
from twisted.internet.abstract import isIPAddress, isIPv6Address
from twisted.internet.defer import CancelledError, Deferred, gatherResults, succeed
from twisted.internet.endpoints import HostnameEndpoint, TCP4ClientEndpoint, TCP6ClientEndpoint
from twisted.internet.interfaces import IAddress, IDelayedCall, IProtocol, IPushProducer, IStreamClientEndpoint
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import URI, ResponseDone, ResponseFailed, ResponseNeverReceived
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IBodyProducer, IResponse
from zope.interface import implementer

from rolemesh.base.interfaces import IHTTPClientReactor
from rolemesh.event_loop.twisted_compat import write_now, write_pending

#: The most bytes of status line and headers accepted.
MAX_HEAD = 65536
CONNECT_TIMEOUT_S = 30.0
#: A stream is held (``coalesce_s``) only after reads smaller than this: a
#: body that arrives in big reads is already relayed in big writes.
COALESCE_BELOW = 8192
#: Shorter holds are not worth a timer.
MIN_HOLD_S = 0.0005
#: Bytes that mark the last events of a llama-server stream.
_LAST_EVENT = (b'"finish_reason":"', b'"finish_reason": "', b"data: [DONE]")
#: The header lines of a response head, each after its CRLF: a token, a
#: colon, a value of visible bytes, spaces and tabs (RFC 9110 §5.1, §5.5; no
#: obs-fold, no space before the colon, no bare CR or LF, no NUL or other
#: control byte).  One match for all of them: per-line checks cost as much
#: as the rest of the head's parsing.
_HEADER_LINES = re.compile(rb"(?:\r\n[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*)*")
#: A byte that is not in a status line's reason phrase.
_NOT_TEXT = re.compile(rb"[^\t\x20-\x7e\x80-\xff]")
#: A Content-Length: 1*DIGIT (RFC 9110 §8.6; not ``int()``'s ``+5``, `` 5``, ``5_0``).
_DIGITS = re.compile(rb"[0-9]{1,18}")
#: A chunk size: 1*HEXDIG (RFC 9112 §7.1; not ``int(x, 16)``'s ``0x10``, ``1_0``, ``-1``).
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")

_IDLE, _WAITING, _BODY, _CLOSED = range(4)
# Body framings.
_LENGTH, _CHUNKED, _UNTIL_CLOSE, _NONE = range(4)
# Chunked decoder states.
_SIZE, _DATA, _DATA_END, _TRAILER = range(4)


#: How every complete body ends: one shared Failure, as Twisted's own
#: ``connectionDone`` is (building a Failure walks its exception's classes:
#: ~10 us per response); receivers only ``check`` it.
_DONE = Failure(ResponseDone())


class BadResponse(Exception):
    """The child's answer is not HTTP/1.x as this client reads it."""


class RawHeaders:
    """Response headers as received: ``(lower-case name, [values])``.

    The two read methods the proxy uses of ``twisted.web.http_headers.Headers``,
    without its per-header encoding and sanitising (the proxy copies them into
    the downstream response's ``Headers``, which does that once)."""

    __slots__ = ("_headers",)

    def __init__(self, headers: Dict[bytes, List[bytes]]) -> None:
        self._headers = headers

    def getAllRawHeaders(self) -> Iterator[Tuple[bytes, List[bytes]]]:  # noqa: N802 - Headers' name
        return iter(self._headers.items())

    def getRawHeaders(self, name: bytes, default: Optional[List[bytes]] = None) -> Optional[List[bytes]]:  # noqa: N802
        return self._headers.get(name.lower(), default)

    def hasHeader(self, name: bytes) -> bool:  # noqa: N802 - Headers' name
        return name.lower() in self._headers


def parse_head(head: bytes) -> Tuple[bytes, int, bytes, Dict[bytes, List[bytes]]]:
    """``(version, code, phrase, headers)`` of a response head (no final blank line).

    Strict (RFC 9112): lines end with CRLF, no control byte but HTAB, header
    names are tokens (no space before the colon, no obs-fold); anything else
    is a :class:`BadResponse`."""
    first = head.find(b"\r\n")
    status_line = head if first < 0 else head[:first]
    status = status_line.split(b" ", 2)
    if (len(status) < 2 or status[0] not in (b"HTTP/1.1", b"HTTP/1.0") or len(status[1]) != 3
            or not status[1].isdigit() or _NOT_TEXT.search(status_line) is not None):
        raise BadResponse(f"bad status line {status_line[:80]!r}")
    if first >= 0 and _HEADER_LINES.fullmatch(head, first) is None:
        good = _HEADER_LINES.match(head, first)  # matches at least the empty string
        raise BadResponse(f"bad header line at {head[good.end() if good else first:][:80]!r}")
    lines = head.split(b"\r\n")
    headers: Dict[bytes, List[bytes]] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        key = name.lower()
        value = value.strip(b" \t")
        values = headers.get(key)
        if values is None:
            headers[key] = [value]
        else:
            values.append(value)
    return status[0], int(status[1]), status[2] if len(status) > 2 else b"", headers


def content_length(values: List[bytes]) -> int:
    """The one length a response's Content-Length fields give: each 1*DIGIT,
    repeated (as fields or a list) only as the same number (RFC 9110 §8.6);
    else :class:`BadResponse` (RFC 9112 §6.3: an invalid length is an
    unrecoverable framing error)."""
    if len(values) == 1 and _DIGITS.fullmatch(values[0]) is not None:  # every llama-server answer
        return int(values[0])
    lengths = set()
    for value in values:
        for part in value.split(b","):
            part = part.strip(b" \t")
            if _DIGITS.fullmatch(part) is None:
                raise BadResponse(f"bad content-length {b', '.join(values)[:80]!r}")
            lengths.add(int(part))
    if len(lengths) != 1:
        raise BadResponse(f"conflicting content-lengths {b', '.join(values)[:80]!r}")
    return lengths.pop()


def _declared_length(te: Optional[List[bytes]], sized: Optional[List[bytes]]) -> Union[int, str]:
    """The body length a response head declares, from its Transfer-Encoding
    (``te``) and Content-Length (``sized``) fields: ``UNKNOWN_LENGTH`` when
    chunked or not said; :class:`BadResponse` for framing the client does not
    take."""
    if te is not None:
        # Only chunked, and never with a length too (RFC 9112 §6.1, §6.3:
        # what a smuggling or response-splitting attempt looks like).
        if not (len(te) == 1 and te[0].lower() == b"chunked") and [
                c.strip(b" \t").lower() for v in te for c in v.split(b",")] != [b"chunked"]:
            raise BadResponse(f"unsupported transfer-encoding {b', '.join(te)[:80]!r}")
        if sized is not None:
            raise BadResponse("both transfer-encoding and content-length")
    elif sized is not None:
        return content_length(sized)
    return UNKNOWN_LENGTH  # Twisted's marker is a str


def chunk_size(line: bytes) -> int:
    """The size a chunk-size line gives (``1*HEXDIG [ chunk-ext ]``); else :class:`BadResponse`."""
    size, sep, _ = line.partition(b";")
    if sep:
        size = size.rstrip(b" \t")  # BWS before a chunk extension
    if _HEX.fullmatch(size) is None:
        raise BadResponse(f"bad chunk size {line[:40]!r}")
    return int(size, 16)


@implementer(IPushProducer)
class _BodyTransport:
    """What a body protocol sees as its transport: the upstream socket as a
    push producer (pausing it pauses the child's writes); ``stopProducing``
    closes the connection, which is how the proxy stops a generation."""

    __slots__ = ("conn",)

    def __init__(self, conn: "ChildConnection") -> None:
        #: None once the body has ended: the connection may serve another
        #: request by then, which a late call must not pause or close.
        self.conn: Optional[ChildConnection] = conn

    def pauseProducing(self) -> None:  # noqa: N802 - Twisted's name
        if self.conn is not None:
            self.conn.pause()

    def resumeProducing(self) -> None:  # noqa: N802 - Twisted's name
        if self.conn is not None:
            self.conn.resume()

    def stopProducing(self) -> None:  # noqa: N802 - Twisted's name
        if self.conn is not None:
            self.conn.abort()


class ChildResponse:
    """An ``IResponse``-like answer: ``code``, ``phrase``, ``headers``, ``length``, ``deliverBody``."""

    def __init__(self, conn: "ChildConnection", version: bytes, code: int, phrase: bytes, headers: RawHeaders,
                 length: Union[int, str]) -> None:
        self._conn = conn
        self.version = (b"HTTP", 1, 1 if version == b"HTTP/1.1" else 0)
        self.code = code
        self.phrase = phrase
        self.headers = headers
        self.length = length

    def deliverBody(self, protocol: IProtocol) -> None:  # noqa: N802 - IResponse's name
        self._conn.deliver_body(protocol)

    def whole_body(self) -> Optional[bytes]:
        """The body, when all of it came with the head and ended cleanly
        (most non-streamed answers): taken at once, instead of through a body
        protocol (no producer to register, nothing to wait for).  Else None,
        and ``deliverBody`` as usual."""
        return self._conn.take_whole_body()


class ChildConnection(Protocol):
    """One connection to a child; one request at a time."""

    def __init__(self, pool: "ChildAgent", key: Tuple[str, int]) -> None:
        self._pool = pool
        self._key = key
        self._state = _IDLE
        self._buf = b""
        self._result: Optional[Deferred] = None
        self._reusable = False
        self._keep_alive = False
        self._framing = _NONE
        self._left = 0
        self._chunk_state = _SIZE
        self._body: Optional[IProtocol] = None  # the body protocol, once delivered
        self._body_transport: Optional[_BodyTransport] = None
        self._pending: List[bytes] = []  # body bytes that came before deliverBody
        self._ended: Optional[Failure] = None  # how the body ended, before deliverBody
        self._paused = False  # by the body's consumer (backpressure)
        self._held: Optional[IDelayedCall] = None  # the timer of a coalescing pause
        self._body_began = 0.0
        self._reading_paused = False  # the socket's state: paused if either of the two
        self._lost: List[Deferred] = []
        self._head_request = False  # the request is a HEAD: its answer has no body

    # -- the pool's side ------------------------------------------------------------------

    def send(self, data: bytes, result: Deferred, keep_alive: bool, head: bool = False) -> None:
        self._state = _WAITING
        self._buf = b""
        self._result = result
        self._keep_alive = keep_alive
        self._head_request = head
        self._body = None
        self._pending = []
        self._ended = None
        write_now(self.transport, data)  # type: ignore[arg-type]

    def abort(self) -> None:
        self._reusable = False
        if self._state != _CLOSED and self.transport is not None:
            self.transport.abortConnection()  # type: ignore[attr-defined]

    def pause(self) -> None:
        self._paused = True
        self._reading()

    def resume(self) -> None:
        self._paused = False
        self._reading()

    def _reading(self) -> None:
        """Pause or resume the socket: paused while the consumer or a coalescing hold wants it."""
        paused = self._paused or self._held is not None
        if paused != self._reading_paused and self._state != _CLOSED and self.transport is not None:
            self._reading_paused = paused
            if paused:
                self.transport.pauseProducing()  # type: ignore[attr-defined]
            else:
                self.transport.resumeProducing()  # type: ignore[attr-defined]

    def _hold(self, seconds: float) -> None:
        """Stop reading for ``seconds``: the events the child writes meanwhile
        arrive together, in one wake-up, one ``recv`` and one write to the
        client, instead of one each."""
        if self._held is None:
            self._held = self._pool._reactor.callLater(seconds, self._release)
            self._reading()

    def _maybe_hold(self, data: bytes) -> None:
        """Hold after a small read of a stream, for at most ``coalesce_s`` and
        never longer than the stream has run so far (a short stream is not
        stretched: its slot is free as soon as it ends), and not at all once
        the answer's last event is in (llama-server's ``finish_reason`` or
        ``[DONE]``: the end follows at once)."""
        if len(data) >= COALESCE_BELOW or self._state != _BODY:
            return
        hold = min(self._pool.coalesce_s, self._pool._reactor.seconds() - self._body_began)
        if hold >= MIN_HOLD_S and not any(mark in data for mark in _LAST_EVENT):
            self._hold(hold)

    def _release(self) -> None:
        self._held = None
        self._reading()

    def _unhold(self) -> None:
        if self._held is not None:
            if self._held.active():
                self._held.cancel()
            self._held = None

    def when_lost(self) -> "Deferred[None]":
        if self._state == _CLOSED:
            return succeed(None)
        d: Deferred = Deferred()
        self._lost.append(d)
        return d

    # -- bytes from the child ---------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:  # noqa: N802 - Twisted's name
        if self._state == _BODY:
            if self._framing == _CHUNKED:  # _chunked_data, one frame shorter: a stream's every read
                if self._chunk_state != _SIZE or self._buf or not self._whole_chunk(data):
                    self._chunk_loop(data)
                return
            self._body_data(data)
        elif self._state == _WAITING:
            self._head_data(data)
        else:  # bytes nobody asked for: the connection is not in a state to reuse
            self.abort()

    def _head_data(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD:
                self._fail_head(BadResponse("response head too large"))
            else:
                self._buf = buf
            return
        try:
            version, code, phrase, headers = parse_head(buf[:end])
        except (BadResponse, ValueError) as e:
            self._fail_head(e)
            return
        rest = buf[end + 4:]
        self._buf = b""
        if 100 <= code < 200:  # an interim answer: the real one follows
            if rest:
                self._head_data(rest)
            return
        connection = headers.get(b"connection")
        keep = self._keep_alive and version == b"HTTP/1.1" and not (
            connection and any(v.lower() == b"close" for v in connection))
        te = headers.get(b"transfer-encoding")
        sized = headers.get(b"content-length")
        try:
            length = _declared_length(te, sized)
        except BadResponse as e:
            self._fail_head(e)
            return
        if code in (204, 304) or self._head_request:  # no body, whatever the head says (RFC 9112 §6.3)
            self._framing, length = _NONE, 0
        elif te is not None:
            # llama-server closes its side after every streamed answer, though
            # it says keep-alive: such a connection is closed, not pooled, so
            # no request is sent on it while it closes (a retry).
            self._framing, self._chunk_state, keep = _CHUNKED, _SIZE, False
            self._body_began = self._pool._reactor.seconds()
        elif sized is not None:
            self._framing, self._left = _LENGTH, length  # type: ignore[assignment]  # an int here
        else:
            self._framing, keep = _UNTIL_CLOSE, False
        self._reusable = keep
        self._state = _BODY
        result, self._result = self._result, None
        response = ChildResponse(self, version, code, phrase, RawHeaders(headers), length)
        if self._framing == _NONE or (self._framing == _LENGTH and self._left == 0):
            self._body_done(_DONE)
        elif rest:
            self._body_data(rest)
        if result is not None and not result.called:
            result.callback(response)

    def _fail_head(self, error: Exception) -> None:
        result, self._result = self._result, None
        self.abort()
        if result is not None and not result.called:
            result.errback(Failure(ResponseFailed([Failure(error)])))

    def _body_data(self, data: bytes) -> None:
        framing = self._framing
        if framing == _CHUNKED:
            self._chunked_data(data)
            return
        if framing == _LENGTH:
            if len(data) >= self._left:
                data, extra = data[:self._left], data[self._left:]
                self._left = 0
                if data:
                    self._deliver(data)
                if extra:
                    self._reusable = False
                self._body_done(_DONE)
                return
            self._left -= len(data)
        self._deliver(data)

    def _whole_chunk(self, data: bytes) -> bool:
        """A stream's usual read: one whole chunk (llama-server writes each
        event as one) with a plain size line, delivered on a short way; False
        for anything else (an extension, several chunks, a part, the last
        chunk), which is the general loop's."""
        end = data.find(b"\r\n", 0, 17)
        if end > 0 and _HEX.fullmatch(data, 0, end) is not None:
            stop = end + 2 + int(data[:end], 16)
            if stop > end + 2 and len(data) == stop + 2 and data.endswith(b"\r\n"):
                payload, body = data[end + 2:stop], self._body
                if body is not None:  # _deliver, inline
                    body.dataReceived(payload)
                else:
                    self._pending.append(payload)
                if self._pool.coalesce_s:  # off by default: no call per event then
                    self._maybe_hold(data)
                return True
        return False

    def _chunked_data(self, data: bytes) -> None:
        if self._chunk_state != _SIZE or self._buf or not self._whole_chunk(data):
            self._chunk_loop(data)

    def _chunk_loop(self, data: bytes) -> None:
        """The general chunked decoder: parts, several chunks, extensions, the last chunk and trailers."""
        buf = self._buf + data if self._buf else data
        out: List[bytes] = []
        pos, size = 0, len(buf)
        state, left = self._chunk_state, self._left
        done = False
        while pos < size:
            if state == _DATA:
                take = buf[pos:pos + left]
                out.append(take)
                pos += len(take)
                left -= len(take)
                if left == 0:
                    state = _DATA_END
            else:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if size - pos > 4096:
                        self._body_failed(BadResponse("bad chunk framing"))
                        return
                    break
                line = buf[pos:end]
                pos = end + 2
                if state == _SIZE:
                    try:
                        left = chunk_size(line)
                    except BadResponse as e:
                        self._body_failed(e)
                        return
                    state = _DATA if left else _TRAILER
                elif state == _DATA_END:
                    if line:
                        self._body_failed(BadResponse("bad chunk end"))
                        return
                    state = _SIZE
                elif not line:  # _TRAILER: the blank line ends the body
                    done = True
                    break
        self._chunk_state, self._left = state, left
        self._buf = buf[pos:] if pos < size and not done else b""
        if out:
            self._deliver(out[0] if len(out) == 1 else b"".join(out))
            if not done and self._pool.coalesce_s:
                self._maybe_hold(buf)
        if done:
            if pos < size:
                self._reusable = False
            self._body_done(_DONE)

    def _deliver(self, data: bytes) -> None:
        if self._body is not None:
            self._body.dataReceived(data)
        else:
            self._pending.append(data)

    def _body_failed(self, error: Exception) -> None:
        self._reusable = False
        if self.transport is not None:
            self.transport.abortConnection()  # type: ignore[attr-defined]
        self._body_done(Failure(ResponseFailed([Failure(error)])))

    def _body_done(self, reason: Failure) -> None:
        if self._state != _BODY:
            return
        # The whole answer is in; the whole request must be out too before the
        # connection carries another (a child that answered early, before
        # reading all of it, would read the next request as its rest).
        unsent = self.transport is not None and write_pending(self.transport)  # type: ignore[arg-type]
        if unsent:
            self._reusable = False
        self._state = _IDLE if self._reusable else _CLOSED
        self._buf = b""
        self._unhold()
        if self._body_transport is not None:
            self._body_transport.conn = None
            self._body_transport = None
        if self._reusable:
            self._paused = False
            self._reading()  # a pooled connection is never left paused
            self._pool._put(self._key, self)
        elif isinstance(reason.value, ResponseDone) and self.transport is not None:  # Failure.check, cheaper
            if unsent:  # what is left of the request is of no use now
                self.transport.abortConnection()  # type: ignore[attr-defined]
            else:
                self.transport.loseConnection()  # type: ignore[union-attr]
        if self._body is not None:
            body, self._body = self._body, None
            body.connectionLost(reason)
        else:
            self._ended = reason

    def take_whole_body(self) -> Optional[bytes]:
        if self._body is not None or self._ended is None or not isinstance(self._ended.value, ResponseDone):
            return None
        pending, self._pending, self._ended = self._pending, [], None
        return pending[0] if len(pending) == 1 else b"".join(pending)

    def deliver_body(self, protocol: IProtocol) -> None:
        self._body = protocol
        self._body_transport = _BodyTransport(self)
        # A producer, not a whole transport: what twisted.web's own clients
        # give a body protocol too (TransportProxyProducer).
        protocol.makeConnection(self._body_transport)  # type: ignore[arg-type]
        pending, self._pending = self._pending, []
        for data in pending:
            if self._body is not protocol:
                break
            protocol.dataReceived(data)
        if self._ended is not None and self._body is protocol:
            reason, self._ended = self._ended, None
            self._body = None
            protocol.connectionLost(reason)

    # -- the end ----------------------------------------------------------------------------

    def connectionLost(self, reason: Failure = connectionDone) -> None:  # noqa: N802 - Twisted's name
        state, self._state = self._state, _CLOSED
        self._reusable = False
        self._unhold()
        self._pool._forget(self._key, self)
        if state == _WAITING:
            result, self._result = self._result, None
            if result is not None and not result.called:
                cls = ResponseFailed if self._buf else ResponseNeverReceived
                result.errback(Failure(cls([reason])))
        elif state == _BODY:
            self._state = _BODY  # so _body_done runs once
            ended = Failure(PotentialDataLoss()) if self._framing == _UNTIL_CLOSE else Failure(
                ResponseFailed([reason]))
            self._body_done(ended)
            self._state = _CLOSED
        lost, self._lost = self._lost, []
        for d in lost:
            d.callback(None)


class _Attempt:
    """One request's way to a connection: what cancelling it must stop."""

    __slots__ = ("conn", "connecting", "cancelled")

    def __init__(self) -> None:
        self.conn: Optional[ChildConnection] = None
        self.connecting: Optional[Deferred] = None
        self.cancelled = False

    def cancel(self, _: Deferred) -> None:
        self.cancelled = True
        if self.conn is not None:
            self.conn.abort()
        elif self.connecting is not None:
            self.connecting.cancel()


class _ConnectionFactory(Factory):
    noisy = False

    def __init__(self, pool: "ChildAgent", key: Tuple[str, int]) -> None:
        self._pool = pool
        self._key = key

    def buildProtocol(self, addr: Optional[IAddress]) -> ChildConnection:  # noqa: N802 - Twisted's name
        return ChildConnection(self._pool, self._key)


def _without_wrapper(conn: ChildConnection) -> None:
    """Have a TCP connection's transport call ``conn`` itself from now on,
    not the endpoint's ``_WrappingProtocol`` around it: once connected, that
    only forwards each call (one more frame per read of a stream; the half-close
    and descriptor interfaces it also forwards are not ``ChildConnection``'s).
    Any other transport keeps what it has."""
    transport = conn.transport
    if isinstance(transport, tcp.Client) and getattr(transport.protocol, "_wrappedProtocol", None) is conn:
        transport.protocol = conn


class ChildAgent:
    """An ``IAgent`` for ``http://`` children, with its own connection pool.

    ``persistent``: keep up to ``max_per_host`` idle connections per child
    and reuse them (else every request gets a connection of its own, sent
    with ``Connection: close``).  The pool attributes are named as
    ``HTTPConnectionPool``'s (``maxPersistentPerHost``, ``retryAutomatically``:
    never; the proxy decides about retries).

    ``coalesce_s``: once a chunked (streamed) body has begun, stop reading
    for up to this long after each small read (under ``COALESCE_BELOW``
    bytes), so that the events written meanwhile are relayed together (0:
    never).  The first bytes of a body are delivered at once; a hold is never
    longer than the stream has run, and there is none once the last event
    is in; each later event waits at most ``coalesce_s``.
    """

    retryAutomatically = False

    def __init__(self, reactor: IHTTPClientReactor, persistent: bool = True, max_per_host: int = 2,
                 connect_timeout: float = CONNECT_TIMEOUT_S, coalesce_s: float = 0.0) -> None:
        self._reactor = reactor
        self.coalesce_s = coalesce_s
        self.persistent = persistent
        self.maxPersistentPerHost = max_per_host
        self._connect_timeout = connect_timeout
        self._idle: Dict[Tuple[str, int], List[ChildConnection]] = {}
        self._open: Dict[ChildConnection, None] = {}
        self._targets: Dict[bytes, Tuple[Tuple[str, int], bytes, bytes]] = {}

    def _target(self, uri: bytes) -> Tuple[Tuple[str, int], bytes, bytes]:
        """``(key, host header, path)`` of a URL, parsed once per URL."""
        target = self._targets.get(uri)
        if target is None:
            parsed = URI.fromBytes(uri)
            if parsed.scheme != b"http":
                raise ValueError(f"only http:// children are supported, not {uri[:40]!r}")
            host = parsed.host.decode("ascii")
            target = ((host, parsed.port), parsed.netloc, parsed.originForm)
            if len(self._targets) > 1024:
                self._targets.clear()
            self._targets[uri] = target
        return target

    def request(self, method: bytes, uri: bytes, headers: Optional[Headers] = None,
                bodyProducer: Optional[IBodyProducer] = None) -> "Deferred[IResponse]":
        """Send a request; fires with a :class:`ChildResponse` once its head arrived."""
        key, host, path = self._target(uri)
        parts = [method, b" ", path, b" HTTP/1.1\r\nHost: ", host, b"\r\n"]
        if headers is not None:
            for name, values in headers.getAllRawHeaders():
                for value in values:
                    parts += [name, b": ", value, b"\r\n"]
        if not self.persistent:
            parts.append(b"Connection: close\r\n")
        body = getattr(bodyProducer, "body", None) if bodyProducer is not None else b""
        if body is None:  # a producer that is not an in-memory body
            assert bodyProducer is not None
            return self._collect(bodyProducer).addCallback(
                lambda data: self._request(key, parts, data))
        return self._request(key, parts, body)

    def _collect(self, producer: IBodyProducer) -> "Deferred[bytes]":
        chunks: List[bytes] = []

        class _Consumer:
            write = chunks.append

        return producer.startProducing(_Consumer()).addCallback(lambda _: b"".join(chunks))

    def _request(self, key: Tuple[str, int], parts: List[bytes], body: bytes) -> Deferred:
        if body or parts[0] in (b"POST", b"PUT", b"PATCH"):
            parts.append(b"Content-Length: %d\r\n" % len(body))
        parts += [b"\r\n", body]
        data = b"".join(parts)
        head = parts[0] == b"HEAD"
        attempt = _Attempt()
        result: Deferred = Deferred(attempt.cancel)
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn._state == _IDLE and conn.transport is not None:
                attempt.conn = conn
                conn.send(data, result, self.persistent, head)
                return result

        def connected(conn: ChildConnection) -> None:
            attempt.connecting = None
            if result.called:  # cancelled meanwhile
                conn.abort()
                return
            attempt.conn = conn
            self._open[conn] = None
            _without_wrapper(conn)
            conn.send(data, result, self.persistent, head)

        def failed(failure: Failure) -> None:
            attempt.connecting = None
            if not result.called:
                result.errback(Failure(CancelledError()) if attempt.cancelled else failure)

        connecting = attempt.connecting = self._endpoint(key).connect(_ConnectionFactory(self, key))
        connecting.addCallbacks(connected, failed)
        return result

    def _endpoint(self, key: Tuple[str, int]) -> IStreamClientEndpoint:
        host, port = key
        if isIPAddress(host):
            return TCP4ClientEndpoint(self._reactor, host, port, timeout=self._connect_timeout)
        if isIPv6Address(host):
            return TCP6ClientEndpoint(self._reactor, host, port, timeout=self._connect_timeout)
        return HostnameEndpoint(self._reactor, host, port, timeout=self._connect_timeout)

    def _put(self, key: Tuple[str, int], conn: ChildConnection) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) >= self.maxPersistentPerHost:
            conn.abort()
        else:
            idle.append(conn)

    def _forget(self, key: Tuple[str, int], conn: ChildConnection) -> None:
        self._open.pop(conn, None)
        idle = self._idle.get(key)
        if idle and conn in idle:
            idle.remove(conn)
            if not idle:
                del self._idle[key]

    def closeCachedConnections(self) -> "Deferred[None]":  # noqa: N802 - HTTPConnectionPool's name
        """Close the idle connections; fires when they are closed."""
        conns = [c for idle in self._idle.values() for c in idle]
        self._idle.clear()
        waits = [c.when_lost() for c in conns]
        for conn in conns:
            if conn.transport is not None:
                conn.transport.loseConnection()
        return gatherResults(waits).addCallback(lambda _: None)
