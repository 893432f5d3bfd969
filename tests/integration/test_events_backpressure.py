"""A reader of ``GET /v1/node/events`` that does not read is cut off, through
the real listener (``GuardedSite`` with its ``FastChannel``) on a real TCP
socket: the agent's memory for it stays bounded however many events come.

In process, on the real reactor: the node and its feed are the unit tests'
(a Clock, fake children), the HTTP path is the agent's own."""

from __future__ import annotations

import socket

from twisted.internet import reactor, task
from twisted.internet.defer import inlineCallbacks
from twisted.trial.unittest import TestCase

from rolemesh.api.node_routes import SSE_MAX_BACKLOG
from rolemesh.http.listener import GuardedSite
from rolemesh.node import feed as ne
from tests.api.test_app import ApiHarness

KEY = "k-backpressure"


class SlowReaderTests(TestCase):
    timeout = 60

    @inlineCallbacks
    def test_a_reader_that_does_not_read_is_cut_off(self):  # type: ignore[no-untyped-def]
        h = ApiHarness(keys=(KEY,))
        site = GuardedSite(h.api.resource(), reactor=reactor, idle_timeout=60, request_read_timeout=30,
                           fast_routes=h.api.fast_routes(), head_policy=h.api)
        port = reactor.listenTCP(0, site, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        client = socket.socket()
        self.addCleanup(client.close)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", port.getHost().port))
        client.sendall(f"GET /v1/node/events HTTP/1.1\r\nHost: node\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())

        for _ in range(500):  # the route subscribes the reader (bounded wait)
            if len(h.node.feed):
                break
            yield task.deferLater(reactor, 0.01, lambda: None)
        self.assertEqual(len(h.node.feed), 1)

        message = "x" * 900
        published = 0
        while len(h.node.feed) and published < 50_000:  # ~45 MB if it were all kept
            for _ in range(100):
                h.node.feed.publish(ne.READY, "gpu:0", "a", state="ready", message=message)
            published += 100
            yield task.deferLater(reactor, 0, lambda: None)  # the reactor writes what it can
        self.assertEqual(len(h.node.feed), 0, f"still subscribed after {published} events")
        # Cut off once the socket buffers (a few MB at most on loopback) and the
        # bounded backlog are full: 800 events of ~1 KB on the development machine.
        self.assertLess(published * 1000, 8 * 2**20 + SSE_MAX_BACKLOG)

        client.setblocking(False)
        received, closed = 0, False
        for _ in range(500):
            try:
                chunk = client.recv(65536)
            except BlockingIOError:
                yield task.deferLater(reactor, 0.01, lambda: None)
                continue
            except ConnectionResetError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            received += len(chunk)
        self.assertTrue(closed, "the connection of a reader that did not read stays open")
        self.assertLess(received, published * 1000)
