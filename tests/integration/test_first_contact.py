"""What a new user meets first: quantized models served by the real
llama-server, a child that dies of SIGILL while loading (diagnosed, retried
once with ``--no-repack``), and a device in back-off that clients' automatic
retries cannot make spawn failing children one after another."""

from __future__ import annotations

import json
import os
import time

from twisted.trial.unittest import SynchronousTestCase

from tests.fixtures.llama import read_sse
from tests.fixtures.tiny_gguf import QUANT_TYPES
from tests.integration.harness import AgentProcess, require_llama_server, tiny_model
from tests.integration.test_faults import FaultTestCase

MESSAGES = [{"role": "user", "content": "hello"}]


class QuantizedModelTests(SynchronousTestCase):
    """Every quantization the fixture writes, served for real: chat, stream,
    embeddings.  A CPU-specific crash in llama.cpp's quantized kernels (as
    with a build that holds AMX code) fails here."""

    def setUp(self) -> None:
        require_llama_server()
        self.dir = os.path.abspath(self.mktemp())
        models = []
        for i, quant in enumerate(sorted(QUANT_TYPES)):
            path = tiny_model(self.dir, quant.lower(), 10 + i, quant=quant)
            models.append({"model_id": quant.lower(), "path": path,
                           "server_args": {"embeddings": True, "pooling": "mean"}})
        self.agent = AgentProcess(self.dir, {"models": models})
        self.addCleanup(self.agent.stop)

    def test_each_quantization_chats_streams_and_embeds(self) -> None:
        for quant in sorted(QUANT_TYPES):
            model = quant.lower()
            status, _, body = self.agent.request(
                "POST", "/v1/chat/completions",
                {"model": model, "messages": MESSAGES, "max_tokens": 4, "ignore_eos": True}, timeout=60)
            self.assertEqual(status, 200, f"{quant}: {body[:300]!r}")
            self.assertEqual(json.loads(body)["usage"]["completion_tokens"], 4, quant)

            status, headers, body = self.agent.request(
                "POST", "/v1/chat/completions",
                {"model": model, "messages": MESSAGES, "max_tokens": 5, "ignore_eos": True, "stream": True},
                timeout=60)
            self.assertEqual(status, 200, f"{quant}: {body[:300]!r}")
            events = read_sse(body)
            self.assertEqual(events[-1], "[DONE]", quant)
            # Five tokens streamed, whatever they spell: a random model may pick byte tokens that
            # are no whole UTF-8 character, which llama-server holds back instead of sending a delta.
            chunks = [json.loads(e) for e in events[:-1]]
            self.assertEqual({c["object"] for c in chunks}, {"chat.completion.chunk"}, (quant, events))
            self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], "length", (quant, events))
            self.assertEqual(chunks[-1]["timings"]["predicted_n"], 5, (quant, events))

            status, _, body = self.agent.request("POST", "/v1/embeddings", {"model": model, "input": "hello"},
                                                 timeout=60)
            self.assertEqual(status, 200, f"{quant}: {body[:300]!r}")
            vector = json.loads(body)["data"][0]["embedding"]
            self.assertEqual(len(vector), 64, quant)
            device = self.agent.inventory()["devices"][0]
            self.assertEqual(device["warnings"], [], f"{quant} needed no safe-mode retry")


class IllegalInstructionTests(FaultTestCase):
    """A fake child that dies of SIGILL while loading, as a build with AMX code
    does on a host (or VM) that traps AMX."""

    def test_sigill_at_load_is_retried_with_no_repack_and_serves(self) -> None:
        agent = self.start_agent(self.fake_config(), env={"FAKE_LLAMA": "sigill_at_load"})
        self.assert_chat_ok(agent)
        device = self.device(agent)
        self.assertEqual(device["state"], "ready")
        self.assertEqual(len(device["warnings"]), 1)
        self.assertIn("SIGILL", device["warnings"][0])
        self.assertIn("--no-repack", device["warnings"][0])
        self.assertEqual(agent.inventory()["warnings"], device["warnings"])
        _, _, metrics = agent.request("GET", "/metrics")
        self.assertIn(b'rolemesh_model_safe_mode_retries_total{device="cpu:0",model="m"} 1.0', metrics)
        self.assertIn("now runs with --no-repack", agent.log_text())
        self.stop_and_assert_no_orphans(agent)

    def test_sigill_with_no_way_out_is_diagnosed_in_one_short_line(self) -> None:
        agent = self.start_agent(self.fake_config(), env={"FAKE_LLAMA": "sigill_at_load=always"})
        answer = self.chat(agent)
        error = self.assert_error(answer, 503, "model_load_failed")
        message = error["message"]
        self.assertIn("killed by SIGILL", message)
        self.assertIn("illegal instruction", message)
        self.assertIn("cannot run", message)
        self.assertLessEqual(len(message), 300)
        self.assertNotIn(self.dir, message, "the model's path is shown as its id")
        self.assertEqual(answer[1].get("retry-after"), "15")
        device = self.device(agent)
        self.assertEqual(device["last_error"], message)
        self.assertEqual(device["last_error_code"], "illegal_instruction")
        self.assertIn("illegal instruction", agent.log_text())
        self.assertEqual(agent.stop(timeout=30), 0)


class BackOffTests(FaultTestCase):
    """One curl plus one default ``openai`` call against a device in back-off
    start at most one child between them."""

    def spawns(self, agent: AgentProcess) -> int:
        _, _, body = agent.request("GET", "/metrics")
        for line in body.decode().splitlines():
            if line.startswith('rolemesh_model_load_failures_total{device="cpu:0",model="m"}'):
                return int(float(line.split()[-1]))
        return 0

    def test_client_retries_do_not_each_spawn_a_failing_child(self) -> None:
        import openai

        agent = self.start_agent(self.fake_config(), env={"FAKE_LLAMA": "crash_at_start"})
        first = self.chat(agent)  # the failure that puts the device into back-off
        self.assert_error(first, 503, "model_load_failed")
        self.assertEqual(self.spawns(agent), 1)

        started = time.monotonic()
        curl = self.chat(agent)  # as the README's curl: one attempt
        error = self.assert_error(curl, 503, "model_load_failed")
        self.assertIn("next attempt in", error["message"])
        self.assertLess(time.monotonic() - started, 5, "answered at once")
        self.assertEqual(self.spawns(agent), 1, "a request during the back-off spawns nothing")

        client = openai.OpenAI(base_url=agent.url + "/v1", api_key="unused", timeout=30)  # default retries
        with self.assertRaises(openai.APIStatusError) as raised:
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
        self.assertEqual(raised.exception.status_code, 503)
        self.assertLessEqual(self.spawns(agent) - 1, 1, "curl + openai call: at most one child between them")
        self.assertEqual(agent.stop(timeout=30), 0)

