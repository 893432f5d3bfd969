"""Prompt-cache token counts end to end: the agent as a process, the real
llama-server and the tiny model. Two identical prompts in a row to one
device: the second is served (mostly) from llama-server's cache, and
``/metrics``, the inventory and the answers' own ``timings`` agree."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Tuple

from twisted.trial.unittest import SynchronousTestCase

from tests.integration.harness import AgentProcess, require_llama_server, tiny_model, wait_until
from tests.integration.test_metrics_real import scrape, value

PROMPT = "Once upon a time, in a land far away, there lived a small dragon who loved to read books. " * 3


def timings_of(path: str, body: bytes) -> Tuple[int, int]:
    """``(cache_n, prompt_n)`` of an answer, parsed in full (the test's own reading)."""
    if body.startswith(b"data:"):
        events = [json.loads(line[6:]) for line in body.split(b"\n")
                  if line.startswith(b"data: {")]
        timings = [e["timings"] for e in events if "timings" in e][-1]
    else:
        timings = json.loads(body)["timings"]
    return timings["cache_n"], timings["prompt_n"]


class PromptCacheRealTests(SynchronousTestCase):
    def test_a_repeated_prompt_is_counted_as_cached(self) -> None:
        require_llama_server()
        directory = os.path.abspath(self.mktemp())
        path = tiny_model(directory, "tiny", 7)
        agent = AgentProcess(directory, {"models": [{"model_id": "tiny", "path": path}]})
        self.addCleanup(agent.stop)
        before = scrape(agent)
        self.assertEqual(value(before, "rolemesh_prompt_tokens_cached_total", device="cpu:0", model="tiny"), 0)
        self.assertEqual(value(before, "rolemesh_prompt_tokens_processed_total", device="cpu:0", model="tiny"), 0)
        reported: List[Tuple[int, int]] = []
        requests: List[Tuple[str, Dict[str, Any]]] = [
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream": True}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2,
                                      "stream": True}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}),
        ]
        for route, body in requests:
            status, _, answer = agent.request("POST", route, {"model": "tiny", **body}, timeout=60)
            self.assertEqual(status, 200, answer)
            reported.append(timings_of(route, answer))
        first, second = reported[0], reported[1]
        self.assertEqual(first[0], 0, f"a fresh child has nothing cached: {reported}")
        self.assertGreater(second[0], 0, f"the same prompt again: served from the cache: {reported}")
        self.assertGreater(reported[4][0], 0, f"the same chat again: {reported}")
        cached, processed = sum(r[0] for r in reported), sum(r[1] for r in reported)

        def counted() -> bool:
            families = scrape(agent)
            return (value(families, "rolemesh_prompt_tokens_cached_total", device="cpu:0", model="tiny"),
                    value(families, "rolemesh_prompt_tokens_processed_total", device="cpu:0", model="tiny")) == (
                        cached, processed)

        wait_until(counted, 5, what=f"the metrics at {cached} cached, {processed} processed")
        status, _, body = agent.request("GET", "/v1/node/inventory")
        self.assertEqual(status, 200, body)
        (device,) = json.loads(body)["devices"]
        self.assertEqual(device["prompt_tokens"], {"tiny": {"cached": cached, "processed": processed,
                                                            "hit_rate": cached / (cached + processed)}})
