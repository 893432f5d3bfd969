"""Reading a client connection's requests: llhttp's callbacks and the head
checks, from bytes to a queue of parsed requests (or the refusals that
answer them).

Apart from :mod:`rolemesh.http.fast_channel` so that the parsing, which is
security code, reads on its own; a base class, not an object of its own,
because llhttp calls back one object for every header and body piece: an
object between them would cost a call and an attribute hop each time.
What answers the queued requests is :class:`~rolemesh.http.fast_channel.FastChannel`.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

import httptools
from twisted.internet.protocol import Protocol

from rolemesh.base.errors import ApiError
from rolemesh.base.interfaces import ChannelSite
from rolemesh.http import lingering, request_head

#: Parsed requests that may wait behind the one being answered before
#: reading pauses, and their bytes.
MAX_QUEUED = 16
MAX_QUEUED_BYTES = 1 << 20

#: Why reading is paused (bits of ``RequestReader._read_paused``).
QUEUE_FULL = 1
WRITES_BLOCKED = 2
STOPPED = 4  # nothing more will be read: a refusal waits its turn, then the connection closes

#: The header names the head rules look at.
_NOTED = frozenset({b"host", b"expect", b"content-length", b"transfer-encoding"})
#: The headers whose bytes must be UTF-8 (request_head.READ_FIELDS).
_READ = request_head.READ_FIELDS
#: Bytes read while a head is incomplete, at most: llhttp hands a header
#: line over only once it is whole, and httptools holds it meanwhile, so a
#: head line without end is cut off here (a whole head is at most
#: MAX_HEAD_BYTES; a read, counted whole, at most 64 KiB).
_HEAD_READ_LIMIT = request_head.MAX_HEAD_BYTES + (80 << 10)


class Incoming:
    """A request as parsed: its head, then its body; or the refusal that
    answers it."""

    __slots__ = ("method", "target", "version", "headers", "raw", "body", "keep_alive", "refusal", "framed",
                 "size", "seq")

    def __init__(self) -> None:
        self.method = b""
        self.target = b""
        self.version = "1.1"
        #: ``{lower-case name: value}`` (the last one, as twisted.web's getHeader).
        self.headers: Dict[bytes, bytes] = {}
        #: The header lines as sent, for the canonical copy to twisted.web.
        self.raw: List[Tuple[bytes, bytes]] = []
        self.body = b""
        self.keep_alive = True
        #: The answer it gets instead of being served (then it is the last).
        self.refusal: Optional[ApiError] = None
        #: It had a Content-Length or a transfer coding.
        self.framed = False
        self.size = 0
        #: Its number on the connection, from 0 (see request_head.RequestLines).
        self.seq = -1


class _Refused(Exception):
    """Raised in a parser callback: stop reading; ``error`` answers the request."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


class _BodyDropped(Exception):
    """Raised in a parser callback: the refused request's body has ended; read nothing more."""


