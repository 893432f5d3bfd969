"""Slots that mean what they say (issue 26): the agent as a process with a
real llama-server child, one model without ``parallel`` and one with
``parallel: 4`` on the same device.

For each, the child's own ``/slots`` and ``/props`` (``total_slots``), the
inventory (telemetry ``slots_total`` and the memory estimate's ``slots``)
and ``/metrics`` (``rolemesh_device_slots``) give the same figure -- 1 and
4 -- and the agent runs that many requests at once: with one slot a second
stream waits in the queue, with four slots four streams run together, each
on its own busy slot of the child.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

from prometheus_client.parser import text_string_to_metric_families
from twisted.trial.unittest import SynchronousTestCase

from tests.fixtures.llama import http_request
from tests.fixtures.tiny_gguf import write_tiny_gguf
from tests.integration.harness import AgentProcess, Stream, require_llama_server, wait_until

DEVICE = "cpu:0"
FOUR = 4
#: Long enough that the streams outlast the checks on a busy 2-core machine;
#: the test ends them itself.
LONG = {"prompt": "hello", "max_tokens": 8000, "ignore_eos": True, "stream": True}


class SlotsRealTests(SynchronousTestCase):
    def setUp(self) -> None:
        binary = require_llama_server()
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        path = write_tiny_gguf(os.path.join(self.dir, "s.gguf"), seed=5, n_ctx=8192, name="s")
        self.agent = AgentProcess(self.dir, {
            "llama_server_bin": binary,
            "max_pending_requests_per_device": 8,
            "shutdown_grace_s": 2,
            "models": [
                {"model_id": "one", "path": path, "ctx_size": 8192},
                {"model_id": "four", "path": path, "ctx_size": FOUR * 8192, "server_args": {"parallel": FOUR}},
            ],
        })
        self.addCleanup(self.agent.stop)

    # -- the views ----------------------------------------------------------------

    def device(self) -> Dict[str, Any]:
        (device,) = [d for d in self.agent.inventory()["devices"] if d["device"] == DEVICE]
        return device

    def child(self, path: str) -> Any:
        status, _, body = http_request("GET", f"http://127.0.0.1:{self.device()['port']}{path}", timeout=10)
        self.assertEqual(status, 200, body)
        return json.loads(body)

    def metric(self, name: str, model: str) -> Optional[float]:
        status, _, body = self.agent.request("GET", "/metrics")
        self.assertEqual(status, 200, body)
        found = [s.value for f in text_string_to_metric_families(body.decode("utf-8")) for s in f.samples
                 if s.name == name and s.labels == {"device": DEVICE, "model": model}]
        return found[0] if found else None

    def busy_in_child(self) -> int:
        return sum(1 for slot in self.child("/slots") if slot.get("is_processing"))

    def load(self, model: str) -> None:
        status, _, body = self.agent.request("POST", "/v1/completions",
                                             {"model": model, "prompt": "hi", "max_tokens": 2}, timeout=120)
        self.assertEqual(status, 200, body)
        self.assertEqual(self.device()["model"], model)

    def assert_slots_everywhere(self, model: str, slots: int) -> None:
        self.assertEqual(len(self.child("/slots")), slots, "the child's /slots")
        self.assertEqual(self.child("/props")["total_slots"], slots, "the child's /props")
        (entry,) = [m for m in self.agent.inventory()["models"] if m["model_id"] == model]
        self.assertEqual(entry["memory_estimate"]["slots"], slots, "the memory estimate")
        # The telemetry samples the child every 5 s.
        wait_until(lambda: self.device()["slots_total"] == slots, 30, interval=0.2,
                   what=f"inventory slots_total {slots}")
        self.assertEqual(self.device()["slots"]["total"], slots)
        wait_until(lambda: self.metric("rolemesh_device_slots", model) == slots, 30, interval=0.2,
                   what=f"rolemesh_device_slots {slots}")

    def streams(self, model: str, count: int, repeat: bool = False) -> List[Stream]:
        streams = [Stream(self.agent.port, {"model": model, **LONG}, repeat=repeat) for _ in range(count)]
        for stream in streams:
            self.addCleanup(stream.stop)
            stream.start()
        return streams

    def end(self, streams: List[Stream]) -> None:
        for stream in streams:
            stream.stop()
        for stream in streams:
            stream.join(60)
            self.assertFalse(stream.is_alive())
        wait_until(lambda: self.device()["in_flight"] == 0 and self.busy_in_child() == 0, 60, interval=0.2,
                   what="the streams' slots freed")

    # -- the test -------------------------------------------------------------------

    def test_one_slot_then_four_everywhere_and_in_use(self) -> None:
        self.load("one")
        self.assert_slots_everywhere("one", 1)
        # One slot: a second request waits in the agent's queue (each stream
        # repeated, so a fast machine's short stream cannot end between two looks).
        streams = self.streams("one", 2, repeat=True)
        self.assertTrue(streams[0].first.wait(60) or streams[1].first.wait(60), "no first event")
        wait_until(lambda: (self.device()["in_flight"], self.device()["queued"]) == (1, 1), 30, interval=0.1,
                   what="one running and one queued")
        wait_until(lambda: self.busy_in_child() == 1, 30, interval=0.1, what="one busy slot in the child")
        self.assertLessEqual(self.busy_in_child(), 1, "it has one slot")
        self.end(streams)

        self.load("four")
        self.assert_slots_everywhere("four", FOUR)
        streams = self.streams("four", FOUR)
        for stream in streams:
            self.assertTrue(stream.first.wait(60), "no first event")
            self.assertIsNone(stream.error)
            self.assertEqual(stream.status, 200)
        self.assertTrue(all(s.is_alive() for s in streams), "a stream ended before the checks")
        device = self.device()
        self.assertEqual((device["in_flight"], device["queued"]), (FOUR, 0))
        self.assertEqual(self.busy_in_child(), FOUR, "four requests at once in the child")
        self.end(streams)
