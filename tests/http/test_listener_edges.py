"""The listener's edges (issue 38): one space between the parts of a request
line, UTF-8 in every header the node reads, and the lingering close after a
refusal made from the head.  Fakes only: StringTransport, task.Clock."""

from __future__ import annotations

import json
import os
import re
from collections import deque
from typing import Any, List, Mapping, Optional, Tuple

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base.errors import ApiError
from rolemesh.http import lingering, request_head
from rolemesh.http.listener import GuardedSite
from tests.fixtures import REPO
from tests.http.test_fast_channel import Route, SlowPath

ROLEMESH = os.path.join(REPO, "rolemesh")


class KeyPolicy:
    """A head policy: 401 without ``Authorization: Bearer k``."""

    def refuse_head(self, method: bytes, path: bytes, headers: Mapping[bytes, bytes]) -> Optional[ApiError]:
        if headers.get(b"authorization") != b"Bearer k":
            return ApiError(401, "missing or invalid API key", "invalid_request_error", "invalid_api_key")
        return None

    def cors_origin(self, origin: bytes) -> Optional[bytes]:
        return None


def statuses(out: bytes) -> List[int]:
    return [int(m) for m in re.findall(rb"HTTP/1.1 (\d{3}) ", out)]


class Connection:
    """A channel of a GuardedSite on a StringTransport, with one fast route
    (``POST /fast``, ``GET /fast``) answering at once; other paths go to
    twisted.web (SlowPath)."""

    def __init__(self, test: SynchronousTestCase, policy: Any = None, max_body_bytes: Optional[int] = 1000) -> None:
        self.clock = Clock()
        self.clock.advance(1764540000)
        self.route = Route()
        self.site = GuardedSite(SlowPath(), reactor=self.clock, idle_timeout=600, request_read_timeout=300,
                                max_body_bytes=max_body_bytes, head_policy=policy,
                                fast_routes={(b"POST", b"/fast"): self.answer, (b"GET", b"/fast"): self.answer})
        self.channel = self.site.buildProtocol(None)
        self.transport = StringTransport()
        self.channel.makeConnection(self.transport)
        test.addCleanup(self.lose)

    def answer(self, request: Any) -> Any:
        d = self.route(request)
        d.callback(b"ok")
        return d

    def send(self, *pieces: bytes) -> bytes:
        for piece in pieces:
            self.channel.dataReceived(piece)
        return self.transport.value()

    def lose(self) -> None:
        if not self.channel.lost:
            self.channel.connectionLost(Failure(ConnectionDone()))


def get(path: bytes = b"/fast", line: Optional[bytes] = None) -> bytes:
    return (line or b"GET " + path + b" HTTP/1.1") + b"\r\nHost: n\r\n\r\n"


def post(path: bytes = b"/fast", body: bytes = b"{}", extra: bytes = b"") -> bytes:
    return b"POST " + path + b" HTTP/1.1\r\nHost: n\r\n" + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body


SPACED = (b"GET  /fast HTTP/1.1", b"GET /fast  HTTP/1.1", b"GET   /fast   HTTP/1.1")


