"""What a request head must be, beyond what the HTTP parser checks (pure: no I/O).

The listener parses with llhttp (through ``httptools``: Node.js's parser,
maintained and fuzzed by others), which already refuses a bare LF, a lone
CR, a NUL or other control byte in the head, a header name that is not a
token, obs-fold, a ``Content-Length`` that is not ``1*DIGIT`` or appears
twice, ``Transfer-Encoding`` together with ``Content-Length`` or not ending
in ``chunked``, chunk sizes that are not hex digits.  RFC 9112 asks for
more than a parser can know: the rules here (one ``Host``, a known
expectation, a supported version, bounded heads), each a 4xx or 5xx answer
that closes the connection.  ``docs/security.md`` lists them all, with
their RFC sections.
"""

from __future__ import annotations

from typing import Deque, Optional

from rolemesh.base.errors import ApiError

#: Most header lines a request may have (twisted.web allows 500).
MAX_HEADERS = 100
#: Longest request head, request line included (twisted.web's own limit).
MAX_HEAD_BYTES = 16384
#: The versions served; any other is a 505.
VERSIONS = ("1.1", "1.0")


def malformed(reason: str) -> ApiError:
    """The answer to bytes that are no valid HTTP/1.1 request."""
    return ApiError(400, f"malformed HTTP request: {reason}", "invalid_request_error", "bad_request")


def head_too_large() -> ApiError:
    return ApiError(431, f"the request head has more than {MAX_HEADERS} header lines or "
                         f"{MAX_HEAD_BYTES} bytes", "invalid_request_error", "headers_too_large")


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than {limit} bytes (max_request_body_bytes)",
                    "invalid_request_error", "request_too_large")


def unknown_method() -> ApiError:
    """llhttp knows every registered method; after any other, where the
    request ends cannot be known: a 400 and a close (twisted.web's Klein
    would say 405)."""
    return malformed("unknown HTTP method")


def head_error(version: str, hosts: int, expect: Optional[bytes]) -> Optional[ApiError]:
    """Why a parsed head cannot be served, or None.

    ``hosts`` is how many ``Host`` lines it had, ``expect`` its ``Expect``
    value (None without one)."""
    if version not in VERSIONS:
        return ApiError(505, f"HTTP/{version} is not supported (HTTP/1.1 is)", "invalid_request_error",
                        "http_version_not_supported")
    if hosts != 1 and (version == "1.1" or hosts > 1):  # RFC 9112 §3.2
        return malformed("an HTTP/1.1 request needs exactly one Host header" if version == "1.1" else
                         "more than one Host header")
    if expect is not None and expect.lower() != b"100-continue":  # RFC 9110 §10.1.1
        return ApiError(417, "the only expectation served is 100-continue", "invalid_request_error",
                        "expectation_failed")
    return None


def coding_error(codings: bytes) -> Optional[ApiError]:
    """501 for a ``Transfer-Encoding`` other than ``chunked`` alone (RFC 9112
    §6.1: a coding the server does not understand), 400 for one that does
    not end in ``chunked`` (§6.3), or None.  ``codings``:
    every ``Transfer-Encoding`` line's value, joined by commas."""
    listed = [c.strip().lower() for c in codings.split(b",") if c.strip()]
    if listed == [b"chunked"]:
        return None
    if not listed or listed[-1] != b"chunked":  # §6.3: where the body ends cannot be known
        return malformed("Transfer-Encoding must end in chunked")
    unknown = b", ".join(c for c in listed if c != b"chunked")[:100].decode("ascii", "replace")
    return ApiError(501, f"transfer coding {unknown!r} is not supported (only chunked is)",
                    "invalid_request_error", "not_implemented")


#: The headers the node reads (compares, decodes, parses or echoes): bytes
#: that are no UTF-8 in any of them are a 400 from the head, on every path
#: (twisted.web refuses such a Host itself).  Headers only passed on to a
#: child (``Accept``, ``Range``, ...) are not read, and may carry any
#: bytes RFC 9110 allows.  tests/http/test_fast_channel.py checks that every
#: header rolemesh/ asks for by name is here.
READ_FIELDS = frozenset({
    b"host", b"authorization", b"x-api-key", b"content-type", b"origin", b"access-control-request-headers",
    b"access-control-request-method", b"x-rolemesh-tenant", b"x-rolemesh-priority", b"x-request-id",
    b"x-conversation-id",
})


def field_error(name: bytes, value: bytes) -> Optional[ApiError]:
    """400 for a header of :data:`READ_FIELDS` whose bytes are no UTF-8, or None."""
    if value.isascii():
        return None
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return malformed(f"the {name.decode('ascii', 'replace')[:64]} header is not UTF-8")
    return None


def request_line_error(line: bytes) -> Optional[ApiError]:
    """400 for a request line (CRLF left out) that is not ``method SP
    target SP version`` with one space each (RFC 9112 §3), or None.  llhttp
    skips a run of spaces, and refuses every other byte out of place."""
    return None if line.count(b" ") == 2 else spaced_request_line()


