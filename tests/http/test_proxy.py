"""Unit tests of the relay: an in-memory upstream (a fake IAgent whose
responses the test drives chunk by chunk) and a DummyRequest downstream."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, Callable, List, Optional

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone, ConnectionLost, ConnectionRefusedError
from twisted.internet.interfaces import IPushProducer
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web._newclient import RequestNotSent, ResponseNeverReceived
from twisted.web.client import ResponseDone, ResponseFailed
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH
from twisted.web.test.requesthelper import DummyRequest
from zope.interface import implementer

import rolemesh.http.proxy as proxy_module
from rolemesh.base import errors
from rolemesh.http.proxy import (
    CLIENT_GONE,
    COMPLETE,
    HOP_HEADERS,
    STALLED,
    STREAM_COALESCE_S,
    STREAM_ERROR,
    TRUNCATED,
    BytesProducer,
    Proxy,
    UpstreamUnreachable,
    sse_error_event,
)

BASE = "http://127.0.0.1:20000"


@implementer(IPushProducer)
class UpstreamTransport:
    """What the relay protocol gets as its transport: records flow control."""

    def __init__(self) -> None:
        self.paused = 0
        self.resumed = 0
        self.stopped = 0

    def pauseProducing(self) -> None:
        self.paused += 1

    def resumeProducing(self) -> None:
        self.resumed += 1

    def stopProducing(self) -> None:
        self.stopped += 1


class FakeResponse:
    """An IResponse whose body the test delivers."""

    def __init__(self, code: int = 200, phrase: bytes = b"OK", headers: Optional[dict] = None) -> None:
        self.code = code
        self.phrase = phrase
        self.version = (b"HTTP", 1, 1)
        self.headers = Headers(headers if headers is not None else {b"content-type": [b"application/json"]})
        self.length = UNKNOWN_LENGTH
        self.request = None
        self.previousResponse = None
        self.transport = UpstreamTransport()
        self.protocol: Any = None
        #: When set, deliverBody sends these chunks and ends the body at once.
        self.autoplay: Optional[List[bytes]] = None

    def deliverBody(self, protocol: Any) -> None:
        self.protocol = protocol
        protocol.makeConnection(self.transport)
        if self.autoplay is not None:
            for chunk in self.autoplay:
                self.send(chunk)
            self.finish()

    def setPreviousResponse(self, response: Any) -> None:
        self.previousResponse = response

    # driving it
    def send(self, data: bytes) -> None:
        self.protocol.dataReceived(data)

    def finish(self) -> None:
        self.protocol.connectionLost(Failure(ResponseDone("done")))

    def cut(self) -> None:
        self.protocol.connectionLost(Failure(ResponseFailed([Failure(ConnectionLost("child died"))])))


class Attempt:
    """One upstream request the proxy made."""

    def __init__(self, agent: "FakeAgent", method: bytes, url: bytes, headers: Headers, producer: Any) -> None:
        self.method = method
        self.url = url
        self.headers = headers
        self.body = b""
        self.cancelled = 0
        self._agent = agent
        self.deferred: Deferred = Deferred(self._cancel)
        if producer is not None:
            producer.startProducing(self)

    def write(self, data: bytes) -> None:  # the body producer's consumer
        self.body += data

    def _cancel(self, d: Deferred) -> None:
        self.cancelled += 1
        if self._agent.realistic_cancel:
            # What twisted.web's HTTP11ClientProtocol does: abort the
            # connection, fail the request as never answered.
            d.errback(Failure(ResponseNeverReceived([Failure(defer.CancelledError())])))

    def respond(self, response: FakeResponse) -> FakeResponse:
        self.deferred.callback(response)
        return response

    def fail(self, failure: Any) -> None:
        self.deferred.errback(failure if isinstance(failure, Failure) else Failure(failure))


class FakeAgent:
    """An IAgent for the proxy's ``agent=``: records attempts, answers none by itself."""

    def __init__(self, realistic_cancel: bool = True, auto: Optional[Callable[[Attempt], Any]] = None) -> None:
        self.attempts: List[Attempt] = []
        self.realistic_cancel = realistic_cancel
        #: When set, called with each attempt; a FakeResponse it returns answers it at once.
        self.auto = auto

    def request(self, method: bytes, uri: bytes, headers: Any = None, bodyProducer: Any = None) -> Deferred:
        attempt = Attempt(self, method, uri, headers, bodyProducer)
        self.attempts.append(attempt)
        if self.auto is not None:
            response = self.auto(attempt)
            if response is not None:
                attempt.respond(response)
        return attempt.deferred

    @property
    def last(self) -> Attempt:
        return self.attempts[-1]


class DownstreamRequest(DummyRequest):
    """A DummyRequest that takes a push producer the way twisted.web does and
    records writes made after the client went away."""

    def __init__(self) -> None:
        super().__init__([b""])
        self.method = b"POST"
        self.producer: Any = None
        self.registrations: List[Any] = []
        self.unregistered = 0
        self._disconnected = False
        self.writes_after_gone: List[bytes] = []
        #: Times the client's connection was aborted (a cut answer must look cut).
        self.aborted = 0
        self.channel = SimpleNamespace(transport=SimpleNamespace(abortConnection=self._abort))

    def _abort(self) -> None:
        self.aborted += 1
        self._disconnected = True

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        assert self.producer is None, "a producer is already registered"
        self.producer = producer
        self.registrations.append((producer, streaming))

    def unregisterProducer(self) -> None:
        self.producer = None
        self.unregistered += 1

    def write(self, data: bytes) -> None:
        if self._disconnected or self.finished:
            self.writes_after_gone.append(data)
        super().write(data)

    def client_gone(self) -> None:
        self._disconnected = True

    @property
    def body(self) -> bytes:
        return b"".join(self.written)


class ProxyTestCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.agent = FakeAgent()
        self.proxy = Proxy(reactor=self.clock, agent=self.agent)
        self.request = DownstreamRequest()
        self.first_bytes: List[int] = []

    def forward(self, streaming: bool = False, timeout: Optional[float] = None, body: bytes = b'{"model": "a"}',
                path: str = "/v1/chat/completions") -> Deferred:
        return self.proxy.forward(self.request, BASE, path, body, streaming, timeout=timeout,
                                  on_first_byte=lambda: self.first_bytes.append(len(self.request.written)))

    def event_stream(self, **extra: List[bytes]) -> FakeResponse:
        return FakeResponse(headers={b"content-type": [b"text/event-stream"], **extra})

    def assertClientGone(self, d: Deferred) -> None:
        """Cancelled: CLIENT_GONE or a CancelledError, never an ApiError."""
        results: List[Any] = []
        d.addBoth(results.append)
        self.assertEqual(len(results), 1, "forward() fired")
        result = results[0]
        if isinstance(result, Failure):
            self.assertTrue(result.check(defer.CancelledError), f"not a cancellation: {result!r}")
        else:
            self.assertEqual(result, CLIENT_GONE)


class RelayTests(ProxyTestCase):
    def test_posts_the_body_to_the_child(self) -> None:
        self.forward(body=b'{"model": "a", "x": 1}', path="/v1/embeddings")
        attempt = self.agent.last
        self.assertEqual(attempt.method, b"POST")
        self.assertEqual(attempt.url, b"http://127.0.0.1:20000/v1/embeddings")
        self.assertEqual(attempt.body, b'{"model": "a", "x": 1}')
        self.assertEqual(attempt.headers.getRawHeaders(b"content-type"), [b"application/json"])

    def test_complete_answer(self) -> None:
        d = self.forward()
        response = self.agent.last.respond(FakeResponse())
        response.send(b'{"choices": []}')
        self.assertNoResult(d)
        response.finish()
        self.assertEqual(self.successResultOf(d), COMPLETE)
        self.assertEqual(self.request.responseCode, 200)
        self.assertEqual(self.request.body, b'{"choices": []}')
        self.assertEqual(self.request.unregistered, 1)

    def test_headers_copied_minus_hop_by_hop(self) -> None:
        d = self.forward()
        upstream = {
            b"content-type": [b"application/json; charset=utf-8"],
            b"content-length": [b"2"],
            b"x-custom": [b"kept"],
            b"connection": [b"keep-alive"],
            b"keep-alive": [b"timeout=5"],
            b"transfer-encoding": [b"chunked"],
            b"server": [b"llama.cpp"],
            b"date": [b"Mon, 01 Jan 2024 00:00:00 GMT"],
            b"access-control-allow-origin": [b"*"],
            b"trailer": [b"x"],
            b"upgrade": [b"h2c"],
        }
        response = self.agent.last.respond(FakeResponse(201, b"Created", upstream))
        response.send(b"{}")
        response.finish()
        self.successResultOf(d)
        headers = self.request.responseHeaders
        self.assertEqual(self.request.responseCode, 201)
        self.assertEqual(self.request.responseMessage, b"Created")
        self.assertEqual(headers.getRawHeaders(b"content-type"), [b"application/json; charset=utf-8"])
        self.assertEqual(headers.getRawHeaders(b"content-length"), [b"2"])
        self.assertEqual(headers.getRawHeaders(b"x-custom"), [b"kept"])
        for name in HOP_HEADERS:
            self.assertIsNone(headers.getRawHeaders(name), name)
        self.assertIsNone(headers.getRawHeaders(b"x-accel-buffering"))

    def test_upstream_4xx_passes_through_as_it_comes(self) -> None:
        d = self.forward()
        body = b'{"error":{"code":400,"message":"bad messages","type":"invalid_request_error"}}'
        response = self.agent.last.respond(FakeResponse(400, b"Bad Request", headers={
            b"content-type": [b"application/json"], b"content-length": [b"%d" % len(body)]}))
        response.send(body[:20])
        self.assertEqual(self.request.written, [body[:20]], "an error answer is relayed as it comes")
        response.send(body[20:])
        response.finish()
        self.assertEqual(self.successResultOf(d), COMPLETE)
        self.assertEqual(self.request.responseCode, 400)
        self.assertEqual(self.request.body, body)
        self.assertEqual(self.request.responseHeaders.getRawHeaders(b"content-length"), [b"%d" % len(body)])

    def test_event_stream_headers(self) -> None:
        d = self.forward(streaming=True)
        response = self.agent.last.respond(self.event_stream(**{"content-length": [b"999"]}))
        headers = self.request.responseHeaders
        self.assertEqual(headers.getRawHeaders(b"x-accel-buffering"), [b"no"])
        self.assertEqual(headers.getRawHeaders(b"cache-control"), [b"no-cache"])
        self.assertIsNone(headers.getRawHeaders(b"content-length"), "no stale Content-Length")
        self.assertEqual(headers.getRawHeaders(b"content-type"), [b"text/event-stream"])
        response.finish()
        self.successResultOf(d)

    def test_chunks_are_written_as_they_arrive(self) -> None:
        d = self.forward(streaming=True)
        response = self.agent.last.respond(self.event_stream())
        chunks = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]
        for i, chunk in enumerate(chunks):
            response.send(chunk)
            self.assertEqual(self.request.written, chunks[: i + 1], "written before the upstream finished")
            self.assertNoResult(d)
        response.finish()
        self.assertEqual(self.successResultOf(d), COMPLETE)
        self.assertEqual(self.request.body, b"".join(chunks))

    def test_upstream_is_the_downstream_producer(self) -> None:
        d = self.forward(streaming=True)
        response = self.agent.last.respond(self.event_stream())
        self.assertEqual(self.request.registrations, [(response.transport, True)])
        # A slow client pauses llama-server's socket, and resumes it.
        self.request.producer.pauseProducing()
        self.request.producer.resumeProducing()
        self.assertEqual((response.transport.paused, response.transport.resumed), (1, 1))
        response.finish()
        self.successResultOf(d)
        self.assertIsNone(self.request.producer)
        self.assertEqual(self.request.unregistered, 1)

    def test_first_byte_callback_fires_once_at_the_first_byte(self) -> None:
        d = self.forward(streaming=True)
        response = self.agent.last.respond(self.event_stream())
        self.assertEqual(self.first_bytes, [], "headers are not the first byte")
        response.send(b"data: 1\n\n")
        response.send(b"data: 2\n\n")
        response.send(b"data: [DONE]\n\n")
        response.finish()
        self.successResultOf(d)
        self.assertEqual(self.first_bytes, [0], "once, before the first chunk was written")

    def test_no_body_no_first_byte(self) -> None:
        d = self.forward()
        self.agent.last.respond(FakeResponse(204, b"No Content")).finish()
        self.assertEqual(self.successResultOf(d), COMPLETE)
        self.assertEqual(self.first_bytes, [])

    def test_potential_data_loss_is_a_complete_answer(self) -> None:
        # An HTTP/1.0-style body without a length ends when the connection does.
        d = self.forward()
        response = self.agent.last.respond(FakeResponse())
        response.send(b"{}")
        response.protocol.connectionLost(Failure(PotentialDataLoss()))
        self.assertEqual(self.successResultOf(d), COMPLETE)