class RequestLineTests(SynchronousTestCase):
    """RFC 9112 §3: exactly one SP between method, target and version (llhttp skips a run of them)."""

    def test_two_spaces_are_400_and_a_close_on_both_paths(self) -> None:
        for path in (b"/fast", b"/other"):  # the fast path, and twisted.web behind it
            for line in SPACED:
                c = Connection(self)
                out = c.send(get(line=line.replace(b"/fast", path)))
                self.assertEqual(statuses(out), [400], out)
                body = json.loads(out.partition(b"\r\n\r\n")[2])
                self.assertEqual(body["error"]["code"], "bad_request")
                self.assertIn("one space", body["error"]["message"])
                self.assertTrue(c.transport.disconnecting)
                self.assertEqual(c.route.requests, [])

    def test_one_space_is_served(self) -> None:
        c = Connection(self)
        self.assertEqual(statuses(c.send(get(), get(b"/other"), get())), [200, 200, 200])

    def test_a_spaced_line_split_over_reads(self) -> None:
        c = Connection(self)
        data = post() + get(line=SPACED[1])
        out = c.send(*[data[i:i + 3] for i in range(0, len(data), 3)])
        self.assertEqual(statuses(out), [200, 400], out)

    def test_behind_pipelined_requests_in_one_read(self) -> None:
        c = Connection(self)
        out = c.send(get() + post(body=b"x" * 50) + b"\r\n" + get(line=SPACED[0]) + get())
        self.assertEqual(statuses(out), [200, 200, 400], out)
        self.assertEqual(len(c.route.requests), 2, "nothing after the refusal is served")

    def test_a_chunked_body_that_holds_a_spaced_line_is_no_request_line(self) -> None:
        hidden = b"GET  /fast HTTP/1.1\r\n\r\n"
        chunked = (b"POST /fast HTTP/1.1\r\nHost: n\r\nTransfer-Encoding: chunked\r\n\r\n"
                   + b"%x\r\n%s\r\n0\r\n\r\n" % (len(hidden), hidden))
        c = Connection(self)
        self.assertEqual(statuses(c.send(chunked + get(), get())), [200, 200, 200])
        self.assertEqual(c.route.requests[0].content.read(), hidden)
        c = Connection(self)
        self.assertEqual(statuses(c.send(post(body=hidden) + get())), [200, 200])

    @given(st.lists(st.tuples(st.sampled_from(["get", "post", "spaced"]), st.binary(max_size=30)), min_size=1,
                    max_size=6),
           st.integers(min_value=1, max_value=5))
    def test_the_first_spaced_line_is_refused_wherever_the_reads_split(self, kinds: List[Tuple[str, bytes]],
                                                                         pieces: int) -> None:
        """Content-Length bodies of any bytes (spaced request lines in them
        too), pipelined, in any reads: every request before the first
        spaced line is served, that one is 400, nothing after it."""
        data = b""
        expected: List[int] = []
        for kind, body in kinds:
            if kind == "spaced":
                data += get(line=SPACED[len(body) % 3])
                expected.append(400)
                break
            data += get() if kind == "get" else post(body=body + b"GET  / HTTP/1.1\r\n\r\n")
            expected.append(200)
        c = Connection(self)
        step = max(1, -(-len(data) // pieces))
        out = c.send(*[data[i:i + step] for i in range(0, len(data), step)])
        self.assertEqual(statuses(out), expected, out)
        c.lose()

    def test_the_tracker_alone(self) -> None:
        lines = request_head.RequestLines()
        framings = deque([0])
        self.assertIsNone(lines.feed(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", framings))
        self.assertEqual(lines.feed(b"\r\nGET  / HTTP/1.1\r\n", deque()), 1)


class ReadFieldTests(SynchronousTestCase):
    """Bytes that are no UTF-8 in a header the node reads: 400 from the head, on every path."""

    def test_every_header_the_node_reads_is_checked(self) -> None:
        asked = set()
        for root, _, files in os.walk(ROLEMESH):
            for name in files:
                if name.endswith(".py") and name != "child_client.py":  # a child's answers, not a client's request
                    with open(os.path.join(root, name), encoding="utf-8") as f:
                        source = f.read()
                    asked |= set(re.findall(r'(?:getHeader|headers\.get)\(b"([A-Za-z0-9-]+)"', source))
        self.assertTrue({"authorization", "origin", "x-conversation-id"} <= asked, asked)
        self.assertEqual(asked - {"content-length"} - {n.decode() for n in request_head.READ_FIELDS}, set())

    def test_no_utf8_is_400_on_both_paths(self) -> None:
        for name in sorted(request_head.READ_FIELDS):
            for path in (b"/fast", b"/other"):
                for value in (b"\xff\xfe", b"a\xc3", b"Bearer \x80"):
                    c = Connection(self)
                    head = get(path).replace(b"Host: n\r\n", b"") if name == b"host" else get(path)
                    out = c.send(head.replace(b"\r\n\r\n", b"\r\n" + name + b": " + value + b"\r\n\r\n"))
                    self.assertEqual(statuses(out), [400], (name, path, out))
                    message = json.loads(out.partition(b"\r\n\r\n")[2])["error"]["message"]
                    self.assertEqual(message, f"malformed HTTP request: the {name.decode()} header is not UTF-8")
                    self.assertTrue(c.transport.disconnecting)

    def test_utf8_beyond_ascii_and_unread_headers_pass(self) -> None:
        c = Connection(self)
        out = c.send(get().replace(b"Host: n", b"Host: n\xc3\xa9\r\nX-Request-Id: \xc3\xa9\r\nAccept: \xff"))
        self.assertEqual(statuses(out), [200], out)


class LingerTests(SynchronousTestCase):
    """A refusal from the head, with a body to follow: answered at once, the
    body read and dropped (never kept) until it ends or a bound passes."""

    def keyless(self, length: bytes = b"100000", policy: Any = None, **kw: Any) -> Connection:
        c = Connection(self, policy or KeyPolicy(), max_body_bytes=None, **kw)
        out = c.send(b"POST /fast HTTP/1.1\r\nHost: n\r\nContent-Length: " + length + b"\r\n\r\n")
        self.assertEqual(statuses(out), [401], out)
        self.assertFalse(c.transport.disconnecting, "it reads on")
        return c

    def test_the_body_is_dropped_and_the_connection_closes_when_it_ends(self) -> None:
        c = self.keyless()
        for _ in range(99):
            c.send(b"x" * 1000)
            self.assertEqual(c.channel._parts, [])
            self.assertFalse(c.transport.disconnecting)
        c.send(b"x" * 1000 + get())  # its end, and a request after it: not read
        self.assertTrue(c.transport.disconnecting)
        self.assertEqual(statuses(c.transport.value()), [401])
        self.assertEqual(c.route.requests, [])

    def test_a_client_that_sends_without_end_is_cut_at_the_total_time(self) -> None:
        c = self.keyless(b"100000000000")
        for _ in range(int(lingering.TOTAL_S) - 1):
            c.clock.advance(1)
            c.send(b"x" * 100)
        self.assertFalse(c.transport.disconnecting)
        c.clock.advance(1)
        self.assertTrue(c.transport.disconnecting)
        self.assertEqual(c.transport.producerState, "paused")
        self.assertEqual(c.clock.getDelayedCalls(), [])

    def test_a_client_that_stops_sending_is_cut_at_the_idle_time(self) -> None:
        c = self.keyless()
        c.clock.advance(3)
        c.send(b"x" * 100)
        c.clock.advance(lingering.IDLE_S - 0.1)
        self.assertFalse(c.transport.disconnecting)
        c.clock.advance(0.1)
        self.assertTrue(c.transport.disconnecting)

    def test_a_client_that_sends_without_end_is_cut_at_the_byte_bound(self) -> None:
        c = self.keyless(b"100000000000")
        chunk = b"x" * (1 << 20)
        for _ in range(lingering.MAX_BYTES >> 20):
            c.send(chunk)
        self.assertFalse(c.transport.disconnecting)
        c.send(b"x")
        self.assertTrue(c.transport.disconnecting)
        self.assertEqual(lingering.max_bytes(100 << 20), 200 << 20, "twice a larger body limit")

    def test_a_chunked_body_over_the_limit_is_413_then_dropped_to_its_end(self) -> None:
        c = Connection(self)
        c.send(b"POST /fast HTTP/1.1\r\nHost: n\r\nTransfer-Encoding: chunked\r\n\r\n")
        out = c.send(b"800\r\n" + b"x" * 0x800 + b"\r\n")
        self.assertEqual(statuses(out), [413], out)
        self.assertFalse(c.transport.disconnecting)
        c.send(b"800\r\n" + b"x" * 0x800 + b"\r\n")
        self.assertEqual(c.channel._parts, [])
        c.send(b"0\r\n\r\n")
        self.assertTrue(c.transport.disconnecting)

    def test_a_declared_body_over_the_limit_is_413_and_dropped(self) -> None:
        c = Connection(self)
        out = c.send(b"POST /fast HTTP/1.1\r\nHost: n\r\nContent-Length: 5000\r\n\r\n" + b"x" * 4000)
        self.assertEqual(statuses(out), [413], out)
        self.assertFalse(c.transport.disconnecting)
        c.send(b"x" * 1000)
        self.assertTrue(c.transport.disconnecting)

    def test_an_expecting_client_sends_no_body_and_is_closed_at_once(self) -> None:
        c = Connection(self, KeyPolicy())
        out = c.send(b"POST /fast HTTP/1.1\r\nHost: n\r\nExpect: 100-continue\r\nContent-Length: 10\r\n\r\n")
        self.assertEqual(statuses(out), [401], out)
        self.assertTrue(c.transport.disconnecting)

    def test_a_lingering_connection_counts_against_max_connections(self) -> None:
        c = self.keyless()
        self.assertEqual(c.site.open_connections, 1)
        c.site.max_connections = 1
        self.assertIsNone(c.site.buildProtocol(None))
        c.clock.advance(lingering.IDLE_S)
        c.lose()
        self.assertEqual(c.site.open_connections, 0)
        self.assertEqual(c.clock.getDelayedCalls(), [])

    def test_the_refusal_waits_its_turn_and_the_close_waits_for_both(self) -> None:
        c = Connection(self, KeyPolicy())
        route = Route()
        c.site.fast_routes[(b"POST", b"/slow")] = route
        c.channel._routes = c.site.fast_routes
        c.send(post(b"/slow", extra=b"Authorization: Bearer k\r\n")
               + b"POST /fast HTTP/1.1\r\nHost: n\r\nContent-Length: 10\r\n\r\n0123")
        self.assertEqual(statuses(c.transport.value()), [])
        route.results[0].callback(b"slow")
        self.assertEqual(statuses(c.transport.value()), [200, 401])
        self.assertFalse(c.transport.disconnecting, "its body is still to come")
        c.send(b"456789")
        self.assertTrue(c.transport.disconnecting)

    def test_the_read_deadline_does_not_cut_a_lingering_client_early(self) -> None:
        c = self.keyless(b"100000000000")
        c.site.request_read_timeout = 1
        for _ in range(10):
            c.clock.advance(1)
            c.send(b"x")
        self.assertFalse(c.transport.disconnecting)
