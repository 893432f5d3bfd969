"""rolemesh.http.child_client: the proxy's HTTP/1.1 client for children, over fake connections."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet import defer, tcp
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import _WrappingProtocol
from twisted.internet.error import ConnectError, ConnectionDone, ConnectionLost, ConnectionRefusedError
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol, connectionDone
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseDone, ResponseFailed, ResponseNeverReceived
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from zope.interface.verify import verifyObject

from rolemesh.event_loop.twisted_compat import never_sent
from rolemesh.http.child_client import BadResponse, ChildAgent, ChildConnection, _without_wrapper, parse_head
from rolemesh.http.proxy import BytesProducer

URL = b"http://127.0.0.1:20000/v1/chat/completions"
HEADERS = Headers({b"content-type": [b"application/json"]})


class Body(Protocol):
    """Records what a body protocol is given."""

    def __init__(self) -> None:
        self.chunks: List[bytes] = []
        self.reason: Optional[Failure] = None

    def dataReceived(self, data: bytes) -> None:
        self.chunks.append(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.reason = reason

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)


class Transport(StringTransport):
    def __init__(self) -> None:
        super().__init__()
        self.aborted = 0

    def abortConnection(self) -> None:
        self.aborted += 1
        self.loseConnection()


class ChildAgentTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.agent = ChildAgent(self.reactor, persistent=True, max_per_host=2)
        self.connected: List[Tuple[Any, Transport]] = []

    def send(self, body: bytes = b'{"x": 1}', agent: Optional[ChildAgent] = None) -> defer.Deferred:
        return (agent or self.agent).request(b"POST", URL, HEADERS, BytesProducer(body))

    def connect(self, index: int = -1) -> Tuple[Any, Transport]:
        """Complete the pending TCP connection attempt ``index``."""
        host, port, factory, timeout, _ = self.reactor.tcpClients[index]
        self.assertEqual((host, port), ("127.0.0.1", 20000))
        protocol: Any = factory.buildProtocol(None)
        transport = Transport()
        protocol.makeConnection(transport)
        self.connected.append((protocol, transport))
        return protocol, transport

    def answer(self, protocol: Any, *segments: bytes) -> None:
        for segment in segments:
            protocol.dataReceived(segment)

    def test_the_request_goes_out_in_one_write(self) -> None:
        self.send(b'{"x": 1}')
        _, transport = self.connect()
        self.assertEqual(
            transport.value(),
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:20000\r\nContent-Type: application/json\r\n"
            b'Content-Length: 8\r\n\r\n{"x": 1}')

    def test_a_sized_answer_that_came_whole_is_taken_at_once(self) -> None:
        d = self.send()
        protocol, transport = self.connect()
        self.answer(protocol, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
        response = self.successResultOf(d)
        self.assertEqual(response.whole_body(), b"hello")
        self.assertIsNone(response.whole_body(), "taken once")
        self.send()
        self.assertEqual(len(self.reactor.tcpClients), 1, "the connection was pooled again, and is reused")

    def test_a_body_still_coming_or_streamed_is_delivered(self) -> None:
        d = self.send()
        protocol, _ = self.connect()
        self.answer(protocol, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel")
        response = self.successResultOf(d)
        self.assertIsNone(response.whole_body())
        body = Body()
        response.deliverBody(body)
        self.answer(protocol, b"lo")
        self.assertEqual(b"".join(body.chunks), b"hello")
        d = self.send()
        self.answer(protocol, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n")
        self.assertIsNone(self.successResultOf(d).whole_body(), "a stream under way goes through its body protocol")

    def test_a_body_from_any_producer(self) -> None:
        class Producer:
            length = 3

            def startProducing(self, consumer: Any) -> defer.Deferred:
                consumer.write(b"ab")
                consumer.write(b"c")
                return defer.succeed(None)

        self.agent.request(b"POST", URL, None, Producer())
        _, transport = self.connect()
        self.assertTrue(transport.value().endswith(b"Content-Length: 3\r\n\r\nabc"))

    def test_a_sized_answer_then_the_connection_is_reused(self) -> None:
        d = self.send()
        protocol, transport = self.connect()
        self.answer(protocol, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-A: 1\r\nX-A: 2\r\n"
                              b"Content-Length: 5\r\n\r\nhel")
        response = self.successResultOf(d)
        self.assertEqual((response.code, response.phrase, response.length), (200, b"OK", 5))
        self.assertEqual(response.headers.getRawHeaders(b"Content-Type"), [b"application/json"])
        self.assertIn((b"x-a", [b"1", b"2"]), list(response.headers.getAllRawHeaders()))
        body = Body()
        response.deliverBody(body)
        self.assertEqual(body.data, b"hel")
        self.assertIsNone(body.reason)
        self.answer(protocol, b"lo")
        self.assertEqual(body.data, b"hello")
        assert body.reason is not None
        body.reason.trap(ResponseDone)
        self.assertFalse(transport.disconnecting, "a kept-alive connection stays open")
        transport.clear()
        self.send()
        self.assertEqual(len(self.reactor.tcpClients), 1, "the next request reuses the connection")
        self.assertTrue(transport.value().startswith(b"POST /v1/chat/completions HTTP/1.1\r\n"))

    @given(st.lists(st.integers(min_value=1, max_value=40), max_size=30), st.booleans())
    def test_chunked_answers_in_any_segmentation(self, cuts: List[int], trailer: bool) -> None:
        reactor = MemoryReactorClock()
        agent = ChildAgent(reactor)
        events = [b'data: {"n": %d}\n\n' % i for i in range(6)] + [b"data: [DONE]\n\n"]
        wire = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(e), e) if i == 2 else b"%x\r\n%s\r\n" % (len(e), e)
                        for i, e in enumerate(events))
        wire += b"0\r\nX-Trailer: t\r\n\r\n" if trailer else b"0\r\n\r\n"
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        d = agent.request(b"POST", URL, HEADERS, BytesProducer(b"{}"))
        _, _, factory, _, _ = reactor.tcpClients[0]
        protocol: Any = factory.buildProtocol(None)
        transport = Transport()
        protocol.makeConnection(transport)
        data, segments, pos = head + wire, [], 0
        for cut in cuts:
            segments.append(data[pos:pos + cut])
            pos += cut
        segments.append(data[pos:])
        body = Body()
        for segment in segments:
            if segment:
                protocol.dataReceived(segment)
        response = self.successResultOf(d)
        response.deliverBody(body)
        self.assertEqual(body.data, b"".join(events))
        assert body.reason is not None
        body.reason.trap(ResponseDone)
        self.assertTrue(transport.disconnecting, "llama-server closes after a stream: not pooled")
        self.assertEqual(agent._idle, {})

    def test_the_events_of_one_segment_arrive_as_one_write(self) -> None:
        d = self.send()
        protocol, _ = self.connect()
        self.answer(protocol, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        body = Body()
        self.successResultOf(d).deliverBody(body)
        self.answer(protocol, b"3\r\nabc\r\n2\r\nde\r\n1\r\nf\r\n")
        self.assertEqual(body.chunks, [b"abcdef"])

    def test_nothing_before_the_close_is_never_received(self) -> None:
        d = self.send()
        protocol, _ = self.connect()
        protocol.connectionLost(Failure(ConnectionDone()))
        failure = self.failureResultOf(d, ResponseNeverReceived)
        self.assertTrue(never_sent(failure), "the proxy may retry it on a fresh connection")

    def test_a_close_mid_head_is_a_failed_response(self) -> None:
        d = self.send()
        protocol, _ = self.connect()
        self.answer(protocol, b"HTTP/1.1 200 OK\r\nContent-")
        protocol.connectionLost(Failure(ConnectionLost()))
        failure = self.failureResultOf(d, ResponseFailed)
        self.assertFalse(never_sent(failure), "the child saw the request: not retried")

    def test_a_close_mid_body_fails_the_body(self) -> None:
        d = self.send()
        protocol, _ = self.connect()
        self.answer(protocol, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        body = Body()
        self.successResultOf(d).deliverBody(body)
        protocol.connectionLost(Failure(ConnectionLost("child died")))
        self.assertEqual(body.data, b"abc")
        assert body.reason is not None
        self.assertTrue(body.reason.check(ResponseFailed))
        self.assertEqual(self.agent._idle, {}, "a broken connection is not pooled")

    def test_an_unframed_body_ends_with_the_close(self) -> None:
        d = self.send()
        protocol, _ = self.connect()
        self.answer(protocol, b"HTTP/1.1 200 OK\r\n\r\npart")
        body = Body()
        self.successResultOf(d).deliverBody(body)
        protocol.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(body.data, b"part")
        assert body.reason is not None
        body.reason.trap(PotentialDataLoss)

    def test_connection_close_is_not_reused(self) -> None:
        d = self.send()
        protocol, transport = self.connect()
        self.answer(protocol, b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
        body = Body()
        self.successResultOf(d).deliverBody(body)
        assert body.reason is not None
        body.reason.trap(ResponseDone)
        self.assertTrue(transport.disconnecting)
        self.send()
        self.assertEqual(len(self.reactor.tcpClients), 2, "a new connection")

    def test_a_fresh_agent_asks_for_close_and_never_pools(self) -> None:
        fresh = ChildAgent(self.reactor, persistent=False)
        d = self.send(agent=fresh)
        protocol, transport = self.connect()
        self.assertIn(b"\r\nConnection: close\r\n", transport.value())
        self.answer(protocol, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        self.successResultOf(d).deliverBody(Body())
        self.assertTrue(transport.disconnecting)
        self.assertEqual(fresh._idle, {})

    def test_a_pooled_connection_closed_by_the_child_is_dropped(self) -> None:
        d = self.send()
        protocol, _ = self.connect()
        self.answer(protocol, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.successResultOf(d).deliverBody(Body())
        protocol.connectionLost(Failure(ConnectionDone()))  # llama-server closed it while idle
        self.send()
        self.assertEqual(len(self.reactor.tcpClients), 2, "not the closed one")

    def test_idle_connections_are_capped(self) -> None:
        pending = [self.send() for _ in range(3)]
        conns = [self.connect(i) for i in range(3)]
        for (protocol, _), d in zip(conns, pending):
            self.answer(protocol, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            self.successResultOf(d).deliverBody(Body())
        self.assertEqual(len(self.agent._idle[("127.0.0.1", 20000)]), 2)
        self.assertEqual([t.aborted for _, t in conns], [0, 0, 1])

    def test_refused_is_a_connect_error(self) -> None:
        d = self.send()
        _, _, factory, _, _ = self.reactor.tcpClients[0]
        factory.clientConnectionFailed(self.reactor.connectors[0], Failure(ConnectionRefusedError()))
        self.failureResultOf(d, ConnectError)

    def test_cancel_while_connecting(self) -> None:
        d = self.send()
        d.cancel()
        self.failureResultOf(d, defer.CancelledError)
        self.assertEqual(self.reactor.connectors[0].stoppedConnecting, True)

    def test_cancel_before_the_answer_closes_the_connection(self) -> None:
        d = self.send()
        protocol, transport = self.connect()
        d.cancel()
        self.failureResultOf(d, defer.CancelledError)
        self.assertEqual(transport.aborted, 1, "llama-server sees the close and stops generating")
        protocol.connectionLost(Failure(ConnectionLost()))  # no second result

    def test_the_body_transport_is_the_upstream_push_producer(self) -> None:
        d = self.send()
        protocol, transport = self.connect()
        self.answer(protocol, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        body = Body()
        self.successResultOf(d).deliverBody(body)
        producer: Any = body.transport
        verifyObject(IPushProducer, producer)
        producer.pauseProducing()
        self.assertEqual(transport.producerState, "paused")
        producer.resumeProducing()
        self.assertEqual(transport.producerState, "producing")

    def test_a_pooled_connection_is_never_left_paused(self) -> None:
        d = self.send()
        protocol, transport = self.connect()
        self.answer(protocol, b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab")
        body = Body()
        self.successResultOf(d).deliverBody(body)
        producer: Any = body.transport
        producer.pauseProducing()
        self.assertEqual(transport.producerState, "paused")
        self.answer(protocol, b"cd")
        self.assertEqual(transport.producerState, "producing")
        self.assertEqual(len(self.agent._idle[("127.0.0.1", 20000)]), 1, "pooled")
        # The connection may serve another request now: late calls are no-ops.
        self.send()
        producer.pauseProducing()
        producer.stopProducing()
        self.assertEqual((transport.producerState, transport.aborted), ("producing", 0))

    def test_stop_producing_aborts(self) -> None:
        d = self.send()
        protocol, transport = self.connect()
        self.answer(protocol, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        body = Body()
        self.successResultOf(d).deliverBody(body)
        producer: Any = body.transport
        producer.stopProducing()
        self.assertEqual(transport.aborted, 1)
        protocol.connectionLost(Failure(ConnectionLost()))
        assert body.reason is not None
        self.assertTrue(body.reason.check(ResponseFailed))

    def test_bad_answers_fail_cleanly(self) -> None:
        for answer in (b"SPDY/3 200 OK\r\n\r\n", b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
                       b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n"):
            d = self.send()
            protocol, transport = self.connect()
            self.answer(protocol, answer)
            self.failureResultOf(d, ResponseFailed)
            self.assertEqual(transport.aborted, 1)

    def test_bad_chunk_framing_fails_the_body(self) -> None:
        d = self.send()
        protocol, transport = self.connect()
        self.answer(protocol, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        body = Body()
        self.successResultOf(d).deliverBody(body)
        self.answer(protocol, b"zz\r\n")
        assert body.reason is not None
        self.assertTrue(body.reason.check(ResponseFailed))
        self.assertEqual(transport.aborted, 1)

    def test_interim_answers_are_skipped(self) -> None:
        d = self.send()
        protocol, _ = self.connect()
        self.answer(protocol, b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n")
        self.assertEqual(self.successResultOf(d).code, 204)

    def test_close_cached_connections(self) -> None:
        d = self.send()
        protocol, transport = self.connect()
        self.answer(protocol, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.successResultOf(d).deliverBody(Body())
        closed = self.agent.closeCachedConnections()
        self.assertNoResult(closed)
        self.assertTrue(transport.disconnecting)
        protocol.connectionLost(Failure(ConnectionDone()))
        self.successResultOf(closed)

    def test_only_http(self) -> None:
        self.assertRaises(ValueError, self.agent.request, b"POST", b"https://127.0.0.1:1/x", HEADERS,
                          BytesProducer(b""))


class WrapperTests(SynchronousTestCase):
    """Once connected, a TCP transport calls the ChildConnection itself, not
    the endpoint's forwarding wrapper around it."""

    def conn_on(self, transport: Any) -> Any:
        agent = ChildAgent(MemoryReactorClock())
        conn = ChildConnection(agent, ("127.0.0.1", 20000))
        conn.transport = transport
        return conn

    def test_a_tcp_transport_calls_the_connection_itself(self) -> None:
        transport = object.__new__(tcp.Client)  # its state only: nothing connects
        conn = self.conn_on(transport)
        transport.protocol = _WrappingProtocol(Deferred(), conn)
        _without_wrapper(conn)
        self.assertIs(transport.protocol, conn)

    def test_anything_else_is_left_as_it_is(self) -> None:
        transport = object.__new__(tcp.Client)
        conn = self.conn_on(transport)
        other = _WrappingProtocol(Deferred(), Protocol())
        transport.protocol = other
        _without_wrapper(conn)
        self.assertIs(transport.protocol, other, "a wrapper of another protocol")
        fake = Transport()
        fake.protocol = wrapper = _WrappingProtocol(Deferred(), conn)  # type: ignore[attr-defined]
        _without_wrapper(self.conn_on(fake))
        self.assertIs(fake.protocol, wrapper, "not a TCP transport")  # type: ignore[attr-defined]


