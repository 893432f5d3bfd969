"""``GET /metrics`` end to end: the agent as a process, requests over HTTP,
the exposition parsed with ``prometheus_client.parser``."""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, List, Optional

from prometheus_client.parser import text_string_to_metric_families
from twisted.trial.unittest import SynchronousTestCase

from tests.integration.harness import (
    AgentProcess,
    mem_total_bytes,
    require_llama_server,
    tiny_model,
    wait_until,
    write_fake_llama_server_bin,
)

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
CHAT_PATH = "/v1/chat/completions"




def scrape(agent: AgentProcess) -> Dict[str, Any]:
    status, headers, body = agent.request("GET", "/metrics")
    assert status == 200, body
    assert headers["content-type"].startswith("text/plain"), headers
    return {f.name: f for f in text_string_to_metric_families(body.decode("utf-8"))}


def value(families: Dict[str, Any], sample_name: str, **labels: str) -> Optional[float]:
    found = [s.value for f in families.values() for s in f.samples if s.name == sample_name and s.labels == labels]
    assert len(found) <= 1, (sample_name, labels, found)
    return found[0] if found else None


class FakeChildMetricsTests(SynchronousTestCase):
    """Request counters by status (200, 404, 429, 503) with the fake llama-server."""

    def agent(self, flags: str, **top: Any) -> AgentProcess:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        fake = write_fake_llama_server_bin(self.dir)
        model = os.path.join(self.dir, "m.gguf")
        open(model, "wb").close()
        config = {"llama_server_bin": fake, "models": [{"model_id": "m", "path": model}], **top}
        agent = AgentProcess(self.dir, config, env={"FAKE_LLAMA": flags})
        self.addCleanup(agent.stop)
        return agent

    def test_counters_move_with_requests(self) -> None:
        agent = self.agent("slow_tokens=0.1", max_pending_requests_per_device=2)
        before = scrape(agent)
        self.assertEqual(value(before, "rolemesh_model_loads_total", device="cpu:0", model="m"), 0)
        self.assertEqual(value(before, "rolemesh_child_state", device="cpu:0", state="stopped"), 1)

        status, _, body = agent.request("POST", CHAT_PATH, {"model": "m", **CHAT})  # loads the model
        self.assertEqual(status, 200, body)
        status, _, body = agent.request("POST", CHAT_PATH, {"model": "no-such-model", **CHAT})
        self.assertEqual(status, 404, body)

        results: List[int] = []

        def call() -> None:
            results.append(agent.request("POST", CHAT_PATH, {"model": "m", **CHAT, "max_tokens": 10}, timeout=30)[0])

        threads = [threading.Thread(target=call) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        self.assertEqual(sorted(results), [200, 200, 429])

        total = "rolemesh_requests_total"
        chat = "chat/completions"
        # Requests are counted a moment after their answer went out.
        wait_until(lambda: value(scrape(agent), "rolemesh_request_duration_seconds_count", model="m",
                                 endpoint=chat) == 4, 5, what="all four requests counted")
        families = scrape(agent)
        self.assertEqual(value(families, total, model="m", endpoint=chat, status="200"), 3)
        self.assertEqual(value(families, total, model="m", endpoint=chat, status="429"), 1)
        self.assertEqual(value(families, total, model="unknown", endpoint=chat, status="404"), 1)
        self.assertEqual(value(families, "rolemesh_queue_full_total", model="m"), 1)
        self.assertEqual(value(families, "rolemesh_request_duration_seconds_count", model="m", endpoint=chat), 4)
        self.assertEqual(value(families, "rolemesh_request_ttfb_seconds_count", model="m", endpoint=chat), 3)

        self.assertEqual(value(families, "rolemesh_model_loads_total", device="cpu:0", model="m"), 1)
        self.assertEqual(value(families, "rolemesh_model_load_duration_seconds_count", device="cpu:0", model="m"), 1)
        self.assertGreater(
            value(families, "rolemesh_model_load_duration_seconds_sum", device="cpu:0", model="m") or 0, 0
        )
        self.assertEqual(value(families, "rolemesh_child_state", device="cpu:0", state="ready"), 1)
        self.assertEqual(value(families, "rolemesh_child_model", device="cpu:0", model="m"), 1)
        self.assertEqual(value(families, "rolemesh_device_in_flight", device="cpu:0"), 0)
        self.assertEqual(value(families, "rolemesh_device_queue_depth", device="cpu:0"), 0)

        self.assertEqual(value(families, "rolemesh_device_memory_total_bytes", device="cpu:0"), mem_total_bytes())
        self.assertEqual(value(families, "rolemesh_device_metrics_stale", device="cpu:0"), 0)
        self.assertIsNotNone(value(families, "rolemesh_device_metrics_sample_age_seconds", device="cpu:0"))
        self.assertEqual(
            value(
                families,
                "rolemesh_node_info",
                node_id="it-node",
                backend="cpu",
                version=__import__("rolemesh").__version__,
            ),
            1,
        )
        # standalone: no dispatcher metrics
        self.assertEqual([n for n in families if n.startswith("rolemesh_dispatcher")], [])

    def test_a_stream_closed_right_after_done_is_a_success(self) -> None:
        # The openai SDK closes the response right after `data: [DONE]`,
        # without reading the chunked body's end: the child here waits 0.5 s
        # between the two, so the close always comes first.  Counted and
        # logged as 200, not 499.
        import http.client

        import openai

        agent = self.agent("done_end_delay=0.5")
        client = openai.OpenAI(base_url=agent.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        chunks = list(client.chat.completions.create(model="m", stream=True, **CHAT))
        self.assertGreater(len(chunks), 1)
        conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=30)  # raw: close at [DONE]
        conn.request("POST", CHAT_PATH, b'{"model": "m", "stream": true, "max_tokens": 3, "messages": []}',
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        seen = b""
        while b"data: [DONE]" not in seen:
            line = response.readline()
            self.assertTrue(line, seen)
            seen += line
        conn.sock.shutdown(2)
        conn.close()
        chat = "chat/completions"
        wait_until(lambda: value(scrape(agent), "rolemesh_request_duration_seconds_count", model="m",
                                 endpoint=chat) == 2, 5, what="both streams counted")
        families = scrape(agent)
        self.assertEqual(value(families, "rolemesh_requests_total", model="m", endpoint=chat, status="200"), 2)
        self.assertIsNone(value(families, "rolemesh_requests_total", model="m", endpoint=chat, status="499"))
        log = agent.log_text()
        self.assertEqual(log.count("POST /v1/chat/completions m -> 200 on cpu:0"), 2, log[-2000:])
        self.assertNotIn("-> 499", log)

    def test_load_failure_is_a_503_and_counted(self) -> None:
        agent = self.agent("crash_at_start")
        status, _, body = agent.request("POST", CHAT_PATH, {"model": "m", **CHAT})
        self.assertEqual(status, 503, body)
        wait_until(lambda: value(scrape(agent), "rolemesh_requests_total", model="m", endpoint="chat/completions",
                                 status="503") == 1, 5, what="the 503 counted")
        families = scrape(agent)
        self.assertEqual(
            value(families, "rolemesh_requests_total", model="m", endpoint="chat/completions", status="503"), 1
        )
        self.assertEqual(value(families, "rolemesh_model_load_failures_total", device="cpu:0", model="m"), 1)
        self.assertEqual(value(families, "rolemesh_model_loads_total", device="cpu:0", model="m"), 0)
        self.assertEqual(value(families, "rolemesh_child_state", device="cpu:0", state="failed"), 1)


class RealModelMetricsTests(SynchronousTestCase):
    """A real llama-server with a tiny model: the load is counted and timed."""

    def test_real_load_and_request(self) -> None:
        require_llama_server()
        directory = os.path.abspath(self.mktemp())
        path = tiny_model(directory, "tiny", 7)
        agent = AgentProcess(directory, {"models": [{"model_id": "tiny", "path": path}]})
        self.addCleanup(agent.stop)
        status, _, body = agent.request(
            "POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=60
        )
        self.assertEqual(status, 200, body)
        wait_until(lambda: value(scrape(agent), "rolemesh_requests_total", model="tiny", endpoint="completions",
                                 status="200") == 1, 5, what="the request counted")
        families = scrape(agent)
        self.assertEqual(value(families, "rolemesh_model_loads_total", device="cpu:0", model="tiny"), 1)
        self.assertEqual(value(families, "rolemesh_model_load_duration_seconds_count", device="cpu:0", model="tiny"), 1)
        self.assertEqual(value(families, "rolemesh_device_memory_total_bytes", device="cpu:0"), mem_total_bytes())
        self.assertIsNotNone(value(families, "rolemesh_device_memory_used_bytes", device="cpu:0"))