class UpstreamFailureTests(ProxyTestCase):
    def test_cut_mid_stream_ends_with_an_sse_error_event(self) -> None:
        d = self.forward(streaming=True)
        response = self.agent.last.respond(self.event_stream())
        response.send(b'data: {"n": 1}\n\n')
        response.cut()
        self.assertEqual(self.successResultOf(d), STREAM_ERROR)
        self.assertEqual(self.request.written[0], b'data: {"n": 1}\n\n')
        tail = self.request.body[len(b'data: {"n": 1}\n\n'):]
        self.assertTrue(tail.endswith(b"data: [DONE]\n\n"), tail)
        events = [e for e in tail.split(b"\n\n") if e]
        self.assertEqual(events[-1], b"data: [DONE]")
        error = json.loads(events[0][len(b"data: "):])
        self.assertEqual(error["error"]["code"], "upstream_error")
        self.assertEqual(error["error"]["type"], "server_error")
        self.assertEqual(len(self.agent.attempts), 1, "a request that got an answer is never retried")

    def test_cut_mid_answer_is_truncated(self) -> None:
        d = self.forward()
        response = self.agent.last.respond(FakeResponse(headers={b"content-type": [b"application/json"],
                                                                 b"content-length": [b"100"]}))
        response.send(b'{"choi')
        response.cut()
        self.assertEqual(self.successResultOf(d), TRUNCATED)
        self.assertEqual(self.request.body, b'{"choi', "nothing appended to a JSON answer")
        self.assertEqual(self.request.aborted, 1, "the client's connection is aborted: a cut answer looks cut")
        self.assertEqual(len(self.agent.attempts), 1)

    def test_connection_refused_is_unreachable_then_502(self) -> None:
        d = self.forward()
        self.agent.last.fail(ConnectionRefusedError("127.0.0.1", 20000))
        unreachable = self.failureResultOf(d, UpstreamUnreachable).value
        error = unreachable.as_api_error()
        self.assertEqual((error.status, error.code, error.type), (502, "upstream_error", "server_error"))
        self.assertIn("llama-server", error.message)
        self.assertEqual(len(self.agent.attempts), 1, "refused is not a stale connection")
        self.assertEqual(self.request.written, [])
        self.assertIsNone(self.request.responseCode)

    def test_response_failed_before_any_byte_after_sending_is_502(self) -> None:
        d = self.forward()
        self.agent.last.fail(ResponseFailed([Failure(ConnectionLost())]))
        self.assertEqual(self.failureResultOf(d, errors.ApiError).value.status, 502)
        self.assertEqual(len(self.agent.attempts), 1)

    def test_a_bug_in_the_bookkeeping_still_ends_the_request(self) -> None:
        """Never lose a request silently: a failure in handling the answer is
        logged and the request gets an answer."""
        def broken(response: Any) -> None:
            raise RuntimeError("bug")

        self.patch(proxy_module.Forward, "_got_response", lambda self, response: broken(response))
        d = self.forward()
        self.agent.last.respond(FakeResponse())
        self.assertEqual(self.failureResultOf(d, errors.ApiError).value.status, 502)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_a_bug_at_the_end_of_the_body_still_ends_the_request(self) -> None:
        def broken(whole: bool) -> None:
            raise RuntimeError("bug")

        self.patch(proxy_module.Forward, "_relayed", lambda self, whole: broken(whole))
        d = self.forward()
        response = self.agent.last.respond(FakeResponse())
        response.finish()
        self.assertEqual(self.failureResultOf(d, errors.ApiError).value.status, 502)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_client_gone_when_upstream_ends_is_client_gone(self) -> None:
        d = self.forward(streaming=True)
        response = self.agent.last.respond(self.event_stream())
        response.send(b"data: 1\n\n")
        self.request.client_gone()
        response.cut()
        self.assertEqual(self.successResultOf(d), CLIENT_GONE)
        self.assertEqual(self.request.writes_after_gone, [], "no SSE error event to a client that left")