class CoalescingTests(SynchronousTestCase):
    """coalesce_s: a stream's later events are read together; the first is not held."""

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.agent = ChildAgent(self.reactor, coalesce_s=0.004)

    def stream(self) -> Tuple[Any, Transport, Body]:
        d = self.agent.request(b"POST", URL, HEADERS, BytesProducer(b"{}"))
        _, _, factory, _, _ = self.reactor.tcpClients[-1]
        protocol: Any = factory.buildProtocol(None)
        transport = Transport()
        protocol.makeConnection(transport)
        protocol.dataReceived(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        body = Body()
        self.successResultOf(d).deliverBody(body)
        return protocol, transport, body

    def test_the_first_event_goes_at_once_then_reading_pauses_a_moment(self) -> None:
        protocol, transport, body = self.stream()
        self.assertEqual(transport.producerState, "producing")
        protocol.dataReceived(b"5\r\nfirst\r\n")
        self.assertEqual(body.data, b"first", "not held back")
        self.assertEqual(transport.producerState, "producing", "a stream that just began is not held")
        self.reactor.advance(0.01)
        protocol.dataReceived(b"6\r\nsecond\r\n")
        self.assertEqual(body.chunks, [b"first", b"second"])
        self.assertEqual(transport.producerState, "paused", "the next events wait in the socket")
        self.assertEqual([c.getTime() for c in self.reactor.getDelayedCalls()], [0.01 + 0.004])
        self.reactor.advance(0.004)
        self.assertEqual(transport.producerState, "producing")
        protocol.dataReceived(b"1\r\na\r\n1\r\nb\r\n0\r\n\r\n")
        self.assertEqual(body.chunks, [b"first", b"second", b"ab"])
        self.assertEqual(transport.producerState, "producing", "an ended body is not held")
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_a_hold_is_never_longer_than_the_stream_has_run(self) -> None:
        protocol, transport, _ = self.stream()
        self.reactor.advance(0.001)
        protocol.dataReceived(b"1\r\na\r\n")
        self.assertEqual(transport.producerState, "paused")
        self.assertEqual([c.getTime() for c in self.reactor.getDelayedCalls()], [0.001 + 0.001])

    def test_no_hold_once_the_last_event_is_in(self) -> None:
        for last in (b'data: {"choices":[{"finish_reason":"stop"}]}\n\n', b"data: [DONE]\n\n"):
            protocol, transport, body = self.stream()
            self.reactor.advance(1)
            protocol.dataReceived(b"%x\r\n%s\r\n" % (len(last), last))
            self.assertEqual(transport.producerState, "producing", "the end follows at once")
            protocol.dataReceived(b"0\r\n\r\n")
            assert body.reason is not None
            body.reason.trap(ResponseDone)

    def test_big_reads_are_not_held(self) -> None:
        protocol, transport, body = self.stream()
        data = b"x" * 10000
        protocol.dataReceived(b"%x\r\n%s\r\n" % (len(data), data))
        self.assertEqual(transport.producerState, "producing")

    def test_backpressure_outlasts_a_hold(self) -> None:
        protocol, transport, body = self.stream()
        self.reactor.advance(1)
        protocol.dataReceived(b"1\r\na\r\n")
        producer: Any = body.transport
        producer.pauseProducing()  # the client is slow
        self.reactor.advance(0.004)
        self.assertEqual(transport.producerState, "paused", "the hold's end does not override the client")
        producer.resumeProducing()
        self.assertEqual(transport.producerState, "producing")

    def test_a_resume_by_the_client_waits_for_the_hold(self) -> None:
        protocol, transport, body = self.stream()
        self.reactor.advance(1)
        producer: Any = body.transport
        producer.pauseProducing()
        protocol.dataReceived(b"1\r\na\r\n")  # already buffered
        producer.resumeProducing()
        self.assertEqual(transport.producerState, "paused", "still held")
        self.reactor.advance(0.004)
        self.assertEqual(transport.producerState, "producing")

    def test_a_connection_lost_while_held_cancels_the_hold(self) -> None:
        protocol, transport, body = self.stream()
        self.reactor.advance(1)
        protocol.dataReceived(b"1\r\na\r\n")
        protocol.connectionLost(Failure(ConnectionLost()))
        self.assertEqual(self.reactor.getDelayedCalls(), [])
        assert body.reason is not None
        self.assertTrue(body.reason.check(ResponseFailed))


class ParseHeadTests(SynchronousTestCase):
    def test_status_and_headers(self) -> None:
        version, code, phrase, headers = parse_head(b"HTTP/1.1 404 Not Found\r\nA: 1\r\nb:  2 ")
        self.assertEqual((version, code, phrase), (b"HTTP/1.1", 404, b"Not Found"))
        self.assertEqual(headers, {b"a": [b"1"], b"b": [b"2"]})

    @given(st.binary(max_size=60))
    def test_anything_else_is_bad_response_or_parses(self, junk: bytes) -> None:
        try:
            parse_head(junk)
        except BadResponse:
            pass


class StrictFramingTests(SynchronousTestCase):
    """Raw answers a strict HTTP/1.1 client refuses (RFC 9110 §8.6, RFC 9112
    §6, §7.1): ``int()`` alone took ``+5`` and ``5_0`` as a length and ``0x10``
    as a chunk size; the proxy answers such a child with 502 upstream_error."""

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.agent = ChildAgent(self.reactor, persistent=True, max_per_host=2)

    def exchange(self, answer: bytes, method: bytes = b"POST") -> Tuple[defer.Deferred, Transport]:
        d = self.agent.request(method, URL, HEADERS, BytesProducer(b"{}"))
        _, _, factory, _, _ = self.reactor.tcpClients[-1]
        protocol: Any = factory.buildProtocol(None)
        transport = Transport()
        protocol.makeConnection(transport)
        protocol.dataReceived(answer)
        self.protocol = protocol
        return d, transport

    def assertRefused(self, answer: bytes) -> None:
        d, transport = self.exchange(answer)
        failure = self.failureResultOf(d, ResponseFailed)
        self.assertTrue(failure.value.reasons[0].check(BadResponse), answer)
        self.assertEqual(transport.aborted, 1, answer)
        self.assertEqual(self.agent._idle, {}, "never pooled")

    def test_a_content_length_is_digits_only(self) -> None:
        for value in (b"+5", b"5_0", b"5 0", b"0x5", b"-1", b"", b"5a", b"\xd9\xa5",
                      b"99999999999999999999999"):
            self.assertRefused(b"HTTP/1.1 200 OK\r\nContent-Length: " + value + b"\r\n\r\nhello")

    def test_content_lengths_that_differ_are_refused(self) -> None:
        self.assertRefused(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!")
        self.assertRefused(b"HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\nhello!")
        self.assertRefused(b"HTTP/1.1 200 OK\r\nContent-Length: 5,\r\n\r\nhello")

    def test_the_same_content_length_twice_is_one_length(self) -> None:
        for head in (b"Content-Length: 5\r\nContent-Length: 5", b"Content-Length: 5, 5"):
            self.agent = ChildAgent(self.reactor)  # a connection of its own each time
            d, _ = self.exchange(b"HTTP/1.1 200 OK\r\n" + head + b"\r\n\r\nhello")
            response = self.successResultOf(d)
            self.assertEqual((response.length, response.whole_body()), (5, b"hello"))

    def test_transfer_encoding_is_chunked_alone(self) -> None:
        self.assertRefused(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n"
                           b"3\r\nabc\r\n0\r\n\r\n")
        self.assertRefused(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n")
        self.assertRefused(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\nContent-Length: 3\r\n\r\nabc")
        d, _ = self.exchange(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
        self.assertEqual(self.successResultOf(d).whole_body(), b"abc", "the coding's name is case-insensitive")

    def test_a_head_is_crlf_lines_of_tokens(self) -> None:
        for head in (b"X-A: 1\nContent-Length: 0", b"X-A: 1\rContent-Length: 0", b"X-A: a\x00b",
                     b"Content-Length: \x0b5", b"Content Length: 0", b"X@Y: 1", b"X-A : 1",
                     b"X-A: 1\r\n folded", b"X-A\x7f: 1"):
            self.assertRefused(b"HTTP/1.1 200 OK\r\n" + head + b"\r\n\r\n")
        self.assertRefused(b"HTTP/1.10 200 OK\r\nContent-Length: 0\r\n\r\n")

    def test_a_chunk_size_is_hex_digits_only(self) -> None:
        for size in (b"0x5", b"1_0", b"+5", b"-5", b" 5", b"5 ", b"", b"5g", b"1" * 16):
            d, transport = self.exchange(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                         + size + b"\r\nhello\r\n0\r\n\r\n")
            body = Body()
            self.successResultOf(d).deliverBody(body)
            assert body.reason is not None, size
            self.assertTrue(body.reason.check(ResponseFailed), size)
            self.assertTrue(body.reason.value.reasons[0].check(BadResponse), size)
            self.assertEqual((body.data, transport.aborted), (b"", 1), size)

    def test_a_stream_read_a_chunk_at_a_time_is_held_to_the_same_rules(self) -> None:
        """Reads of one whole chunk each (a stream's usual read, which takes a
        shorter way through the decoder) end as the same bytes read one at a
        time (which never do): the same body, the same failure."""
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        end = b"0\r\n\r\n"
        cases = [
            [b"5\r\nhello\r\n", b"A\r\n0123\r\n6789\r\n", b"2;x=1\r\nab\r\n", b"00003\r\nxyz\r\n", end],
            [b"5\r\nhelloXX", b"\r\n", end], [b"5\r\nhello\n\n", end], [b"0x5\r\nhello\r\n", end],
            [b"1" * 16 + b"\r\nx\r\n", end], [b"-5\r\nhello\r\n", end], [b" 5\r\nhello\r\n", end],
            [b"5\r\nhello\r\r\n", end], [b"3\r\nabc\r\n", b"3\r\nabcd\r\n", end],
        ]

        def outcome(reads: List[bytes]) -> Tuple[bytes, Optional[str], int]:
            self.agent = ChildAgent(self.reactor)
            d, transport = self.exchange(head)
            body = Body()
            self.successResultOf(d).deliverBody(body)
            for read in reads:
                self.protocol.dataReceived(read)
            failed = None if body.reason is None else str(body.reason.value.reasons[0].value) if body.reason.check(
                ResponseFailed) else "done"
            return body.data, failed, transport.aborted

        for reads in cases:
            whole = b"".join(reads)
            chunked, bytewise = outcome(reads), outcome([whole[i:i + 1] for i in range(len(whole))])
            if chunked[1] != "done":  # how much came before a failure differs by the reads: the end does not
                chunked, bytewise = chunked[1:], bytewise[1:]
            self.assertEqual(chunked, bytewise, reads)
        self.assertEqual(outcome(cases[0]), (b"hello0123\r\n6789abxyz", "done", 0))
        self.assertEqual(outcome(cases[1])[1:], ("bad chunk end", 1))

    def test_chunk_sizes_any_case_and_extensions(self) -> None:
        d, _ = self.exchange(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                             b"a\r\n0123456789\r\nA ;ext=1\r\n0123456789\r\n0;last\r\n\r\n")
        self.assertEqual(self.successResultOf(d).whole_body(), b"0123456789" * 2)

    def test_a_head_answer_has_no_body(self) -> None:
        d, transport = self.exchange(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n", method=b"HEAD")
        response = self.successResultOf(d)
        self.assertEqual(response.whole_body(), b"", "not waiting for 1000 bytes that never come")
        self.assertIn(b"content-length", dict(response.headers.getAllRawHeaders()))
        self.assertEqual(len(self.agent._idle[("127.0.0.1", 20000)]), 1, "pooled: the answer is complete")
        self.assertTrue(transport.value().startswith(b"HEAD /v1/chat/completions HTTP/1.1\r\n"))

    def test_a_chunked_head_answer_has_no_body_either(self) -> None:
        d, _ = self.exchange(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", method=b"HEAD")
        self.assertEqual(self.successResultOf(d).whole_body(), b"")

    def test_not_pooled_while_the_request_is_not_all_out(self) -> None:
        # A child that answered before reading all of the request (an early
        # error, say): what is still queued would be read as the start of the
        # next request on the connection.
        d = self.agent.request(b"POST", URL, HEADERS, BytesProducer(b"x" * 100))
        _, _, factory, _, _ = self.reactor.tcpClients[-1]
        protocol: Any = factory.buildProtocol(None)
        transport = Transport()
        transport.dataBuffer = b"the rest of the request"  # what Twisted's TCP transport still holds
        protocol.makeConnection(transport)
        protocol.dataReceived(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 2\r\n\r\n{}")
        self.assertEqual(self.successResultOf(d).whole_body(), b"{}")
        self.assertEqual(self.agent._idle, {}, "not pooled")
        self.assertEqual(transport.aborted, 1, "closed: the rest of the request is of no use")
        self.agent.request(b"POST", URL, HEADERS, BytesProducer(b"{}"))
        self.assertEqual(len(self.reactor.tcpClients), 2, "the next request gets a connection of its own")

    def test_pooled_once_the_request_is_all_out(self) -> None:
        d, transport = self.exchange(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        self.assertEqual(self.successResultOf(d).whole_body(), b"{}")
        self.assertEqual(len(self.agent._idle[("127.0.0.1", 20000)]), 1)
        self.assertEqual(transport.aborted, 0)

    def test_the_proxy_answers_a_badly_framed_child_with_502(self) -> None:
        from twisted.web.test.requesthelper import DummyRequest

        from rolemesh.base import errors
        from rolemesh.http.proxy import Proxy

        for answer in (b"HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\nhello",
                       b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 50\r\n\r\nhello"):
            reactor = MemoryReactorClock()
            proxy = Proxy(reactor=reactor)
            request = DummyRequest([b""])
            d = proxy.forward(request, "http://127.0.0.1:20000", "/v1/completions", b"{}", False)
            protocol: Any = reactor.tcpClients[-1][2].buildProtocol(None)
            protocol.makeConnection(Transport())
            protocol.dataReceived(answer)
            error = self.failureResultOf(d, errors.ApiError).value
            self.assertEqual((error.status, error.code), (502, "upstream_error"), answer)
            self.assertIn("content-length", error.message)
            self.assertEqual(request.written, [], "nothing of the answer reached the client")

    def test_the_proxy_gives_a_childs_whole_error_answer_unchanged(self) -> None:
        from twisted.web.test.requesthelper import DummyRequest

        from rolemesh.http.proxy import COMPLETE, Proxy

        body = (b'{"error":{"code":501,"message":"This server does not support embeddings. Start it with '
                b'`--embeddings`","type":"not_supported_error"}}')
        reactor = MemoryReactorClock()
        proxy = Proxy(reactor=reactor)
        request = DummyRequest([b""])
        d = proxy.forward(request, "http://127.0.0.1:20000", "/v1/embeddings", b"{}", False)
        protocol: Any = reactor.tcpClients[-1][2].buildProtocol(None)
        protocol.makeConnection(Transport())
        protocol.dataReceived(b"HTTP/1.1 501 Not Implemented\r\nContent-Type: application/json; charset=utf-8\r\n"
                              b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        self.assertEqual(self.successResultOf(d), COMPLETE)
        written = b"".join(request.written)
        self.assertEqual(request.responseCode, 501)
        self.assertEqual(written, body)
        self.assertEqual(request.responseHeaders.getRawHeaders(b"content-length"), [b"%d" % len(written)])
