"""Start-up and shutdown of the agent process: graceful drain, second signal,
no children left behind."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time

from twisted.trial.unittest import SynchronousTestCase

from tests.fixtures.llama import read_sse
from tests.integration.harness import AgentProcess, pid_alive, wait_until, write_fake_llama_server_bin

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class DrainTests(SynchronousTestCase):
    def agent(self, flags, **top):
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        model = os.path.join(self.dir, "m.gguf")
        open(model, "wb").close()
        config = {"llama_server_bin": write_fake_llama_server_bin(self.dir),
                  "models": [{"model_id": "m", "path": model}], **top}
        agent = AgentProcess(self.dir, config, env={"FAKE_LLAMA": flags})
        self.addCleanup(agent.stop)
        return agent

    def start_stream(self, agent, tokens):
        conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=30)
        conn.request("POST", "/v1/chat/completions", json.dumps({**CHAT, "stream": True, "max_tokens": tokens}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        self.assertTrue(response.readline().startswith(b"data: "))
        return conn, response

    def test_drain_lets_a_stream_finish_refuses_new_requests_then_exits_0(self):
        agent = self.agent("slow_tokens=0.1", shutdown_grace_s=30)
        conn, response = self.start_stream(agent, 20)
        child = agent.child_pids()[0]
        agent.process.send_signal(signal.SIGTERM)
        status, headers, body = agent.request("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 1})
        self.assertEqual(status, 503)
        self.assertEqual(json.loads(body)["error"]["code"], "shutting_down")
        events = read_sse(response.read())
        conn.close()
        self.assertEqual(events[-1], "[DONE]", "the in-flight stream finished")
        self.assertEqual(agent.process.wait(30), 0)
        wait_until(lambda: not pid_alive(child), 5, what="child gone")
        self.assertIn("draining 1 request(s) in flight, up to 30 s; signal again (Ctrl-C) to stop now",
                      agent.log_text())

    def test_request_waiting_on_a_load_gets_shutting_down_not_an_empty_reply(self):
        agent = self.agent("slow_start=20", shutdown_grace_s=30)
        answers = []
        thread = threading.Thread(target=lambda: answers.append(
            agent.request("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 1}, timeout=30)), daemon=True)
        thread.start()
        wait_until(lambda: agent.inventory()["devices"][0]["state"] == "starting", 10, interval=0.02,
                   what="the request waiting on the load")
        agent.process.send_signal(signal.SIGTERM)
        thread.join(30)
        self.assertFalse(thread.is_alive())
        status, _, body = answers[0]
        self.assertEqual(status, 503, body)
        self.assertEqual(json.loads(body)["error"]["code"], "shutting_down")
        self.assertEqual(agent.process.wait(30), 0)
        self.assertIn("shutting down: no request in flight", agent.log_text())

    def test_drain_grace_bounds_the_wait(self):
        agent = self.agent("slow_tokens=0.2", shutdown_grace_s=1)
        conn, response = self.start_stream(agent, 1000)
        child = agent.child_pids()[0]
        started = time.monotonic()
        agent.process.send_signal(signal.SIGTERM)
        self.assertEqual(agent.process.wait(30), 0)
        self.assertLess(time.monotonic() - started, 15)
        conn.close()
        wait_until(lambda: not pid_alive(child), 5, what="child gone")

    def test_second_signal_skips_the_drain(self):
        agent = self.agent("slow_tokens=0.2", shutdown_grace_s=60)
        conn, response = self.start_stream(agent, 1000)
        agent.process.send_signal(signal.SIGTERM)
        status, _, _ = agent.request("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 1})
        self.assertEqual(status, 503)  # draining now
        started = time.monotonic()
        agent.process.send_signal(signal.SIGINT)
        self.assertEqual(agent.process.wait(30), 0)
        self.assertLess(time.monotonic() - started, 20, "did not wait for the 60 s grace")
        conn.close()