class TimeoutTests(ProxyTestCase):
    def test_no_answer_within_the_deadline_is_504(self) -> None:
        d = self.forward(timeout=5)
        self.clock.advance(4.9)
        self.assertNoResult(d)
        self.clock.advance(0.1)
        error = self.failureResultOf(d, errors.ApiError).value
        self.assertEqual((error.status, error.code, error.type), (504, "upstream_timeout", "server_error"))
        self.assertIn("5s", error.message)
        self.assertEqual(self.agent.last.cancelled, 1, "the upstream request was closed")
        self.assertEqual(len(self.agent.attempts), 1, "a timeout is not retried")
        self.assertEqual(self.request.written, [])

    def test_no_answer_with_a_plain_cancelling_agent_is_504(self) -> None:
        self.agent.realistic_cancel = False
        d = self.forward(timeout=5)
        self.clock.advance(5)
        self.assertEqual(self.failureResultOf(d, errors.ApiError).value.status, 504)
        self.assertEqual(len(self.agent.attempts), 1)

    def test_body_that_stops_mid_way_is_cut_at_the_deadline(self) -> None:
        d = self.forward(timeout=5)
        response = self.agent.last.respond(FakeResponse())
        response.send(b'{"par')
        self.clock.advance(5)
        self.assertEqual(response.transport.stopped, 1, "the upstream connection is closed")
        self.assertNoResult(d)
        response.cut()  # what closing the connection does
        self.assertEqual(self.successResultOf(d), TRUNCATED)
        self.assertEqual(self.request.body, b'{"par')

    def test_deadline_timer_is_cancelled_when_done(self) -> None:
        d = self.forward(timeout=5)
        response = self.agent.last.respond(FakeResponse())
        response.send(b"{}")
        response.finish()
        self.successResultOf(d)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_stream_that_never_begins_times_out(self) -> None:
        d = self.forward(streaming=True, timeout=5)
        self.clock.advance(5)
        error = self.failureResultOf(d, errors.ApiError).value
        self.assertEqual((error.status, error.code), (504, "upstream_timeout"))
        self.assertIn("start its stream", error.message)

    def test_deadline_timer_is_cancelled_on_failure(self) -> None:
        d = self.forward(timeout=5)
        self.agent.last.fail(ConnectionRefusedError())
        self.failureResultOf(d, UpstreamUnreachable)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_streams_have_no_deadline_once_begun(self) -> None:
        d = self.forward(streaming=True, timeout=5)
        self.clock.advance(4)
        response = self.agent.last.respond(self.event_stream())
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.clock.advance(10000)
        self.assertNoResult(d)
        self.assertEqual(response.transport.stopped, 0)
        response.finish()
        self.successResultOf(d)


class CancellationTests(ProxyTestCase):
    """The client went away: Klein cancels the route's Deferred."""

    def test_cancel_before_the_answer_closes_upstream(self) -> None:
        d = self.forward()
        d.cancel()
        self.assertClientGone(d)
        self.assertEqual(self.agent.last.cancelled, 1)
        self.assertEqual(len(self.agent.attempts), 1, "a cancelled request is not retried")
        self.assertEqual(self.request.written, [])
        self.assertIsNone(self.request.responseCode)

    def test_cancel_before_the_answer_with_a_plain_cancelling_agent(self) -> None:
        self.agent.realistic_cancel = False
        d = self.forward()
        d.cancel()
        self.assertClientGone(d)
        self.assertEqual(self.agent.last.cancelled, 1)
        self.assertEqual(len(self.agent.attempts), 1)

    def test_cancel_mid_stream_stops_upstream_and_never_writes_again(self) -> None:
        d = self.forward(streaming=True)
        response = self.agent.last.respond(self.event_stream())
        response.send(b"data: 1\n\n")
        self.request.client_gone()
        d.cancel()
        self.assertClientGone(d)
        self.assertEqual(response.transport.stopped, 1, "llama-server's connection is closed")
        written = list(self.request.written)
        response.cut()  # what stopProducing leads to
        self.assertEqual(self.request.written, written, "nothing written after the client left")
        self.assertEqual(self.request.writes_after_gone, [])
        self.assertEqual(self.request.unregistered, 1)

    def test_cancel_mid_answer_stops_upstream(self) -> None:
        d = self.forward(timeout=30)
        response = self.agent.last.respond(FakeResponse())
        response.send(b"{")
        d.cancel()
        self.assertClientGone(d)
        self.assertEqual(response.transport.stopped, 1)
        response.cut()
        self.assertEqual(self.request.body, b"{")
        self.assertEqual(self.clock.getDelayedCalls(), [], "the deadline timer is gone")

    def test_cancel_while_retrying_cancels_the_retry(self) -> None:
        d = self.forward()
        self.agent.attempts[0].fail(ResponseNeverReceived([Failure(ConnectionDone())]))
        self.assertEqual(len(self.agent.attempts), 2)
        d.cancel()
        self.assertClientGone(d)
        self.assertEqual(self.agent.attempts[1].cancelled, 1)
        self.assertEqual(len(self.agent.attempts), 2)


class StartTests(ProxyTestCase):
    """``Proxy.start``: ``forward`` without its Deferred (the request path's)."""

    def start(self, ended: List[Any]) -> Any:
        return self.proxy.start(self.request, BASE, "/v1/chat/completions", b"{}", False, 30, None, None,
                                ended.append)

    def test_ended_is_told_once(self) -> None:
        ended: List[Any] = []
        exchange = self.start(ended)
        self.assertFalse(exchange.done)
        response = self.agent.last.respond(FakeResponse())
        response.send(b"{}")
        response.finish()
        self.assertEqual(ended, [COMPLETE])
        exchange.cancel()  # too late: nothing happens
        self.assertEqual(ended, [COMPLETE])
        self.assertEqual(self.agent.last.cancelled, 0)

    def test_cancel_closes_upstream_and_ends_once(self) -> None:
        ended: List[Any] = []
        exchange = self.start(ended)
        exchange.cancel()
        exchange.cancel()
        self.assertEqual(len(ended), 1)
        self.assertTrue(ended[0] == CLIENT_GONE or ended[0].check(defer.CancelledError), ended)
        self.assertEqual(self.agent.last.cancelled, 1)
        self.assertEqual(self.clock.getDelayedCalls(), [], "the deadline timer is gone")

    def test_an_answer_that_came_whole_is_written_without_a_producer(self) -> None:
        class Whole(FakeResponse):
            def whole_body(self) -> bytes:
                return b'{"ok": 1}'

            def deliverBody(self, protocol: Any) -> None:
                raise AssertionError("the whole body was taken")

        ended: List[Any] = []
        self.start(ended)
        self.agent.last.respond(Whole(headers={b"content-type": [b"application/json"]}))
        self.assertEqual((ended, self.request.body), ([COMPLETE], b'{"ok": 1}'))
        self.assertEqual(self.request.registrations, [])
        self.assertEqual(self.clock.getDelayedCalls(), [])


