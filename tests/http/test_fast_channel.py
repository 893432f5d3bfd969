"""The client connection's fast path: parsing, answers, hand-off to twisted.web, deadlines."""

from __future__ import annotations

from typing import Any, List, Optional

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from rolemesh.http.fast_channel import FastChannel, FastRequest
from rolemesh.http.listener import GuardedSite
from rolemesh.http.request_reader import MAX_QUEUED

BODY = b'{"model": "m"}'


def post(path: bytes = b"/fast", body: bytes = BODY, extra: bytes = b"") -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: node\r\nContent-Type: application/json\r\n" + extra +
            b"Content-Length: %d\r\n\r\n" % len(body) + body)


class Route:
    """A route that records its requests and answers when told to."""

    def __init__(self) -> None:
        self.requests: List[FastRequest] = []
        self.results: List[Deferred] = []
        self.cancelled = 0

    def __call__(self, request: FastRequest) -> Deferred:
        self.requests.append(request)
        d: Deferred = Deferred(lambda _: self._cancel())
        self.results.append(d)
        return d

    def _cancel(self) -> None:
        self.cancelled += 1


def head_and_body(raw: bytes) -> tuple:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b": ")
        headers[name.lower()] = value
    return lines[0], headers, body


class ParserTests(SynchronousTestCase):
    def test_the_installed_parser_is_strict_enough(self) -> None:
        from rolemesh.http.request_head import lax_parser

        self.assertIsNone(lax_parser())

    def test_a_lax_parser_is_named(self) -> None:
        from rolemesh.http import request_head

        self.patch(request_head, "MUST_REFUSE", (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",))  # a valid head
        self.assertIn("install httptools>=0.6.3", request_head.lax_parser() or "")


class AnyBytesTests(SynchronousTestCase):
    @given(st.binary(max_size=300), st.integers(min_value=1, max_value=300))
    def test_any_bytes_are_answered_or_awaited_never_raised(self, data: bytes, split: int) -> None:
        """Whatever arrives, in whatever reads: no exception escapes the
        channel, and every answer it writes is a whole HTTP/1.1 answer."""
        route = Route()
        site = GuardedSite(SlowPath(), reactor=Clock(), max_body_bytes=100,
                           fast_routes={(b"POST", b"/fast"): route})
        channel = site.buildProtocol(None)
        transport = StringTransport()
        channel.makeConnection(transport)
        channel.dataReceived(data[:split])
        channel.dataReceived(data[split:])
        for result in route.results:
            result.callback(b"ok")
        out = transport.value()
        self.assertTrue(out == b"" or out.startswith(b"HTTP/1.1 "), out[:80])
        channel.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(site.open_connections, 0)


class SlowPath(Resource):
    isLeaf = True

    def render(self, request: Any) -> bytes:
        return b"slow path"


class ChannelTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1764540000)
        self.route = Route()
        self.site = GuardedSite(SlowPath(), reactor=self.clock, idle_timeout=60, request_read_timeout=10,
                                max_body_bytes=1000, fast_routes={(b"POST", b"/fast"): self.route})
        self.channel = self.site.buildProtocol(None)
        self.transport = StringTransport()
        self.channel.makeConnection(self.transport)

    def tearDown(self) -> None:
        if not self.channel.lost:
            self.channel.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(self.site.open_connections, 0)

    def test_is_a_fast_channel_counted_by_the_site(self) -> None:
        self.assertIsInstance(self.channel, FastChannel)
        self.assertEqual(self.site.open_connections, 1)

    def test_answer_with_a_body(self) -> None:
        self.channel.dataReceived(post(extra=b"Authorization: Bearer k\r\n"))
        (request,) = self.route.requests
        self.assertEqual(request.content.read(), BODY)
        self.assertEqual(request.getHeader(b"Authorization"), b"Bearer k")
        self.assertEqual((request.method, request.path), (b"POST", b"/fast"))
        request.setResponseCode(429)
        request.setHeader(b"retry-after", b"1")
        self.route.results[0].callback(b'{"error": 1}')
        status, headers, body = head_and_body(self.transport.value())
        self.assertEqual(status, b"HTTP/1.1 429 Too Many Requests")
        self.assertEqual(headers[b"content-length"], b"12")
        self.assertEqual(headers[b"retry-after"], b"1")
        self.assertEqual(headers[b"date"], b"Sun, 30 Nov 2025 22:00:00 GMT")
        self.assertEqual(body, b'{"error": 1}')
        self.assertTrue(request.finished)
        self.assertIn(b"\r\nRetry-After: 1\r\n", self.transport.value())  # names as twisted.web writes them

    def test_relayed_answer_with_its_own_length(self) -> None:
        self.channel.dataReceived(post())
        (request,) = self.route.requests
        request.setResponseCode(200, b"OK")
        request.responseHeaders.setRawHeaders(b"Content-Length", [b"5"])
        request.write(b"hel")
        request.write(b"lo")
        self.route.results[0].callback(None)
        status, headers, body = head_and_body(self.transport.value())
        self.assertEqual(headers[b"content-length"], b"5")
        self.assertNotIn(b"transfer-encoding", headers)
        self.assertEqual(body, b"hello")

    def test_stream_is_chunked(self) -> None:
        self.channel.dataReceived(post())
        (request,) = self.route.requests
        request.setHeader(b"content-type", b"text/event-stream")
        request.write(b"data: 1\n\n")
        request.write(b"")
        request.write(b"data: [DONE]\n\n")
        finished: List[Any] = []
        request.notifyFinish().addCallback(finished.append)
        self.route.results[0].callback(None)
        status, headers, body = head_and_body(self.transport.value())
        self.assertEqual(headers[b"transfer-encoding"], b"chunked")
        self.assertEqual(body, b"9\r\ndata: 1\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        self.assertEqual(finished, [None])

    def test_keep_alive_serves_the_next_request(self) -> None:
        self.channel.dataReceived(post())
        self.route.results[0].callback(b"one")
        self.channel.dataReceived(post(body=b'{"n": 2}'))
        self.assertEqual(len(self.route.requests), 2)
        self.assertEqual(self.route.requests[1].content.read(), b'{"n": 2}')
        self.route.results[1].callback(b"two")
        self.assertEqual(self.transport.value().count(b"HTTP/1.1 200 OK"), 2)
        self.assertFalse(self.transport.disconnecting)

    def test_connection_close_is_honoured(self) -> None:
        self.channel.dataReceived(post(extra=b"Connection: close\r\n"))
        self.route.results[0].callback(b"bye")
        self.assertIn(b"\r\nConnection: close\r\n", self.transport.value())
        self.assertTrue(self.transport.disconnecting)

    def test_body_in_two_reads(self) -> None:
        raw = post()
        self.channel.dataReceived(raw[:-5])
        self.assertEqual(self.route.requests, [])
        self.channel.dataReceived(raw[-5:])
        self.assertEqual(self.route.requests[0].content.read(), BODY)

    def test_pipelined_request_waits_for_the_answer(self) -> None:
        self.channel.dataReceived(post() + post(body=b'{"n": 2}'))
        self.assertEqual(len(self.route.requests), 1)
        self.assertEqual(self.transport.producerState, "producing")  # one waiting: reading goes on
        self.route.results[0].callback(b"one")
        self.assertEqual(len(self.route.requests), 2)
        self.assertEqual(self.route.requests[1].content.read(), b'{"n": 2}')

    def test_reading_pauses_while_many_requests_wait(self) -> None:
        self.channel.dataReceived(post() * (MAX_QUEUED + 2))
        self.assertEqual(self.transport.producerState, "paused")
        for n in range(MAX_QUEUED // 2 + 1):
            self.route.results[n].callback(b"ok")
        self.assertEqual(self.transport.producerState, "producing")
        while not self.route.results[-1].called:  # each answer lets the next request in
            self.route.results[-1].callback(b"ok")
        self.assertEqual(self.transport.value().count(b"HTTP/1.1 200 OK"), MAX_QUEUED + 2)

    def test_hundreds_of_pipelined_answers_at_once_in_a_loop(self) -> None:
        """300 requests in one read, each answered synchronously: all 300
        answered, without recursion (the old channel hit RecursionError)."""
        answered: List[FastRequest] = []
        self.site.fast_routes[(b"GET", b"/now")] = lambda request: (answered.append(request), succeed(b"ok"))[1]
        self.channel.dataReceived(b"GET /now HTTP/1.1\r\nHost: x\r\n\r\n" * 300)
        self.assertEqual(len(answered), 300)
        self.assertEqual(self.transport.value().count(b"HTTP/1.1 200 OK"), 300)
        self.assertFalse(self.transport.disconnecting)

    def test_a_refusal_behind_an_answer_drops_its_body_and_closes_in_its_turn(self) -> None:
        self.channel.dataReceived(post() + b"POST /fast HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
        self.channel.dataReceived(b"x" * 5000)  # read and dropped meanwhile (lingering.py)
        self.assertEqual(self.channel._parts, [])
        self.assertEqual(self.transport.producerState, "paused", "its body is over: nothing more is read")
        self.assertNotIn(b"413", self.transport.value())
        self.route.results[0].callback(b"one")
        self.assertIn(b"HTTP/1.1 413 ", self.transport.value())
        self.assertTrue(self.transport.disconnecting)

    def test_a_head_line_without_end_is_cut_off(self) -> None:
        """llhttp hands a header over only once its line ends (httptools holds
        it meanwhile): a line that never ends is refused 431 after a bound,
        not held without one."""
        self.channel.dataReceived(b"GET /fast HTTP/1.1\r\nHost: x\r\nX-Long: ")
        for _ in range(100):
            self.channel.dataReceived(b"a" * 4096)
        self.assertTrue(self.transport.value().startswith(b"HTTP/1.1 431 "), self.transport.value()[:100])
        self.assertTrue(self.transport.disconnecting)
        self.assertLess(self.channel._head_read, 200 << 10)

    def test_many_requests_in_many_reads_are_no_long_head(self) -> None:
        got = Route()
        self.site.fast_routes[(b"GET", b"/now")] = lambda request: succeed(b"ok")
        for _ in range(2000):  # 2000 requests in reads of 30: never a head of more than 30 bytes
            self.channel.dataReceived(b"GET /now HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(self.transport.value().count(b"HTTP/1.1 200 OK"), 2000)
        self.assertEqual(got.requests, [])

    def test_a_client_that_does_not_read_stops_being_read(self) -> None:
        self.channel.dataReceived(post())
        (request,) = self.route.requests
        upstream = StringTransport()
        request.registerProducer(upstream, True)
        self.channel.pauseProducing()  # what the transport does when its send buffer is full
        self.assertEqual(self.transport.producerState, "paused")
        self.assertEqual(upstream.producerState, "paused")
        self.channel.resumeProducing()
        self.assertEqual((self.transport.producerState, upstream.producerState), ("producing", "producing"))

    def test_client_gone_cancels_the_route(self) -> None:
        self.channel.dataReceived(post())
        (request,) = self.route.requests
        lost: List[Failure] = []
        request.notifyFinish().addErrback(lost.append)
        request.registerProducer(object(), True)
        self.channel.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(self.route.cancelled, 1)
        self.assertTrue(lost[0].check(ConnectionLost))
        self.assertTrue(request.disconnected)
        request.write(b"late")  # a late write or finish is dropped
        request.finish()
        self.assertEqual(self.transport.value(), b"")
        late: List[Failure] = []
        request.notifyFinish().addErrback(late.append)
        self.assertEqual(len(late), 1)

    def test_unexpected_route_failure_aborts_the_connection(self) -> None:
        self.channel.dataReceived(post())
        self.route.results[0].errback(ZeroDivisionError())
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        self.assertTrue(self.transport.disconnecting)

    def test_cancelled_route_logs_nothing(self) -> None:
        self.channel.dataReceived(post())
        self.route.results[0].errback(CancelledError())
        self.assertEqual(self.flushLoggedErrors(), [])

    def bridged(self, data: bytes) -> None:
        self.channel.dataReceived(data)
        self.assertEqual(self.route.requests, [])
        self.assertIsNotNone(self.channel._bridge)

    def test_other_routes_go_to_twisted_web_and_the_next_request_comes_back(self) -> None:
        self.bridged(b"GET /health HTTP/1.1\r\nHost: node\r\n\r\n")
        self.assertIn(b"slow path", self.transport.value())
        self.channel.dataReceived(post())  # the next request on the connection: the fast path again
        self.assertEqual(len(self.route.requests), 1)

    def test_what_twisted_web_answers(self) -> None:
        for data in (post(path=b"/fast?x=1"), post().replace(b"HTTP/1.1", b"HTTP/1.0")):
            self.setUp()
            self.bridged(data)
            self.assertIn(b"slow path", self.transport.value())
            self.tearDown()

    def test_twisted_web_gets_a_canonical_copy(self) -> None:
        seen: List[Any] = []

        class Echo(Resource):
            isLeaf = True

            def render(self, request: Any) -> bytes:
                seen.append((request.requestHeaders.getRawHeaders(b"content-length"),
                             request.requestHeaders.getRawHeaders(b"transfer-encoding"),
                             request.requestHeaders.getRawHeaders(b"expect"), request.content.read()))
                return b"ok"

        self.site.resource = Echo()
        self.channel.dataReceived(b"POST /other HTTP/1.1\r\nHost: n\r\nTransfer-Encoding: chunked\r\n"
                                  b"Expect: 100-continue\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        self.assertEqual(seen, [([b"5"], None, None, b"abcde")])

    def test_chunked_and_expecting_bodies_are_served_on_the_fast_path(self) -> None:
        self.channel.dataReceived(b"POST /fast HTTP/1.1\r\nHost: n\r\nTransfer-Encoding: chunked\r\n\r\n"
                                  b"3\r\nabc\r\n0\r\n\r\n")
        self.assertEqual(self.route.requests[0].content.read(), b"abc")
        self.route.results[0].callback(b"ok")
        self.channel.dataReceived(post(extra=b"Expect: 100-continue\r\n"))
        self.assertEqual(self.route.requests[1].content.read(), BODY)
        self.assertNotIn(b"100 Continue", self.transport.value(), "the body came with the head: no 100")

    def test_100_continue_only_when_the_client_waits_and_nothing_is_ahead(self) -> None:
        raw = post(extra=b"Expect: 100-continue\r\n")
        head, body = raw[:-len(BODY)], raw[-len(BODY):]
        self.channel.dataReceived(head)
        self.assertEqual(self.transport.value(), b"HTTP/1.1 100 Continue\r\n\r\n")
        self.channel.dataReceived(body)
        self.assertEqual(self.route.requests[0].content.read(), BODY)

    def test_100_continue_waits_for_the_answer_ahead(self) -> None:
        raw = post(extra=b"Expect: 100-continue\r\n")
        self.channel.dataReceived(post() + raw[:-len(BODY)])
        self.assertNotIn(b"100 Continue", self.transport.value())
        self.route.results[0].callback(b"one")
        self.assertTrue(self.transport.value().endswith(b"one" + b"HTTP/1.1 100 Continue\r\n\r\n"))

    def test_another_method_on_a_fast_path_goes_to_twisted_web(self) -> None:
        for data in (b"HEAD /models HTTP/1.1\r\nHost: node\r\n\r\n",
                     b"GET /fast HTTP/1.1\r\nHost: node\r\n\r\n"):
            self.setUp()
            got = Route()
            self.site.fast_routes[(b"GET", b"/models")] = got
            self.channel.dataReceived(data)
            self.assertEqual((got.requests, self.route.requests), ([], []), data)
            self.assertIsNotNone(self.channel._bridge)
            self.tearDown()

    def test_a_get_route_needs_no_body_and_keeps_the_connection_fast(self) -> None:
        got = Route()
        self.site.fast_routes[(b"GET", b"/models")] = got
        self.channel.dataReceived(b"GET /models HTTP/1.1\r\nHost: node\r\n\r\n")
        (request,) = got.requests
        self.assertEqual((request.method, request.path, request.content.read()), (b"GET", b"/models", b""))
        got.results[0].callback(b"[]")
        self.assertTrue(self.transport.value().endswith(b"\r\n\r\n[]"))
        self.channel.dataReceived(post())
        self.assertEqual(len(self.route.requests), 1)
        self.assertIsNone(self.channel._bridge)

    def test_bridged_connection_is_counted_once(self) -> None:
        self.bridged(b"GET /health HTTP/1.1\r\nHost: node\r\n\r\n")
        self.channel.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(self.site.open_connections, 0)

    def test_partial_request_hits_the_read_deadline(self) -> None:
        self.clock.advance(9)
        self.channel.dataReceived(post()[:-3])
        self.clock.advance(1)
        self.assertTrue(self.transport.disconnecting)

    def test_deadline_counts_from_the_last_answer(self) -> None:
        self.clock.advance(5)
        self.channel.dataReceived(post())
        self.clock.advance(20)  # answering: no deadline
        self.assertFalse(self.transport.disconnecting)
        self.route.results[0].callback(b"x")
        self.clock.advance(9.9)
        self.assertFalse(self.transport.disconnecting)
        self.clock.advance(0.1)
        self.assertTrue(self.transport.disconnecting)

    def test_no_timer_left_after_close(self) -> None:
        self.channel.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(self.clock.getDelayedCalls(), [])


class WithoutFastRoutesTests(SynchronousTestCase):
    def test_every_request_goes_to_twisted_web_after_the_same_checks(self) -> None:
        site = GuardedSite(SlowPath(), reactor=Clock())
        channel = site.buildProtocol(None)
        self.assertIsInstance(channel, FastChannel)
        transport = StringTransport()
        channel.makeConnection(transport)
        channel.dataReceived(post(path=b"/fast") + b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n")
        out = transport.value()
        self.assertIn(b"slow path", out)
        self.assertIn(b"HTTP/1.1 400 Bad Request", out)
        self.assertTrue(transport.disconnecting)
        channel.connectionLost(Failure(ConnectionDone()))


def _unused(_: Optional[Any]) -> Deferred:
    return succeed(None)


class CapTests(SynchronousTestCase):
    def test_the_connection_cap_counts_fast_channels(self) -> None:
        site = GuardedSite(SlowPath(), reactor=Clock(), max_connections=2, fast_routes={(b"POST", b"/fast"): Route()})
        first, second = site.buildProtocol(None), site.buildProtocol(None)
        self.assertIsNone(site.buildProtocol(None), "a third is refused")
        for channel in (first, second):
            channel.makeConnection(StringTransport())
        first.connectionLost(Failure(ConnectionDone()))
        self.assertIsInstance(site.buildProtocol(None), FastChannel, "a place is free again")


class BigBodyTests(SynchronousTestCase):
    def test_a_body_in_many_reads_is_joined_once(self) -> None:
        route = Route()
        site = GuardedSite(SlowPath(), reactor=Clock(), max_body_bytes=1 << 20,
                           fast_routes={(b"POST", b"/fast"): route})
        channel = site.buildProtocol(None)
        channel.makeConnection(StringTransport())
        body = b'{"model": "m", "prompt": "' + b"x" * 300_000 + b'"}'
        raw = post(body=body) + post()  # and a pipelined one behind it
        for i in range(0, len(raw), 4096):
            channel.dataReceived(raw[i:i + 4096])
        self.assertEqual([r.content.read() for r in route.requests], [body])
        route.results[0].callback(b"ok")
        self.assertEqual([r.content.read() for r in route.requests], [body, BODY])
        channel.connectionLost(Failure(ConnectionDone()))


class HeaderTests(SynchronousTestCase):
    def test_no_line_break_reaches_the_head(self) -> None:
        route = Route()
        site = GuardedSite(SlowPath(), reactor=Clock(), fast_routes={(b"POST", b"/fast"): route})
        channel = site.buildProtocol(None)
        transport = StringTransport()
        channel.makeConnection(transport)
        channel.dataReceived(post())
        request = route.requests[0]
        request.responseHeaders.setRawHeaders(b"X-From-Child", [b"a\r\nSet-Cookie: evil", b"b\nc", b"d\re"])
        request.setHeader(b"x-bad\nname", b"v")
        route.results[0].callback(b"ok")
        head = transport.value().split(b"\r\n\r\n")[0]
        self.assertNotIn(b"\nSet-Cookie", head)
        self.assertIn(b"X-From-Child: a Set-Cookie: evil\r\n", head)
        self.assertIn(b"X-From-Child: b c\r\n", head)
        self.assertIn(b"X-From-Child: d e\r\n", head)
        self.assertIn(b"X-Bad name: v\r\n", head)
        self.assertEqual(head.count(b"\n"), head.count(b"\r\n"))
        channel.connectionLost(Failure(ConnectionDone()))
