"""Warm switches with a real llama-server (issue 28, item 6): a request
that waits behind another model's stream (a switch is coming) makes the
agent read its GGUF ahead -- one log line -- and is then served."""

from __future__ import annotations

import json
import os
import threading

from twisted.trial.unittest import SynchronousTestCase

from tests.fixtures.tiny_gguf import write_tiny_gguf
from tests.integration.harness import AgentProcess, Stream, require_llama_server, wait_until


class WarmSwitchTests(SynchronousTestCase):
    def test_a_queued_switch_reads_the_model_ahead(self) -> None:
        require_llama_server()
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        a = write_tiny_gguf(os.path.join(directory, "a.gguf"), seed=1, name="a", n_ctx=4096)
        b = write_tiny_gguf(os.path.join(directory, "b.gguf"), seed=2, name="b")
        agent = AgentProcess(directory, {"models": [{"model_id": "a", "path": a, "ctx_size": 4096},
                                                    {"model_id": "b", "path": b}]})
        self.addCleanup(agent.stop)
        stream = Stream(agent.port, {"model": "a", "prompt": "hi", "max_tokens": 4000, "stream": True,
                                     "ignore_eos": True})
        stream.start()
        self.addCleanup(stream.stop)
        self.assertTrue(stream.first.wait(30), "a's stream began")
        self.assertIsNone(stream.error)
        self.assertEqual(agent.inventory()["devices"][0]["in_flight"], 1)  # a's stream holds the device
        done = []

        def ask_b() -> None:
            done.append(agent.request("POST", "/v1/completions", {"model": "b", "prompt": "x", "max_tokens": 1},
                                      timeout=60))

        asker = threading.Thread(target=ask_b, daemon=True)
        asker.start()
        wait_until(lambda: "reading b ahead for a coming switch" in agent.log_text(), 10,
                   what="the read-ahead line")
        stream.stop()
        asker.join(60)
        self.assertEqual(done[0][0], 200, done[0][2])
        self.assertEqual(json.loads(done[0][2])["model"], "b")
        self.assertEqual(agent.log_text().count("reading b ahead"), 1)
        self.assertNotIn("reading a ahead", agent.log_text())  # a's load was no switch anyone waited for