class StaleConnectionTests(ProxyTestCase):
    def test_stale_pooled_connection_is_retried_once(self) -> None:
        d = self.forward()
        self.agent.attempts[0].fail(ResponseNeverReceived([Failure(ConnectionDone())]))
        self.assertEqual(len(self.agent.attempts), 2)
        retry = self.agent.attempts[1]
        self.assertEqual((retry.url, retry.body), (self.agent.attempts[0].url, self.agent.attempts[0].body))
        response = retry.respond(FakeResponse())
        response.send(b"{}")
        response.finish()
        self.assertEqual(self.successResultOf(d), COMPLETE)
        self.assertEqual(self.request.body, b"{}")

    def test_stale_then_refused_is_unreachable(self) -> None:
        """No answer at all, twice: the child is gone; the caller may use a fresh one."""
        self.fresh = FakeAgent()
        self.proxy = Proxy(reactor=self.clock, agent=self.agent, fresh_agent=self.fresh)
        self.proxy._pool = SimpleNamespace(closeCachedConnections=lambda: self.closed.append(1))
        self.closed: List[int] = []
        d = self.forward()
        self.agent.attempts[0].fail(ResponseNeverReceived([Failure(ConnectionDone())]))
        self.assertEqual(self.closed, [], "other children's pooled connections are left alone")
        self.assertEqual(len(self.fresh.attempts), 1, "the retry goes on a connection of its own")
        self.fresh.attempts[0].fail(ConnectionRefusedError())
        self.assertEqual(self.failureResultOf(d, UpstreamUnreachable).value.as_api_error().status, 502)

    def test_request_not_sent_is_retried(self) -> None:
        d = self.forward()
        self.agent.attempts[0].fail(RequestNotSent())
        self.assertEqual(len(self.agent.attempts), 2)
        self.agent.attempts[1].respond(FakeResponse()).finish()
        self.assertEqual(self.successResultOf(d), COMPLETE)

    def test_retried_exactly_once(self) -> None:
        d = self.forward()
        self.agent.attempts[0].fail(ResponseNeverReceived([Failure(ConnectionDone())]))
        self.agent.attempts[1].fail(ResponseNeverReceived([Failure(ConnectionDone())]))
        self.failureResultOf(d, UpstreamUnreachable)
        self.assertEqual(len(self.agent.attempts), 2)

    def test_not_retried_after_cancellation(self) -> None:
        d = self.forward()
        d.cancel()  # the realistic agent fails the attempt with ResponseNeverReceived
        self.assertEqual(len(self.agent.attempts), 1)
        self.assertClientGone(d)

    def test_not_retried_after_the_deadline(self) -> None:
        d = self.forward(timeout=5)
        self.clock.advance(5)
        self.assertEqual(len(self.agent.attempts), 1)
        self.assertEqual(self.failureResultOf(d, errors.ApiError).value.status, 504)


class PieceTests(SynchronousTestCase):
    def test_bytes_producer(self) -> None:
        producer = BytesProducer(b"hello")
        self.assertEqual(producer.length, 5)
        received: List[bytes] = []

        class Consumer:
            def write(self, data: bytes) -> None:
                received.append(data)

        self.successResultOf(producer.startProducing(Consumer()))
        self.assertEqual(received, [b"hello"])
        producer.pauseProducing()
        producer.resumeProducing()
        producer.stopProducing()

    def test_sse_error_event(self) -> None:
        event = sse_error_event("boom")
        self.assertTrue(event.startswith(b"data: {"))
        self.assertTrue(event.endswith(b"\n\ndata: [DONE]\n\n"))
        body = json.loads(event.split(b"\n\n")[0][len(b"data: "):])
        self.assertEqual(body, {"error": {"message": "boom", "type": "server_error", "code": "upstream_error"}})

    def test_default_agent_uses_its_own_pool(self) -> None:
        reactor = MemoryReactorClock()
        proxy = Proxy(reactor=reactor, max_per_host=3)
        proxy.agent  # noqa: B018 -- builds the pool
        pool = proxy._pool
        assert pool is not None
        self.assertTrue(pool.persistent)
        self.assertEqual(pool.maxPersistentPerHost, 3)
        self.assertFalse(pool.retryAutomatically, "the proxy retries stale connections itself, once")
        self.successResultOf(proxy.close())

    def test_agents_coalesce_stream_events_only_when_configured(self) -> None:
        proxy = Proxy(reactor=MemoryReactorClock())
        self.assertEqual((proxy.agent.coalesce_s, proxy.fresh_agent.coalesce_s), (0, 0), "off by default (SPEC)")
        proxy = Proxy(reactor=MemoryReactorClock(), coalesce_s=STREAM_COALESCE_S)
        self.assertEqual(proxy.agent.coalesce_s, STREAM_COALESCE_S)
        self.assertEqual(proxy.fresh_agent.coalesce_s, STREAM_COALESCE_S)
        self.assertFalse(proxy.fresh_agent.persistent)

    def test_close_without_pool(self) -> None:
        self.successResultOf(Proxy(reactor=Clock(), agent=FakeAgent()).close())


