"""A refusal from the head that a plain client can read: a real agent, real sockets.

``http.client`` (and ``urllib``) send the whole body before they read: the
agent answers 413 or 401 from the head, reads and drops the rest of the
body (lingering.py), then closes, so the client reads its answer instead
of ``BrokenPipeError``.  Each test runs on the fast path and, in the
subclass, with ``fast_path: false``.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from typing import Dict, List

from twisted.trial.unittest import SynchronousTestCase

from rolemesh.http import lingering
from tests.integration.harness import AgentProcess, require_llama_server, shared_agent
from tests.integration.test_listener_bytes import rss_bytes

KEY = "linger-key"
LIMIT = 1 << 20


class LingeringCloseTests(SynchronousTestCase):
    fast_path = True
    _agents: Dict[bool, AgentProcess] = {}

    def setUp(self) -> None:
        require_llama_server()
        self.agent = shared_agent(self._agents, self.fast_path, "lingering",
                                  {"api_key": KEY, "max_request_body_bytes": LIMIT}, preload=False)

    def post(self, body: bytes, headers: Dict[str, str]) -> http.client.HTTPResponse:
        connection = http.client.HTTPConnection("127.0.0.1", self.agent.port, timeout=30)
        self.addCleanup(connection.close)
        connection.request("POST", "/v1/chat/completions", body=body,
                           headers={"Content-Type": "application/json", **headers})
        return connection.getresponse()

    def test_http_client_posting_8_mib_over_a_1_mib_limit_reads_the_413(self) -> None:
        body = json.dumps({"model": "tiny-a", "messages": [{"role": "user", "content": "x" * (8 << 20)}]}).encode()
        started = time.monotonic()
        response = self.post(body, {"Authorization": f"Bearer {KEY}"})
        self.assertEqual(response.status, 413)
        self.assertEqual(response.getheader("Connection"), "close")
        error = json.loads(response.read())["error"]
        self.assertEqual(error["code"], "request_too_large")
        self.assertIn(f"larger than {LIMIT} bytes", error["message"])
        self.assertLess(time.monotonic() - started, lingering.IDLE_S, "closed when the body ended, not at a bound")

    def test_http_client_without_a_key_reads_the_401(self) -> None:
        response = self.post(b"{" + b" " * (LIMIT - 100) + b"}", {})  # within the limit: the key decides
        self.assertEqual(response.status, 401)
        self.assertEqual(json.loads(response.read())["error"]["code"], "invalid_api_key")

    def test_48_keyless_clients_sending_without_end_keep_the_rss_flat(self) -> None:
        """Each sends a chunked body for 4 s (chunked: the body limit says
        nothing from the head, the missing key does): read and dropped, none of it kept."""
        pid = self.agent.process.pid
        socks = [socket.create_connection(("127.0.0.1", self.agent.port), timeout=10) for _ in range(48)]
        sent: List[int] = [0] * len(socks)
        stop = threading.Event()

        def send(i: int) -> None:
            chunk = b"10000\r\n" + b"x" * (64 << 10) + b"\r\n"
            try:
                while not stop.is_set():
                    socks[i].sendall(chunk)
                    sent[i] += len(chunk)
            except OSError:  # cut at a bound
                pass

        try:
            for sock in socks:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            answers = [sock.recv(12) for sock in socks]  # from the head, before any of the body
            before = rss_bytes(pid)
            threads = [threading.Thread(target=send, args=(i,)) for i in range(len(socks))]
            for thread in threads:
                thread.start()
            time.sleep(4)  # the load itself: how long they send (nothing is waited for)
            during = rss_bytes(pid)
            stop.set()
            for thread in threads:
                thread.join(30)
        finally:
            stop.set()
            for sock in socks:
                sock.close()
        grown = during - before
        print(f"\n48 keyless clients sent {sum(sent) / (1 << 20):.0f} MiB in 4 s; agent RSS grew by "
              f"{grown / (1 << 20):.1f} MiB ({before / (1 << 20):.0f} -> {during / (1 << 20):.0f} MiB)")
        self.assertGreater(sum(sent), 48 * LIMIT, "the bodies were read (else nothing was measured)")
        self.assertLess(grown, 16 << 20, f"RSS grew by {grown} bytes")
        self.assertEqual(set(answers), {b"HTTP/1.1 401"}, answers)


class LingeringCloseWithoutFastPathTests(LingeringCloseTests):
    fast_path = False