def spaced_request_line() -> ApiError:
    return malformed("the request line must be method, target and version with one space between each")


_LINE, _HEAD, _BODY, _LOST = range(4)


class RequestLines:
    """Finds the request line of each request in the bytes the parser was
    fed, since llhttp says nowhere where one begins, and tells which breaks
    :func:`request_line_error`.

    It follows what llhttp already framed: a request begins after the
    empty lines before it, its head ends at the first empty line, and its
    body is the ``Content-Length`` llhttp found (given per request, in
    order, as ``framings``; -1 for chunked).  After a chunked body it does
    not know where the next request begins until the parser is between
    requests at the start of a read (:meth:`resync`); those lines go
    unchecked (llhttp still reads them as they are meant).  ``seq``: the
    number (from 0) of the request whose line comes next.
    """

    def __init__(self) -> None:
        self.seq = 0
        self._state = _LINE
        self._held = b""  # _LINE: the line so far; _HEAD: the last bytes read (at most 3)
        self._left = 0  # _BODY: its bytes still to come

    def resync(self, seq: int) -> None:
        """The parser is between requests: the next byte begins request ``seq``'s line."""
        self.seq = seq
        self._state = _LINE
        self._held = b""

    def feed(self, data: bytes, framings: "Deque[int]") -> Optional[int]:
        """The number of the first request in ``data`` whose line is refused, or None."""
        pos, size = 0, len(data)
        while pos < size:
            state = self._state
            if state == _LINE:
                if not self._held:
                    while pos < size and data[pos] in b"\r\n":
                        pos += 1
                    if pos == size:
                        return None
                end = data.find(b"\n", pos)
                if end < 0:
                    self._held += data[pos:]
                    if len(self._held) > MAX_HEAD_BYTES:
                        self._state = _LOST  # the parser refuses it (431)
                    return None
                line, self._held = self._held + data[pos:end], b"\r\n"
                if request_line_error(line.rstrip(b"\r")) is not None:
                    return self.seq
                self._state, pos = _HEAD, end + 1
            elif state == _HEAD:
                end = -1
                if self._held:
                    joined = self._held + data[pos:pos + 3]
                    found = joined.find(b"\r\n\r\n")
                    if found >= 0:
                        end = pos + found + 4 - len(self._held)
                if end < 0:
                    found = data.find(b"\r\n\r\n", pos)
                    if found < 0:
                        self._held = (self._held + data[pos:])[-3:]
                        return None
                    end = found + 4
                pos, self._held, self.seq = end, b"", self.seq + 1
                length = framings.popleft() if framings else -1
                if length < 0:
                    self._state = _LOST
                    return None
                self._state, self._left = _BODY, length
            elif state == _BODY:
                step = min(self._left, size - pos)
                pos += step
                self._left -= step
                if not self._left:
                    self._state = _LINE
            else:
                return None
        if self._state == _BODY and not self._left:
            self._state = _LINE
        return None


#: Heads the parser must refuse (httptools before 0.6.3 bundles an llhttp
#: that takes some of them): checked once, when the listener is built.
MUST_REFUSE = (
    b"GET / HTTP/1.1\nHost: x\n\n",  # bare LF
    b"GET / HTTP/1.1\r\nHost: x\rY: 1\r\n\r\n",  # lone CR
    b"GET / HTTP/1.1\r\nHost: x\r\nY: a\x00b\r\n\r\n",  # NUL
    b"GET / HTTP/1.1\r\nHost: x\r\nContent Type: v\r\n\r\n",  # a space in a name
    b"GET / HTTP/1.1\r\nHost: x\r\nY : v\r\n\r\n",  # a space before the colon
    b"GET / HTTP/1.1\r\nHost: x\r\n: v\r\n\r\n",  # an empty name
    b"GET / HTTP/1.1\r\nHost: x\r\nY: a\r\n b\r\n\r\n",  # obs-fold
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: \x0c1\r\n\r\na",  # not 1*DIGIT
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\na",  # twice
    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: identity\r\n\r\n",  # not ending in chunked
    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 1\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0x1\r\na\r\n0\r\n\r\n",  # not hex
)


def lax_parser() -> Optional[str]:
    """Why the installed ``httptools`` cannot be the listener's parser (it
    takes a head of :data:`MUST_REFUSE`), or None."""
    import httptools

    class _Ignore:
        pass

    for head in MUST_REFUSE:
        try:
            httptools.HttpRequestParser(_Ignore()).feed_data(head)
        except httptools.HttpParserError:
            continue
        version = getattr(httptools, "__version__", "?")
        return (f"httptools {version} accepts {head[:60]!r}, which the listener must refuse: "
                "install httptools>=0.6.3")
    return None


__all__ = ["MAX_HEADERS", "MAX_HEAD_BYTES", "MUST_REFUSE", "READ_FIELDS", "VERSIONS", "RequestLines", "body_too_large",
           "coding_error", "field_error", "head_error", "head_too_large", "lax_parser", "malformed",
           "request_line_error", "spaced_request_line", "unknown_method"]