class IdleTimeoutTests(ProxyTestCase):
    """stream_idle_timeout_s: once an answer has begun, no silence lasts longer."""

    def test_a_stream_that_goes_silent_ends_with_an_sse_error_and_frees_the_slot(self) -> None:
        d = self.proxy.forward(self.request, BASE, "/v1/chat/completions", b"{}", True, timeout=600,
                               idle_timeout=30)
        response = self.agent.last.respond(self.event_stream())
        for _ in range(5):  # chunks 20 s apart keep it alive
            self.clock.advance(20)
            response.send(b'data: {"choices": []}\n\n')
        self.assertEqual(response.transport.stopped, 0)
        self.clock.advance(30)
        self.assertEqual(response.transport.stopped, 1, "the upstream connection is closed")
        response.cut()  # what closing the connection does
        self.assertEqual(self.successResultOf(d), STALLED)
        self.assertTrue(self.request.body.endswith(
            sse_error_event("llama-server sent nothing for 30s (stream_idle_timeout_s)")))
        self.assertEqual(self.request.aborted, 0, "a stream ends cleanly, with [DONE]")
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_events_move_no_timer_and_the_deadline_counts_from_the_last(self) -> None:
        d = self.proxy.forward(self.request, BASE, "/v1/chat/completions", b"{}", True, timeout=600,
                               idle_timeout=30)
        response = self.agent.last.respond(self.event_stream())
        [timer] = self.clock.getDelayedCalls()
        for _ in range(25):  # an event a second: the deadline's timer stays where it was set
            self.clock.advance(1)
            response.send(b'data: {"choices": []}\n\n')
        self.assertEqual(self.clock.getDelayedCalls(), [timer])
        self.assertEqual(timer.getTime(), 30)
        self.clock.advance(5)  # at 30 it finds the last event 5 s old: 25 s more from now
        [moved] = self.clock.getDelayedCalls()
        self.assertEqual(moved.getTime(), 55)
        self.clock.advance(24.5)
        self.assertEqual(response.transport.stopped, 0)
        self.clock.advance(0.5)
        self.assertEqual(response.transport.stopped, 1, "30 s after the last event")
        response.cut()
        self.assertEqual(self.successResultOf(d), STALLED)

    def test_a_body_that_stalls_is_cut(self) -> None:
        d = self.proxy.forward(self.request, BASE, "/v1/completions", b"{}", False, timeout=600, idle_timeout=30)
        response = self.agent.last.respond(FakeResponse())
        response.send(b'{"cho')
        self.clock.advance(30)
        self.assertEqual(response.transport.stopped, 1)
        response.cut()
        self.assertEqual(self.successResultOf(d), STALLED)
        self.assertEqual(self.request.body, b'{"cho', "nothing appended to a JSON answer")
        self.assertEqual(self.request.aborted, 1)

    def test_no_idle_deadline_before_the_answer_begins(self) -> None:
        d = self.proxy.forward(self.request, BASE, "/v1/completions", b"{}", False, timeout=600, idle_timeout=30)
        self.clock.advance(100)  # prompt processing: bounded by request_timeout_s only
        self.assertNoResult(d)
        self.agent.last.respond(FakeResponse()).finish()
        self.assertEqual(self.successResultOf(d), COMPLETE)


