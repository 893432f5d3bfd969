"""Replicas on purpose, end to end on the real llama-server and the tiny
model, on two ``cpu_devices`` core groups: ``min_replicas`` preloads on both;
``max_replicas`` lets a request that would wait start a copy on the idle
device, where without it the request queues behind the first."""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, List

from tests.fixtures.tiny_gguf import write_tiny_gguf
from tests.integration.harness import AgentProcess, wait_until
from tests.integration.test_affinity_real import _Agent, post
from tests.integration.test_multi_device import require_two_cores

LONG = {"model": "tiny", "prompt": "x", "max_tokens": 400, "ignore_eos": True}


class ReplicaTests(_Agent):
    def agent(self, **model: Any) -> AgentProcess:
        require_two_cores()
        path = os.path.join(os.path.abspath(self.mktemp()) + "-tiny.gguf")
        write_tiny_gguf(path, seed=1, name="tiny", n_ctx=2048)
        return self.start(cpu_devices=2, models=[{"model_id": "tiny", "path": path, **model}])

    def held_by(self, agent: AgentProcess) -> List[str]:
        return sorted(d["device"] for d in agent.inventory()["devices"] if d["model"] == "tiny")

    def two_at_once(self, agent: AgentProcess) -> List[str]:
        """Two requests sent together (the second while the first runs): the devices they ran on."""
        statuses: Dict[str, int] = {}

        def send(rid: str) -> None:
            statuses[rid] = post(agent.port, "/v1/completions", LONG, rid=rid)

        first = threading.Thread(target=send, args=("r-1",), daemon=True)
        first.start()
        wait_until(lambda: any(d["in_flight"] for d in agent.inventory()["devices"]), 60, what="the first request")
        second = threading.Thread(target=send, args=("r-2",), daemon=True)
        second.start()
        first.join(120)
        second.join(120)
        self.assertEqual(statuses, {"r-1": 200, "r-2": 200})
        return [self.device_of(agent, "r-1"), self.device_of(agent, "r-2")]

    def test_min_replicas_preloads_on_both_devices(self) -> None:
        agent = self.agent(preload=True, min_replicas=2)
        wait_until(lambda: self.held_by(agent) == ["cpu:0", "cpu:1"] and all(
            d["state"] == "ready" for d in agent.inventory()["devices"]), 60, what="tiny ready on both devices")

    def test_a_request_that_would_wait_starts_a_copy_on_the_idle_device(self) -> None:
        agent = self.agent(max_replicas=2)
        first, second = self.two_at_once(agent)
        self.assertNotEqual(first, second, "the second request scaled out")
        self.assertEqual(self.held_by(agent), ["cpu:0", "cpu:1"])

    def test_without_max_replicas_the_second_request_queues_behind_the_first(self) -> None:
        agent = self.agent()
        first, second = self.two_at_once(agent)
        self.assertEqual(first, second)
        self.assertEqual(len(self.held_by(agent)), 1)