class RequestReader(Protocol):
    """Parses every request on a connection strictly and checks its head
    before a byte of its body is kept; queues what passes, and the refusal
    of what does not, for :meth:`_pump` to answer in order."""

    def __init__(self, site: ChannelSite) -> None:
        self._reactor = site.reactor
        self._policy = site.head_policy
        self._limit_bytes = site.max_body_bytes
        self._parser = httptools.HttpRequestParser(self)
        #: The request being parsed (its head is complete once ``_head_done``).
        self._incoming = Incoming()
        self._head_done = False
        #: Between requests or inside a head, and what was read meanwhile (see _HEAD_READ_LIMIT).
        self._in_head = True
        self._head_read = 0
        self._head_size = 0
        self._hosts = 0
        self._expect: Optional[bytes] = None
        #: The Transfer-Encoding lines' values, joined; the answer to a read header that is no UTF-8.
        self._codings: Optional[bytes] = None
        self._bad_field: Optional[ApiError] = None
        #: Where each request line is, to check it (llhttp skips extra spaces in it).
        self._lines = request_head.RequestLines()
        self._framings: Deque[int] = deque()
        self._seq = 0
        #: The parser is between requests (at the start: before the first).
        self._between = True
        #: A refused request's body being read and dropped (lingering.py), and
        #: whether its answer is written (then it closes when that ends).
        self._linger: Optional[lingering.Linger] = None
        self._linger_closes = False
        self._parts: List[bytes] = []
        self._size = 0
        #: Parsed requests waiting for their turn, and their bytes.
        self._queue: Deque[Incoming] = deque()
        self._queued_bytes = 0
        #: No more input is read (a refusal, a parse error, an upgrade).
        self._stopped = False
        self._read_paused = 0
        #: A ``100 Continue`` owed to the request being parsed, once nothing is answered ahead of it.
        self._continue_owed = False
        self._closed = False

    # -- what the channel does with the queue ---------------------------------

    def _pump(self) -> None:
        """Answer what is queued, in order (after every read)."""
        raise NotImplementedError()

    def close(self) -> None:
        """Close once what is written is sent."""
        raise NotImplementedError()

    # -- reading --------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:  # noqa: N802 - Twisted's name
        if self._linger is not None:
            self._drop(data)
            return
        if self._stopped:
            return
        if self._between:
            self._lines.resync(self._seq)
            self._framings.clear()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            cause = e.__context__
            if self._linger is not None or isinstance(cause, _BodyDropped):
                self._end_linger()
            else:
                self._stop(cause.error if isinstance(cause, _Refused) else request_head.malformed(str(cause)))
        except httptools.HttpParserUpgrade:
            # CONNECT, or an Upgrade the agent does not take: the request is
            # answered (CONNECT with a 405) and nothing after it is read.
            self._stopped = True
            if self._queue:
                last = self._queue[-1]
                last.keep_alive = False
                if last.method == b"CONNECT" and last.refusal is None:
                    last.refusal = ApiError(405, "CONNECT is not served here", "invalid_request_error",
                                            "method_not_allowed")
        except httptools.HttpParserInvalidMethodError:
            self._stop(request_head.unknown_method())
        except httptools.HttpParserError as e:
            if self._linger is not None:
                self._end_linger()
            else:
                self._stop(request_head.malformed(str(e)))
        bad = self._lines.feed(data, self._framings)  # even if the parser stopped: that may be after it
        if bad is not None:
            self._refuse_line(bad)
        if self._in_head and not self._stopped and self._linger is None:
            self._head_read += len(data)
            if self._head_read > _HEAD_READ_LIMIT:
                self._stop(request_head.head_too_large())
        if len(self._queue) > MAX_QUEUED or self._queued_bytes > MAX_QUEUED_BYTES:
            self._pause_reading(QUEUE_FULL)
        self._pump()

    def _stop(self, error: ApiError, refused: Optional[Incoming] = None) -> None:
        """Answer ``error`` after what is queued, read nothing more, then close."""
        if refused is None:
            refused = self._incoming if self._head_done else Incoming()
            if refused is not self._incoming:
                refused.seq = self._seq if self._between else self._incoming.seq
        refused.refusal = error
        refused.keep_alive = False
        self._queue.append(refused)
        self._stopped = True
        self._continue_owed = False
        self._pause_reading(STOPPED)  # the rest of a refused body is not even read off the socket

    def _refuse_line(self, seq: int) -> None:
        """Request ``seq`` (parsed in this read, not answered yet) has a
        request line of more than one space between its parts: it and what
        follows it are answered 400 instead."""
        queue = self._queue
        if seq >= self._seq or any(not q.keep_alive for q in queue if q.seq < seq):
            return  # the parser stopped before it, or the connection closes before it
        if self._linger is not None:  # for a request after it
            self._linger.cancel()
            self._linger = None
        refused: Optional[Incoming] = None
        while queue and queue[-1].seq >= seq:
            refused = queue.pop()
            self._queued_bytes -= refused.size
        if refused is None or refused.seq != seq:
            refused = self._incoming if self._incoming.seq == seq and self._head_done else Incoming()
        self._stop(request_head.spaced_request_line(), refused)

    def _start_linger(self, error: ApiError) -> None:
        """Answer ``error`` (decided from the head) after what is queued, and
        read and drop the body meanwhile, within bounds (lingering.py)."""
        refused = self._incoming
        refused.refusal = error
        refused.keep_alive = False
        self._queue.append(refused)
        self._continue_owed = False
        self._linger = lingering.Linger(self._reactor, self._end_linger, lingering.max_bytes(self._limit_bytes))

    def _drop(self, data: bytes) -> None:
        """Bytes of a refused body: through llhttp (to know where it ends), then dropped."""
        assert self._linger is not None
        if self._linger.read(len(data)):
            self._end_linger()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:  # its end (_BodyDropped), or bytes that are no body: enough
            self._end_linger()

    def _end_linger(self) -> None:
        """Read nothing more; close once the refusal is written (now, if it is)."""
        linger, self._linger = self._linger, None
        if linger is None:
            return
        linger.cancel()
        self._stopped = True
        self._pause_reading(STOPPED)
        if self._linger_closes:
            self.close()

    # -- llhttp's callbacks: one request at a time ----------------------------

    def on_message_begin(self) -> None:
        self._incoming = Incoming()
        self._head_done = False
        self._head_size = 0
        self._hosts = 0
        self._expect = None
        self._codings = None
        self._bad_field = None
        self._parts = []
        self._size = 0
        self._incoming.seq = self._seq
        self._seq += 1
        self._between = False

    def on_url(self, url: bytes) -> None:
        incoming = self._incoming
        incoming.target += url
        self._head_size += len(url)
        if self._head_size > request_head.MAX_HEAD_BYTES:
            raise _Refused(request_head.head_too_large())

    def on_header(self, name: bytes, value: bytes) -> None:
        incoming = self._incoming
        raw = incoming.raw
        raw.append((name, value))
        self._head_size += len(name) + len(value) + 4
        if len(raw) > request_head.MAX_HEADERS or self._head_size > request_head.MAX_HEAD_BYTES:
            raise _Refused(request_head.head_too_large())
        key = name.lower()
        if not value.isascii() and key in _READ and self._bad_field is None:
            self._bad_field = request_head.field_error(name, value)
        if key in _NOTED:
            if key == b"host":
                self._hosts += 1
            elif key == b"expect":
                self._expect = value
            else:
                incoming.framed = True
                if key == b"transfer-encoding":  # every line of it, however many
                    self._codings = value if self._codings is None else self._codings + b"," + value
        incoming.headers[key] = value

    def on_headers_complete(self) -> None:
        parser = self._parser
        incoming = self._incoming
        self._head_done = True
        self._in_head = False
        self._head_read = 0
        incoming.method = parser.get_method()
        incoming.version = parser.get_http_version()
        incoming.keep_alive = parser.should_keep_alive()
        headers = incoming.headers
        error: Optional[ApiError] = None
        if self._hosts != 1 or self._expect is not None or incoming.version != "1.1":  # else nothing to check
            error = request_head.head_error(incoming.version, self._hosts, self._expect)
            if error is not None:
                raise _Refused(error)
        if self._bad_field is not None:
            raise _Refused(self._bad_field)
        if self._codings is not None:
            error = request_head.coding_error(self._codings)
            if error is not None:
                raise _Refused(error)
        chunked = b"transfer-encoding" in headers
        length = None if chunked else int(headers.get(b"content-length", b"0"))
        self._framings.append(-1 if length is None else length)
        body_follows = chunked or bool(length)
        limit = self._limit_bytes
        if limit is not None and length is not None and length > limit:
            error = request_head.body_too_large(limit)
        elif self._policy is not None:
            error = self._policy.refuse_head(incoming.method, incoming.target.partition(b"?")[0], headers)
        if error is not None:
            if body_follows and self._expect is not None:  # the client waits: it sends no body, and it closes
                raise _Refused(error)
            if body_follows:  # answered from the head; the body is dropped as it comes, then it closes
                self._start_linger(error)
                return
            incoming.refusal = error  # nothing follows: answered in turn, the connection stays
        elif body_follows and self._expect is not None:
            self._continue_owed = True

    def on_body(self, body: bytes) -> None:
        if self._linger is not None:
            return  # a refused body: dropped
        self._size += len(body)
        limit = self._limit_bytes
        if limit is not None and self._size > limit:
            self._parts = []
            self._start_linger(request_head.body_too_large(limit))
            return
        self._parts.append(body)

    def on_message_complete(self) -> None:
        self._between = True
        if self._linger is not None:
            raise _BodyDropped()
        incoming = self._incoming
        parts = self._parts
        if parts:
            incoming.body = parts[0] if len(parts) == 1 else b"".join(parts)
            self._parts = []
        incoming.size = self._head_size + self._size
        self._head_size = self._size = 0
        self._head_done = False
        self._in_head = True
        self._continue_owed = False
        self._queue.append(incoming)
        self._queued_bytes += incoming.size

    # -- pausing the client's bytes --------------------------------------------

    def _pause_reading(self, why: int) -> None:
        if not self._read_paused and not self._closed:
            self.transport.pauseProducing()  # type: ignore[union-attr]
        self._read_paused |= why

    def _resume_reading(self, why: int) -> None:
        was = self._read_paused
        self._read_paused &= ~why
        if was and not self._read_paused and not self._closed:
            self.transport.resumeProducing()  # type: ignore[union-attr]