class ChildErrorTests(ProxyTestCase):
    """A child's error answer reaches the client unchanged: its status, and
    its body byte for byte (``type`` and ``code`` as llama-server sent them),
    whether it came whole with its head or in reads."""

    def error(self, status: int, body: bytes, parts: int = 1) -> bytes:
        """The client's body for the child's error answer ``body`` of
        ``status`` in ``parts`` reads; the client's status is the child's."""
        d = self.forward()
        response = self.agent.last.respond(FakeResponse(status, b"Error"))
        step = max(1, len(body) // parts)
        for i in range(0, len(body), step):
            response.send(body[i:i + step])
        response.finish()
        self.assertEqual(self.successResultOf(d), COMPLETE)
        self.assertEqual(self.request.responseCode, status)
        return self.request.body

    def test_llama_servers_errors_pass_unchanged(self) -> None:
        bodies = (
            (501, b'{"error":{"code":501,"message":"This server does not support embeddings. Start it with '
                  b'`--embeddings`","type":"not_supported_error"}}'),
            (400, b'{"error":{"code":400,"message":"the request exceeds the available context size",'
                  b'"type":"exceed_context_size_error","n_prompt_tokens":600,"n_ctx":512}}'),
            (500, b'{"error":{"code":500,"message":"Failed to parse messages: [json.exception.type_error.302] '
                  b'type must be string, but is object","type":"server_error"}}'),
            (503, b'{"error":{"code":503}}'),
        )
        for status, body in bodies:
            for parts in (1, 3):
                self.request = DownstreamRequest()
                self.assertEqual(self.error(status, body, parts), body, (status, parts))

    def test_what_is_not_an_error_object_is_relayed_as_it_came(self) -> None:
        for body in (b'{"error": {"code": null, "message": "m", "type": "t"}}',
                     b"not json", b'{"detail": "no"}', b"[1]", b'{"error": "text"}', b""):
            self.request = DownstreamRequest()
            self.assertEqual(self.error(404, body), body)

    def test_a_long_error_body_is_relayed_as_it_came(self) -> None:
        body = b'{"error":{"code":400,"message":"' + b"x" * 70000 + b'"}}'
        self.assertEqual(self.error(400, body, parts=4), body)

    def test_a_cut_error_body_is_relayed_as_it_came(self) -> None:
        d = self.forward()
        response = self.agent.last.respond(FakeResponse(500, b"Error"))
        response.send(b'{"error":{"code":500,')
        response.cut()
        self.assertEqual(self.successResultOf(d), TRUNCATED)
        self.assertEqual(self.request.body, b'{"error":{"code":500,')

    def test_success_answers_are_never_held(self) -> None:
        self.forward()
        response = self.agent.last.respond(FakeResponse(200))
        response.send(b'{"error":{"code":1')
        self.assertEqual(self.request.body, b'{"error":{"code":1')


#: The ends of an Anthropic Messages stream and of a Responses stream, as
#: llama-server writes them (measured on the build install-llama-server.sh installs).
ANTHROPIC_END = (b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens"},'
                 b'"usage":{"output_tokens":4}}\n\nevent: message_stop\ndata: {"type":"message_stop"}\n\n')
RESPONSES_END = (b'event: response.output_item.done\ndata: {"type":"response.output_item.done"}\n\n'
                 b'event: response.completed\ndata: {"type":"response.completed","response":{"status":"completed",'
                 b'"output":[{"text":"event: response.completed\\n"}]},"timings":{"cache_n":21,"prompt_n":1}}\n\n')


class OtherStreamEndTests(ProxyTestCase):
    """Anthropic's and the Responses API's streams end without ``[DONE]``:
    with ``message_stop`` and ``response.completed``.  A client that closes
    right after the last event had its whole answer (COMPLETE, a 200);
    one that closes before it is gone (499), however the reads split it."""

    def forward_shaped(self, endpoint: str) -> Deferred:
        shape = proxy_module.RequestShape(stream_ends=proxy_module.STREAM_ENDS[endpoint],
                                          api="anthropic" if endpoint == "messages" else "responses")
        return self.proxy.forward(self.request, BASE, f"/v1/{endpoint}", b'{"model": "a"}', True, shape=shape)

    def test_the_last_event_ends_the_answer_however_the_reads_split_it(self) -> None:
        for endpoint, end in (("messages", ANTHROPIC_END), ("responses", RESPONSES_END)):
            wire = b'event: start\ndata: {"type":"start"}\n\n' + end
            for cut in range(1, len(wire)):
                self.request = DownstreamRequest()
                d = self.forward_shaped(endpoint)
                response = self.agent.last.respond(self.event_stream())
                response.send(wire[:cut])
                response.send(wire[cut:])
                self.request.client_gone()
                d.cancel()
                self.assertEqual(self.successResultOf(d), COMPLETE, (endpoint, cut))

    def test_a_close_before_the_last_event_is_over_is_client_gone(self) -> None:
        for endpoint, end in (("messages", ANTHROPIC_END), ("responses", RESPONSES_END)):
            self.request = DownstreamRequest()
            d = self.forward_shaped(endpoint)
            response = self.agent.last.respond(self.event_stream())
            response.send(b'event: x\ndata: {"text":"event: message_stop\\n"}\n\n')  # a token's text
            response.send(end[:-1])  # the last event without its blank line
            self.request.client_gone()
            d.cancel()
            self.assertClientGone(d)

    def test_a_cut_stream_ends_with_the_apis_error_event(self) -> None:
        for endpoint, kind in (("messages", b'"type": "error", "error": {"type": "api_error"'),
                               ("responses", b'"type": "error", "error": {')):
            self.request = DownstreamRequest()
            d = self.forward_shaped(endpoint)
            response = self.agent.last.respond(self.event_stream())
            response.send(b'event: start\ndata: {"type":"start"}\n\n')
            response.cut()
            self.assertEqual(self.successResultOf(d), proxy_module.STREAM_ERROR)
            self.assertIn(b"event: error\ndata: {" + kind, self.request.body)
            self.assertNotIn(b"[DONE]", self.request.body)


class AnsweredTests(ProxyTestCase):
    """A stream whose ``data: [DONE]`` was relayed is a success whatever the
    client does next (the openai SDK v2 closes right after it, without
    reading the end of the chunked body)."""

    def test_a_client_that_closes_right_after_done_was_answered(self) -> None:
        d = self.forward(streaming=True)
        response = self.agent.last.respond(self.event_stream())
        response.send(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n')
        response.send(b'data: {"choices":[{"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
        self.request.client_gone()
        d.cancel()
        self.assertEqual(self.successResultOf(d), COMPLETE)
        self.assertEqual(response.transport.stopped, 1, "the upstream connection is closed all the same")
        response.cut()
        self.assertEqual(self.request.writes_after_gone, [])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_a_done_split_across_reads_counts(self) -> None:
        for cut in range(1, 14):
            self.request = DownstreamRequest()
            d = self.forward(streaming=True)
            response = self.agent.last.respond(self.event_stream())
            wire = b'data: {"n":1}\n\ndata: [DONE]\n\n'
            at = wire.index(b"data: [DONE]") + cut - 1
            response.send(wire[:at])
            response.send(wire[at:])
            d.cancel()
            self.assertEqual(self.successResultOf(d), COMPLETE, cut)

    def test_a_close_before_done_is_still_client_gone(self) -> None:
        d = self.forward(streaming=True)
        response = self.agent.last.respond(self.event_stream())
        response.send(b'data: {"choices":[{"delta":{"content":"data: [DONE]"}}]}\n\n')  # a token's text
        response.send(b"data: [DONE")
        self.request.client_gone()
        d.cancel()
        self.assertClientGone(d)

    def test_a_child_that_dies_after_done_leaves_a_complete_answer(self) -> None:
        d = self.forward(streaming=True)
        response = self.agent.last.respond(self.event_stream())
        response.send(b"data: {}\n\ndata: [DONE]\n\n")
        response.cut()  # before the chunked body's end
        self.assertEqual(self.successResultOf(d), COMPLETE)
        self.assertNotIn(b"upstream_error", self.request.body, "no error event after [DONE]")
        self.assertEqual(self.request.aborted, 0)

    def test_done_is_watched_in_event_streams_only(self) -> None:
        d = self.forward()
        response = self.agent.last.respond(FakeResponse())
        response.send(b'{"x": "\ndata: [DONE]"')
        d.cancel()
        self.assertClientGone(d)


class TimingsTests(ProxyTestCase):
    """``on_timings``: the prompt-token figures of a 2xx answer's ``timings``,
    told once, before the outcome; the body is relayed unchanged."""

    BODY = b'{"choices":[{"text":"hi"}],"timings":{"cache_n":4,"prompt_n":5,"prompt_ms":1.5}}'
    LAST = (b'data: {"choices":[{"finish_reason":"length","delta":{}}],'
            b'"timings":{"cache_n":21,"prompt_n":5,"prompt_ms":138.1}}\n\n')

    def setUp(self) -> None:
        super().setUp()
        self.told: List[Any] = []

    def start(self, streaming: bool = False) -> Deferred:
        d = self.proxy.forward(self.request, BASE, "/v1/chat/completions", b"{}", streaming,
                               on_timings=lambda cached, processed: self.told.append((cached, processed)))
        d.addCallback(lambda outcome: self.told.append(outcome) or outcome)
        return d

    def test_a_body_in_one_read(self) -> None:
        d = self.start()
        response = self.agent.last.respond(FakeResponse())
        response.send(self.BODY)
        response.finish()
        self.assertEqual(self.successResultOf(d), COMPLETE)
        self.assertEqual(self.told, [(4, 5), COMPLETE], "once, before the outcome")
        self.assertEqual(self.request.body, self.BODY)

    def test_timings_split_between_two_reads(self) -> None:
        for cut in (len(self.BODY) - 30, len(self.BODY) - 60, self.BODY.index(b'"timings"') + 3):
            self.told, self.request = [], DownstreamRequest()
            self.start()
            response = self.agent.last.respond(FakeResponse())
            response.send(self.BODY[:cut])
            response.send(self.BODY[cut:])
            response.finish()
            self.assertEqual(self.told, [(4, 5), COMPLETE], cut)
            self.assertEqual(self.request.body, self.BODY)

    def test_an_answer_that_came_whole(self) -> None:
        body = self.BODY

        class Whole(FakeResponse):
            def whole_body(self) -> bytes:
                return body

        d = self.start()
        self.agent.last.respond(Whole())
        self.assertEqual(self.successResultOf(d), COMPLETE)
        self.assertEqual(self.told, [(4, 5), COMPLETE])

    def test_a_stream_is_read_when_its_done_is_in(self) -> None:
        d = self.start(streaming=True)
        response = self.agent.last.respond(self.event_stream())
        response.send(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n')
        response.send(self.LAST)
        self.assertEqual(self.told, [])
        response.send(b"data: [DONE]\n\n")
        self.assertEqual(self.told, [(21, 5)], "at [DONE]: before the openai SDK closes")
        d.cancel()  # the SDK closes right after [DONE]
        self.assertEqual(self.told, [(21, 5), COMPLETE])
        self.assertEqual(self.request.body, b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n' + self.LAST
                         + b"data: [DONE]\n\n")

    def test_a_stream_whose_last_event_and_done_come_together(self) -> None:
        self.start(streaming=True)
        response = self.agent.last.respond(self.event_stream())
        response.send(self.LAST + b"data: [DONE]\n\n")
        response.finish()
        self.assertEqual(self.told, [(21, 5), COMPLETE])

    def test_a_stream_cut_after_its_last_event_still_counts(self) -> None:
        d = self.start(streaming=True)
        response = self.agent.last.respond(self.event_stream())
        response.send(self.LAST)
        response.cut()
        self.assertEqual(self.successResultOf(d), STREAM_ERROR)
        self.assertEqual(self.told, [(21, 5), STREAM_ERROR])

    def test_nothing_without_timings(self) -> None:
        self.start()
        response = self.agent.last.respond(FakeResponse())
        response.send(b'{"object":"list","data":[]}')
        response.finish()
        self.assertEqual(self.told, [COMPLETE])

    def test_an_error_answer_is_not_read(self) -> None:
        self.start()
        response = self.agent.last.respond(FakeResponse(code=500, phrase=b"Internal Server Error"))
        response.send(b'{"error":{"code":500,"message":"x","type":"server_error"},"timings":{"prompt_n":1}}')
        response.finish()
        self.assertEqual(self.told, [COMPLETE])

    def test_without_a_callback_nothing_is_scanned(self) -> None:
        scanned: List[bytes] = []
        self.patch(proxy_module, "prompt_timings", lambda data: scanned.append(data))
        d = self.proxy.forward(self.request, BASE, "/v1/chat/completions", b"{}", False)
        response = self.agent.last.respond(FakeResponse())
        response.send(self.BODY)
        response.finish()
        self.assertEqual((self.successResultOf(d), scanned), (COMPLETE, []))

    def test_a_bug_in_the_callback_is_logged_and_the_answer_still_ends(self) -> None:
        def broken(cached: int, processed: int) -> None:
            raise RuntimeError("bug")

        for streaming in (False, True):
            self.request = DownstreamRequest()
            d = self.proxy.forward(self.request, BASE, "/v1/chat/completions", b"{}", streaming, on_timings=broken)
            response = self.agent.last.respond(self.event_stream() if streaming else FakeResponse())
            response.send(self.LAST + b"data: [DONE]\n\n" if streaming else self.BODY)
            response.finish()
            self.assertEqual(self.successResultOf(d), COMPLETE)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 2)


class FirstReadTests(SynchronousTestCase):
    """A stream's first event, where its completion id is, may come in pieces."""

    def relay(self, found: List[bytes]) -> Any:
        from rolemesh.http.proxy import _Relay

        class Written:
            def write(self, data: bytes) -> None:
                pass

        def first_read(head: bytes) -> bool:
            found.append(head)
            return b'"id":"chatcmpl-1"' in head

        return _Relay(Written(), lambda ok: None, lambda: None, first_read=first_read)  # type: ignore[arg-type]

    def test_an_id_split_over_reads_is_found_then_nothing_more_is_shown(self) -> None:
        found: List[bytes] = []
        relay = self.relay(found)
        for piece in (b'data: {"id":"chat', b'cmpl-1","choices":[]}\n\n', b'data: {"id":"chatcmpl-1"}\n\n'):
            relay.dataReceived(piece)
        self.assertEqual(found, [b'data: {"id":"chat', b'data: {"id":"chatcmpl-1","choices":[]}\n\n'])

    def test_a_stream_without_one_is_shown_at_most_its_first_bytes(self) -> None:
        from rolemesh.http.proxy import FIRST_READ_BYTES

        found: List[bytes] = []
        relay = self.relay(found)
        for _ in range(3):
            relay.dataReceived(b"x" * (FIRST_READ_BYTES // 2))
        self.assertEqual([len(head) for head in found], [FIRST_READ_BYTES // 2, FIRST_READ_BYTES])
