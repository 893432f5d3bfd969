"""The OpenAI-compatible request path end to end: the agent as a process,
real llama-server children (the fake one where a fault needs it), real
clients (the official ``openai`` package and raw HTTP)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time

from twisted.trial.unittest import SynchronousTestCase

from tests.fixtures.llama import read_sse
from tests.integration.harness import (
    AgentProcess,
    pid_alive,
    require_llama_server,
    tiny_model,
    wait_until,
    write_fake_llama_server_bin,
)

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "ignore_eos": True}


class RealModelTests(SynchronousTestCase):
    """One agent, one cpu device, two real tiny models."""

    def setUp(self):
        require_llama_server()
        self.dir = os.path.abspath(self.mktemp())
        a = tiny_model(self.dir, "a", 1)
        b = tiny_model(self.dir, "b", 2)
        self.agent = AgentProcess(self.dir, {"models": [
            {"model_id": "tiny-a", "path": a, "roles": ["chat"]},
            {"model_id": "tiny-b", "path": b, "alias": "bee", "roles": ["embedder"],
             "server_args": {"embeddings": True, "pooling": "mean"}},
        ]})
        self.addCleanup(self.agent.stop)

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.agent.url + "/v1", api_key="unused", max_retries=0, timeout=30)

    def test_openai_client_chat_stream_completion_embedding(self):
        client = self.client()
        chat = client.chat.completions.create(model="tiny-a", messages=CHAT["messages"], max_tokens=4,
                                              extra_body={"ignore_eos": True})
        self.assertEqual(chat.object, "chat.completion")
        self.assertEqual(chat.usage.completion_tokens, 4)
        self.assertEqual(chat.model, "tiny-a")

        chunks = list(client.chat.completions.create(model="chat", messages=CHAT["messages"], max_tokens=6,
                                                     stream=True, extra_body={"ignore_eos": True}))
        self.assertGreater(len(chunks), 2)
        self.assertEqual(chunks[-1].choices[0].finish_reason, "length")

        completion = client.completions.create(model="tiny-a", prompt="once upon", max_tokens=3)
        self.assertEqual(completion.object, "text_completion")

        embedding = client.embeddings.create(model="bee", input="hello")
        self.assertEqual(len(embedding.data), 1)
        self.assertGreater(len(embedding.data[0].embedding), 8)

    def test_models_lists_config_with_roles_and_where_loaded(self):
        status, _, body = self.agent.request("POST", "/v1/chat/completions", {"model": "tiny-a", **CHAT})
        self.assertEqual(status, 200)
        status, _, body = self.agent.request("GET", "/v1/models")
        models = {m["id"]: m for m in json.loads(body)["data"]}
        self.assertEqual(set(models), {"tiny-a", "tiny-b"})
        self.assertEqual(models["tiny-a"]["loaded_on"], ["cpu:0"])
        self.assertEqual(models["tiny-b"]["roles"], ["embedder"])
        self.assertEqual(models["tiny-b"]["aliases"], ["tiny-b", "bee"])

    def test_alternating_models_switch_the_child(self):
        pids = []
        for name in ("tiny-a", "tiny-b", "tiny-a"):
            status, _, body = self.agent.request("POST", "/v1/chat/completions", {"model": name, **CHAT})
            self.assertEqual(status, 200, body)
            device = self.agent.inventory()["devices"][0]
            self.assertEqual(device["model"], name)
            pids.append(device["pid"])
        self.assertEqual(len(set(pids)), 3)
        self.assertFalse(any(pid_alive(p) for p in pids[:2]))

    def test_errors(self):
        status, _, body = self.agent.request("POST", "/v1/chat/completions", {"model": "nope", **CHAT})
        self.assertEqual((status, json.loads(body)["error"]["code"]), (404, "model_not_found"))
        status, _, body = self.agent.request("POST", "/v1/chat/completions", b"{not json")
        self.assertEqual(status, 400)
        self.assertIn("not valid JSON", json.loads(body)["error"]["message"])
        status, _, body = self.agent.request("POST", "/v1/chat/completions", b"[1, 2]")
        self.assertEqual(status, 400)
        status, _, body = self.agent.request("POST", "/v1/chat/completions", {"messages": []})
        self.assertEqual(status, 400)
        # llama-server's own errors pass through unchanged: status, type and
        # code as it sent them (its code is the status, a number), and the
        # device still works.
        status, _, body = self.agent.request("POST", "/v1/chat/completions",
                                             {"model": "tiny-a", "messages": "not a list"})
        self.assertEqual(status, 400, body)
        self.assertEqual(json.loads(body)["error"]["code"], 400, body.decode())
        # Messages or tools llama-server's chat parser cannot read: its own
        # 500 "Failed to parse messages: ..." (or tools), as it sent it.
        hi = [{"role": "user", "content": "hi"}]
        for fields in ({"messages": [{"role": 3, "content": "hi"}]}, {"messages": hi, "tools": "x"}):
            status, _, body = self.agent.request("POST", "/v1/chat/completions",
                                                 {"model": "tiny-a", "max_tokens": 2, **fields})
            self.assertEqual(status, 500, body)
            self.assertTrue(json.loads(body)["error"]["message"].startswith(
                ("Failed to parse messages: ", "Failed to parse tools: ")), body)
        # tiny-a is not started with --embeddings: llama-server's 501, unchanged.
        status, headers, body = self.agent.request("POST", "/v1/embeddings", {"model": "tiny-a", "input": "hi"})
        self.assertEqual(status, 501, body)
        self.assertEqual(json.loads(body)["error"], {"code": 501, "message": json.loads(body)["error"]["message"],
                                                      "type": "not_supported_error"}, body)
        self.assertEqual(int(headers["content-length"]), len(body))
        status, _, _ = self.agent.request("POST", "/v1/chat/completions", {"model": "tiny-a", **CHAT})
        self.assertEqual(status, 200)

    def test_sigkill_of_agent_leaves_no_child_and_next_start_is_clean(self):
        self.agent.request("POST", "/v1/chat/completions", {"model": "tiny-a", **CHAT})
        child = self.agent.child_pids()[0]
        self.agent.process.send_signal(signal.SIGKILL)
        self.agent.process.wait(10)
        waited = wait_until(lambda: not pid_alive(child), 5, what="child death after agent SIGKILL")
        self.assertLess(waited, 5)
        again = AgentProcess(self.dir, {"models": [{"model_id": "tiny-a", "path": tiny_model(self.dir, "a", 1)}]})
        self.addCleanup(again.stop)
        self.assertEqual(again.inventory()["devices"][0]["pid"], None)
        self.assertEqual(again.stop(), 0)


class FakeChildTests(SynchronousTestCase):
    """Faults that need a scripted child: slow, hanging, crashing."""

    def agent(self, flags, **top):
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        fake = write_fake_llama_server_bin(self.dir)
        model = os.path.join(self.dir, "m.gguf")
        open(model, "wb").close()
        config = {"llama_server_bin": fake, "models": [{"model_id": "m", "path": model}], **top}
        agent = AgentProcess(self.dir, config, env={"FAKE_LLAMA": flags})
        self.addCleanup(agent.stop)
        return agent

    def stream(self, agent, max_tokens):
        conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=30)
        conn.request("POST", "/v1/chat/completions",
                     json.dumps({"model": "m", "stream": True, **CHAT, "max_tokens": max_tokens}),
                     {"Content-Type": "application/json"})
        return conn, conn.getresponse()

    def test_stream_chunks_arrive_incrementally(self):
        agent = self.agent("slow_tokens=0.2")
        started = time.monotonic()
        conn, response = self.stream(agent, 5)
        first = response.readline()
        first_at = time.monotonic() - started
        rest = response.read()
        total = time.monotonic() - started
        conn.close()
        self.assertTrue(first.startswith(b"data: "), first)
        self.assertIn(b"data: [DONE]", rest)
        self.assertLess(first_at, total - 0.5, "the first event came only with the rest")
        self.assertEqual(response.getheader("x-accel-buffering"), "no")

    def test_exactly_one_429_past_the_pending_limit(self):
        agent = self.agent("slow_tokens=0.1", max_pending_requests_per_device=2)
        agent.request("POST", "/v1/chat/completions", {"model": "m", **CHAT})  # load first
        results = []

        def call():
            status, headers, _ = agent.request("POST", "/v1/chat/completions",
                                               {"model": "m", **CHAT, "max_tokens": 10})
            results.append((status, headers.get("retry-after")))

        threads = [threading.Thread(target=call) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        statuses = sorted(s for s, _ in results)
        self.assertEqual(statuses, [200, 200, 429])
        self.assertIsNotNone([r for s, r in results if s == 429][0])

    def test_disconnecting_stream_frees_the_device(self):
        agent = self.agent("slow_tokens=0.05")
        conn, response = self.stream(agent, 1000)
        self.assertTrue(response.readline().startswith(b"data: "))
        conn.sock.close()
        conn.close()
        wait_until(lambda: agent.inventory()["devices"][0]["in_flight"] == 0, 5, what="slot freed")
        status, _, _ = agent.request("POST", "/v1/chat/completions", {"model": "m", **CHAT})
        self.assertEqual(status, 200)

    def test_child_killed_mid_stream_gives_sse_error_then_recovers(self):
        agent = self.agent("slow_tokens=0.05")
        conn, response = self.stream(agent, 1000)
        self.assertTrue(response.readline().startswith(b"data: "))
        os.kill(agent.child_pids()[0], signal.SIGKILL)
        events = read_sse(response.read())
        conn.close()
        self.assertGreater(len(events), 1, events)
        self.assertEqual(events[-1], "[DONE]", events)
        self.assertEqual(json.loads(events[-2])["error"]["code"], "upstream_error")
        # At once, whether or not the agent has heard of the exit yet.
        status, _, body = agent.request("POST", "/v1/chat/completions", {"model": "m", **CHAT})
        self.assertEqual(status, 200, body)

    def holding(self, agent, count):
        """Wait until ``count`` children in all have taken a request and hold it."""
        wait_until(lambda: agent.request("GET", "/v1/node/devices/cpu:0/logs?tail=1000")[2]
                   .count(b"hang_requests: holding") >= count, 10, what=f"{count} children holding the request")

    def call_in_thread(self, agent):
        result = []
        t = threading.Thread(target=lambda: result.append(
            agent.request("POST", "/v1/chat/completions", {"model": "m", **CHAT}, timeout=30)))
        t.start()
        return t, result

    def test_child_killed_holding_a_request_is_replaced_and_the_request_retried_once(self):
        marker = os.path.join(os.path.abspath(self.mktemp()))
        open(marker, "w").close()
        agent = self.agent(f"once_file={marker},hang_requests")  # only the first child hangs
        t, result = self.call_in_thread(agent)
        self.holding(agent, 1)
        os.kill(agent.child_pids()[0], signal.SIGKILL)
        t.join(30)
        status, _, body = result[0]
        self.assertEqual(status, 200, body)
        self.assertEqual(agent.inventory()["devices"][0]["restarts"], 1)

    def test_child_killed_holding_a_request_twice_gives_502(self):
        agent = self.agent("hang_requests")  # every child hangs
        t, result = self.call_in_thread(agent)
        self.holding(agent, 1)
        os.kill(agent.child_pids()[0], signal.SIGKILL)
        self.holding(agent, 2)  # the retry, on a fresh child
        os.kill(agent.child_pids()[0], signal.SIGKILL)
        t.join(30)
        status, _, body = result[0]
        self.assertEqual((status, json.loads(body)["error"]["code"]), (502, "upstream_error"))

    def test_startup_timeout_is_503_with_retry_after(self):
        agent = self.agent("never_ready", llama_server_startup_timeout_s=1.0)
        status, headers, body = agent.request("POST", "/v1/chat/completions", {"model": "m", **CHAT})
        self.assertEqual(status, 503)
        self.assertEqual(json.loads(body)["error"]["code"], "model_load_timeout")
        self.assertIn("retry-after", headers)

    def test_upstream_timeout_is_504_and_device_recovers(self):
        agent = self.agent("hang_requests", request_timeout_s=1.0)
        status, _, body = agent.request("POST", "/v1/chat/completions", {"model": "m", **CHAT})
        self.assertEqual((status, json.loads(body)["error"]["code"]), (504, "upstream_timeout"))
        self.assertEqual(agent.inventory()["devices"][0]["in_flight"], 0)
