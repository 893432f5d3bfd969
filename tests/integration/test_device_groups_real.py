"""A device group end to end: ``cpu_devices: 2`` splits the cores into
``cpu:0`` and ``cpu:1``; the model ``pair`` spans both (``devices: [cpu:0,
cpu:1]``), so one child runs over the union of their cores, and while it
holds them no other model runs on either.

The real llama-server shows the pinning and the hand-over; the fake one
(``FAKE_LLAMA=slow_tokens``) keeps the group busy for as long as a test needs.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
from typing import Any, Dict, List, Tuple

from twisted.trial.unittest import SynchronousTestCase

from tests.integration.harness import (
    AgentProcess,
    pid_alive,
    require_llama_server,
    tiny_model,
    wait_until,
    write_fake_llama_server_bin,
)
from tests.integration.test_multi_device import allowed_cpus, argv_of, by_name, flag_value, require_two_cores

GROUP = "cpu:0+cpu:1"


def groups(inventory: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    return {g["group"]: g for g in inventory["groups"]}


class RealGroupTests(SynchronousTestCase):
    """The real llama-server on a two-device group, then on one of its members."""

    def setUp(self) -> None:
        require_two_cores()
        require_llama_server()
        self.dir = os.path.abspath(self.mktemp())
        self.agent = AgentProcess(self.dir, {
            "cpu_devices": 2,
            "models": [
                {"model_id": "pair", "path": tiny_model(self.dir, "pair", 1), "devices": ["cpu:0", "cpu:1"]},
                {"model_id": "solo", "path": tiny_model(self.dir, "solo", 2), "devices": ["cpu:1"]},
                {"model_id": "any", "path": tiny_model(self.dir, "any", 3)},
            ],
        })
        self.addCleanup(self.agent.stop)

    def chat(self, model: str) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        status, _, raw = self.agent.request("POST", "/v1/chat/completions", body, timeout=30)
        self.assertEqual(status, 200, raw)
        self.assertEqual(json.loads(raw)["model"], model)

    def test_the_group_child_is_pinned_to_both_core_sets_then_hands_a_member_back(self) -> None:
        inventory = self.agent.inventory()
        cores = {n: d["ref"]["cpus"] for n, d in by_name(inventory).items()}
        union = sorted(cores["cpu:0"] + cores["cpu:1"])
        self.assertEqual(groups(inventory)[GROUP]["members"], ["cpu:0", "cpu:1"])

        self.chat("pair")
        inventory = self.agent.inventory()
        group = groups(inventory)[GROUP]
        self.assertEqual((group["state"], group["model"]), ("ready", "pair"))
        pid = group["pid"]
        self.assertEqual(allowed_cpus(pid), union, f"the group's child {pid} is not pinned to both core sets")
        argv = argv_of(pid)
        lo, _, hi = flag_value(argv, "--cpu-range").partition("-")
        self.assertEqual(list(range(int(lo), int(hi) + 1)), union, argv)
        self.assertEqual(int(flag_value(argv, "--threads")), len(union), argv)
        for name, device in by_name(inventory).items():
            self.assertEqual((device["group"], device["pid"]), (GROUP, None), name)
        status, _, raw = self.agent.request("GET", f"/v1/node/devices/{GROUP}/logs?tail=1000")
        self.assertEqual(status, 200, raw)
        self.assertTrue(any(line.startswith(f"[rolemesh] starting pair on {GROUP}: ")
                            for line in json.loads(raw)["lines"]), raw[:500])

        # A model pinned to cpu:1 takes it back: the group's child stops first.
        self.chat("solo")
        wait_until(lambda: not pid_alive(pid), 10, what="the group's child to exit")
        inventory = self.agent.inventory()
        self.assertEqual(groups(inventory)[GROUP]["state"], "stopped")
        devices = by_name(inventory)
        self.assertEqual((devices["cpu:1"]["model"], devices["cpu:1"]["group"]), ("solo", None))
        self.assertEqual(allowed_cpus(devices["cpu:1"]["pid"]), cores["cpu:1"])
        # And cpu:0 is free for anything else, beside it.
        self.chat("any")
        devices = by_name(self.agent.inventory())
        self.assertEqual((devices["cpu:0"]["model"], devices["cpu:1"]["model"]), ("any", "solo"))

        status, _, raw = self.agent.request("GET", "/v1/models")
        models = {m["id"]: m for m in json.loads(raw)["data"]}
        self.assertEqual(models["pair"]["devices"], [GROUP])
        self.assertEqual(models["pair"]["fits_on"], [GROUP])
        self.assertGreater(models["pair"]["memory_estimate"]["total_bytes"], 0)
        status, _, raw = self.agent.request("GET", "/v1/node/registration")
        served = {m["model_id"]: m for m in json.loads(raw)["served_models"]}
        self.assertEqual(served["pair"]["devices"], [GROUP])
        self.assertEqual(served["pair"]["memory_estimate_bytes"], models["pair"]["memory_estimate"]["total_bytes"])


class BusyGroupTests(SynchronousTestCase):
    """Slow fake children, so the group (or a member) stays busy on demand."""

    def setUp(self) -> None:
        require_two_cores()
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        models = []
        for name, devices in (("pair", ["cpu:0", "cpu:1"]), ("solo", ["cpu:1"])):
            path = os.path.join(self.dir, f"{name}.gguf")
            open(path, "wb").close()
            models.append({"model_id": name, "path": path, "devices": devices})
        self.agent = AgentProcess(self.dir, {
            "cpu_devices": 2,
            "llama_server_bin": write_fake_llama_server_bin(self.dir),
            "max_pending_requests_per_device": 2,
            "shutdown_grace_s": 5,
            "models": models,
        }, env={"FAKE_LLAMA": "slow_tokens=0.05"})
        self.addCleanup(self.agent.stop)

    def request(self, model: str) -> Tuple[int, Dict[str, str], bytes]:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        return self.agent.request("POST", "/v1/chat/completions", body, timeout=30)

    def running_stream(self, model: str) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection("127.0.0.1", self.agent.port, timeout=30)
        self.addCleanup(conn.close)
        body = {"model": model, "stream": True, "max_tokens": 100000,
                "messages": [{"role": "user", "content": "hi"}]}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        self.assertEqual(response.status, 200)
        self.assertTrue(response.readline().startswith(b"data: "))
        return conn

    def counts(self) -> Dict[str, Tuple[int, int]]:
        inventory = self.agent.inventory()
        out = {n: (d["in_flight"], d["queued"]) for n, d in by_name(inventory).items()}
        out.update({n: (g["in_flight"], g["queued"]) for n, g in groups(inventory).items()})
        return out

    def wait_counts(self, expected: Dict[str, Tuple[int, int]]) -> None:
        wait_until(lambda: self.counts() == expected, 10, interval=0.05,
                   what=f"in-flight/queued counts {expected} (now {self.counts()})")

    def in_thread(self, model: str) -> Tuple[threading.Thread, List[Any]]:
        result: List[Any] = []
        thread = threading.Thread(target=lambda: result.append(self.request(model)))
        thread.start()
        self.addCleanup(thread.join, 30)
        return thread, result

    def test_a_member_request_waits_for_the_groups_in_flight_request_then_switches(self) -> None:
        stream = self.running_stream("pair")
        self.wait_counts({"cpu:0": (0, 0), "cpu:1": (0, 0), GROUP: (1, 0)})
        group_pid = groups(self.agent.inventory())[GROUP]["pid"]

        thread, result = self.in_thread("solo")
        self.wait_counts({"cpu:0": (0, 0), "cpu:1": (0, 1), GROUP: (1, 0)})
        inventory = self.agent.inventory()
        self.assertIsNone(by_name(inventory)["cpu:1"]["pid"], "no child on cpu:1 while the group holds it")
        self.assertTrue(pid_alive(group_pid))
        self.assertEqual(result, [])

        stream.close()  # the group's request ends: the switch goes ahead
        thread.join(30)
        self.assertFalse(thread.is_alive())
        status, _, raw = result[0]
        self.assertEqual(status, 200, raw)
        self.assertEqual(json.loads(raw)["model"], "solo")
        wait_until(lambda: not pid_alive(group_pid), 10, what="the group's child to exit")
        devices = by_name(self.agent.inventory())
        self.assertEqual((devices["cpu:1"]["model"], devices["cpu:1"]["state"]), ("solo", "ready"))
        self.assertEqual(groups(self.agent.inventory())[GROUP]["state"], "stopped")

    def test_the_group_waits_for_a_busy_member_then_takes_both(self) -> None:
        stream = self.running_stream("solo")
        self.wait_counts({"cpu:0": (0, 0), "cpu:1": (1, 0), GROUP: (0, 0)})
        solo_pid = by_name(self.agent.inventory())["cpu:1"]["pid"]

        thread, result = self.in_thread("pair")
        self.wait_counts({"cpu:0": (0, 0), "cpu:1": (1, 0), GROUP: (0, 1)})
        self.assertIsNone(groups(self.agent.inventory())[GROUP]["pid"], "no group child while a member is busy")

        stream.close()
        thread.join(30)
        status, _, raw = result[0]
        self.assertEqual(status, 200, raw)
        self.assertFalse(pid_alive(solo_pid), "the member's child was stopped before the group's started")
        inventory = self.agent.inventory()
        self.assertEqual(groups(inventory)[GROUP]["model"], "pair")
        self.assertEqual([d["group"] for d in inventory["devices"]], [GROUP, GROUP])
