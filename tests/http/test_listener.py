"""The listening Site's limits: read deadline (slow loris) and connection cap."""

from __future__ import annotations

from twisted.internet.address import IPv4Address
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from rolemesh.http.listener import GuardedSite


class Hello(Resource):
    isLeaf = True

    def render_GET(self, request):
        return b"hello"

    def render_POST(self, request):
        if request.body_too_large:
            request.setResponseCode(413)
            return b"too large"
        return b"got %d" % len(request.content.read())


class ListenerTests(SynchronousTestCase):
    def setUp(self):
        self.reactor = MemoryReactorClock()
        self.site = GuardedSite(Hello(), reactor=self.reactor, idle_timeout=60, request_read_timeout=5,
                                max_connections=2, max_body_bytes=10)

    def connect(self):
        channel = self.site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 5000))
        if channel is None:
            return None, None
        transport = StringTransport()
        channel.makeConnection(transport)
        return channel, transport

    def test_slow_loris_is_cut_off_even_while_dripping(self):
        channel, transport = self.connect()
        for byte in b"GET / HTTP/1.1\r\nHost: x\r\n":
            channel.dataReceived(bytes([byte]))
            self.reactor.advance(0.1)  # each byte resets twisted.web's idle timeout
        self.assertFalse(transport.disconnecting)  # 2.6 s in
        self.reactor.advance(2.5)
        self.assertTrue(transport.disconnecting or transport.disconnected)

    def test_prompt_request_is_answered_and_deadline_rearmed_for_keep_alive(self):
        channel, transport = self.connect()
        channel.dataReceived(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"hello", transport.value())
        self.assertFalse(transport.disconnecting)
        self.reactor.advance(5)  # an idle keep-alive connection has 5 s to send its next request
        self.assertTrue(transport.disconnecting or transport.disconnected)

    def test_connection_cap(self):
        first, _ = self.connect()
        second, _ = self.connect()
        third, _ = self.connect()
        self.assertIsNotNone(first)
        self.assertIsNotNone(second)
        self.assertIsNone(third)
        first.connectionLost(None)
        again, _ = self.connect()
        self.assertIsNotNone(again)

    def test_no_access_log_line(self):
        self.assertIsNone(self.site.log(object()))

    def post(self, body, chunked=False):
        channel, transport = self.connect()
        if chunked:
            data = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 4]), body[i:i + 4]) for i in range(0, len(body), 4))
            channel.dataReceived(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                 + data + b"0\r\n\r\n")
        else:
            channel.dataReceived(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        return transport.value()

    def test_body_within_limit_is_kept(self):
        self.assertIn(b"got 10", self.post(b"x" * 10))

    def test_declared_large_body_is_not_stored(self):
        self.assertIn(b"413", self.post(b"x" * 11))

    def test_chunked_large_body_is_not_stored(self):
        self.assertIn(b"413", self.post(b"x" * 40, chunked=True))
        self.assertIn(b"got 8", self.post(b"x" * 8, chunked=True))
