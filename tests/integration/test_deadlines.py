"""No unbounded wait on the request path, against the agent as a process:
a stream whose child goes silent (SIGSTOP) ends with an SSE error event
within ``stream_idle_timeout_s`` and the child is replaced; a body cut by a
dying child reaches a real HTTP client as cut; a request waiting too long in
a device queue gets 503 ``queue_timeout``."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import time

from tests.fixtures.llama import http_request, read_sse
from tests.integration.harness import pid_alive, wait_until
from tests.integration.test_faults import MESSAGES, FaultTestCase


class StreamIdleTests(FaultTestCase):
    def test_a_stream_gone_silent_ends_with_an_error_event_and_the_child_is_replaced(self) -> None:
        agent = self.start_agent(self.fake_config(stream_idle_timeout_s=1, llama_server_stop_timeout_s=1),
                                 env={"FAKE_LLAMA": "slow_tokens=0.05"})
        self.assert_chat_ok(agent)
        child = self.device(agent)["pid"]
        conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=30)
        conn.request("POST", "/v1/chat/completions",
                     json.dumps({"model": "m", "messages": MESSAGES, "max_tokens": 1000, "stream": True}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        self.assertTrue(response.readline().startswith(b"data: "))
        os.kill(child, signal.SIGSTOP)  # a hung GPU, as far as the agent can tell
        try:
            started = time.monotonic()
            events = read_sse(response.read())
            took = time.monotonic() - started
        finally:
            conn.close()
            if pid_alive(child):
                os.kill(child, signal.SIGCONT)
        self.assertLess(took, 15, "bounded by stream_idle_timeout_s, not by the client")
        self.assertEqual(events[-1], "[DONE]")
        self.assertIn("stream_idle_timeout_s", json.dumps(events[-2]))
        wait_until(lambda: self.device(agent)["pid"] != child or not pid_alive(child), 20,
                   what="the silent child replaced")
        self.assert_chat_ok(agent)
        self.assertNotEqual(self.device(agent)["pid"], child)
        self.assertIn("went silent", agent.log_text())
        self.stop_and_assert_no_orphans(agent)


class CutBodyTests(FaultTestCase):
    def test_a_body_cut_by_a_dying_child_reaches_the_client_as_cut(self) -> None:
        agent = self.start_agent(self.fake_config(), env={"FAKE_LLAMA": "crash_mid_body"})
        conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=30)
        conn.request("POST", "/v1/chat/completions",
                     json.dumps({"model": "m", "messages": MESSAGES, "max_tokens": 20}),
                     {"Content-Type": "application/json"})
        # The client sees a reset or a short read -- never a clean end of a
        # partial answer (which a final chunk after loseConnection gave).
        with self.assertRaises((http.client.IncompleteRead, http.client.RemoteDisconnected, ConnectionError)):
            response = conn.getresponse()
            body = response.read()
            self.fail(f"a cut answer read as complete: {response.status} {body!r}")
        conn.close()
        self.assertEqual(agent.stop(timeout=30), 0)


class QueueDeadlineTests(FaultTestCase):
    def test_a_request_waiting_past_queue_timeout_gets_503_and_the_next_one_works(self) -> None:
        agent = self.start_agent(self.fake_config(queue_timeout_s=1, max_pending_requests_per_device=3),
                                 env={"FAKE_LLAMA": "slow_tokens=0.2"})
        self.assert_chat_ok(agent)
        holder, held = self.in_thread(lambda: agent.request(
            "POST", "/v1/chat/completions",
            {"model": "m", "messages": MESSAGES, "max_tokens": 25, "stream": True}, timeout=30))
        wait_until(lambda: self.device(agent)["in_flight"] == 1, 10, interval=0.02, what="the first request running")
        answer = self.chat(agent)
        error = self.assert_error(answer, 503, "queue_timeout")
        self.assertIn("queue_timeout_s", error["message"])
        self.assertIsNotNone(answer[1].get("retry-after"))
        status, _, _ = self.joined(holder, held)
        self.assertEqual(status, 200)
        self.assertEqual(self.device(agent)["queued"], 0)
        self.assert_chat_ok(agent)
        self.stop_and_assert_no_orphans(agent)


def tcp_buffer_max(name: str) -> int:
    """The largest TCP buffer Linux may give a socket (``tcp_rmem``/``tcp_wmem``)."""
    with open(f"/proc/sys/net/ipv4/{name}", encoding="ascii") as f:
        return int(f.read().split()[2])


class BackpressureTests(FaultTestCase):
    """A client that stops reading pauses llama-server's socket through the
    agent (real sockets end to end): the child stops being able to write,
    and the agent does not buffer the answer in memory."""

    def test_a_slow_client_pauses_the_upstream(self) -> None:
        agent = self.start_agent(self.fake_config(), env={"FAKE_LLAMA": "event_bytes=65536"})
        self.assert_chat_ok(agent)
        port = self.device(agent)["port"]

        def sent() -> int:
            status, _, body = http_request("GET", f"http://127.0.0.1:{port}/fake/info", timeout=10)
            return json.loads(body)["stream_bytes_sent"]

        before = sent()
        # What the sockets on the way can hold once the client stops reading:
        # the child's send buffer, the agent's receive buffer from it (Linux
        # autotunes it up to tcp_rmem's maximum), the agent's send buffer to
        # the client, the client's receive buffer (pinned small below), and
        # some slack for what the agent holds itself.
        bound = tcp_buffer_max("tcp_rmem") + 2 * tcp_buffer_max("tcp_wmem") + (8 << 20)
        events = max(1000, 2 * bound // 65536 + 1)
        total = events * 65536  # twice what the buffers hold: without backpressure, all of it is written
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # before connect: no autotuning
        client.settimeout(60)
        client.connect(("127.0.0.1", agent.port))
        conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=60)
        conn.sock = client
        conn.request("POST", "/v1/chat/completions",
                     json.dumps({"model": "m", "messages": MESSAGES, "max_tokens": events, "stream": True}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        self.assertTrue(response.readline().startswith(b"data: "))
        # The client reads nothing more: the child's writes must stall.
        readings = [sent()]

        def plateau() -> bool:
            readings.append(sent())
            return len(readings) > 3 and readings[-1] == readings[-4]

        wait_until(plateau, 30, interval=0.3, what="the child's writes stalled")
        stalled_at = readings[-1] - before
        self.assertLess(stalled_at, bound, f"the child wrote {stalled_at} bytes into a client that reads nothing")
        events = read_sse(response.read())  # now read it all: it resumes and completes
        conn.close()
        self.assertEqual(events[-1], "[DONE]")
        self.assertGreaterEqual(sent() - before, total)
        self.stop_and_assert_no_orphans(agent)
