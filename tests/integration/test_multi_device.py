"""Several devices on one host, end to end: ``cpu_devices: 2`` splits the cores
into ``cpu:0`` and ``cpu:1``, each with its own pinned llama-server child.

The real llama-server shows the pinning, the metrics and side-by-side models;
the fake one (``FAKE_LLAMA=slow_tokens``) keeps a device busy for as long as a
test needs, which the real tiny model (thousands of tokens a second, a
256-token context) cannot."""

from __future__ import annotations

import http.client
import json
import os
import threading
from typing import Any, Dict, List, Tuple

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from tests.integration.harness import (
    AgentProcess,
    mem_total_bytes,
    require_llama_server,
    tiny_model,
    wait_until,
    write_fake_llama_server_bin,
)

DEVICES = ["cpu:0", "cpu:1"]


def require_two_cores() -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores < 2:
        raise SkipTest(f"cpu_devices: 2 needs at least 2 usable cores; this process may use {cores}")




def parse_cpu_list(text: str) -> List[int]:
    cpus: List[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def allowed_cpus(pid: int) -> List[int]:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return parse_cpu_list(line.split(":", 1)[1])
    raise AssertionError(f"no Cpus_allowed_list for pid {pid}")


def argv_of(pid: int) -> List[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]


def flag_value(argv: List[str], flag: str) -> str:
    assert flag in argv, f"{flag} not in {argv}"
    return argv[argv.index(flag) + 1]


def by_name(inventory: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    return {d["device"]: d for d in inventory["devices"]}


class RealMultiDeviceTests(SynchronousTestCase):
    """``cpu_devices: 2`` with the real llama-server and two tiny models."""

    def setUp(self) -> None:
        require_two_cores()
        require_llama_server()
        self.dir = os.path.abspath(self.mktemp())
        self.agent = AgentProcess(self.dir, {
            "cpu_devices": 2,
            "models": [
                {"model_id": "tiny-a", "path": tiny_model(self.dir, "a", 1), "roles": ["chat"]},
                {"model_id": "tiny-b", "path": tiny_model(self.dir, "b", 2), "roles": ["chat"]},
            ],
        })
        self.addCleanup(self.agent.stop)

    def chat(self, model: str) -> Dict[str, Any]:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        status, _, raw = self.agent.request("POST", "/v1/chat/completions", body, timeout=30)
        self.assertEqual(status, 200, raw)
        answer: Dict[str, Any] = json.loads(raw)
        self.assertEqual(answer["model"], model)
        return answer

    def test_inventory_pins_each_child_to_its_own_cores(self) -> None:
        inventory = self.agent.inventory()
        self.assertEqual(inventory["backend"], "cpu")
        devices = by_name(inventory)
        self.assertEqual(sorted(devices), DEVICES)
        cores = {name: devices[name]["ref"]["cpus"] for name in DEVICES}
        self.assertTrue(all(cores.values()), cores)
        self.assertFalse(set(cores["cpu:0"]) & set(cores["cpu:1"]), cores)
        self.assertEqual(sorted(cores["cpu:0"] + cores["cpu:1"]), sorted(os.sched_getaffinity(0)))
        total = mem_total_bytes()
        for name in DEVICES:
            self.assertEqual(devices[name]["ref"]["memory_total_bytes"], total)

        # Every device gets a utilization figure once a sample has a delta to go on.
        def sampled() -> bool:
            metrics = [d["metrics"] for d in self.agent.inventory()["devices"]]
            return all(m is not None and m["utilization_pct"] is not None for m in metrics)

        wait_until(sampled, 15, interval=0.2, what="a utilization figure on every device")
        for name, device in by_name(self.agent.inventory()).items():
            metrics = device["metrics"]
            self.assertEqual(metrics["memory_total_bytes"], total, name)
            self.assertTrue(0.0 <= metrics["utilization_pct"] <= 100.0, metrics)
            self.assertFalse(metrics["stale"], metrics)
            self.assertGreater(metrics["memory_free_bytes"], 0)

        self.chat("tiny-a")
        self.chat("tiny-b")
        devices = by_name(self.agent.inventory())
        self.assertEqual({devices[n]["model"] for n in DEVICES}, {"tiny-a", "tiny-b"})
        for name in DEVICES:
            pid = devices[name]["pid"]
            self.assertIsInstance(pid, int, devices[name])
            self.assertEqual(allowed_cpus(pid), cores[name], f"{name} child {pid} is not pinned to its cores")
            argv = argv_of(pid)
            lo, _, hi = flag_value(argv, "--cpu-range").partition("-")
            self.assertEqual(list(range(int(lo), int(hi) + 1)), cores[name], argv)
            self.assertEqual(int(flag_value(argv, "--threads")), len(cores[name]), argv)

    def test_two_models_alternate_without_any_restart(self) -> None:
        self.chat("tiny-a")
        self.chat("tiny-b")
        first = by_name(self.agent.inventory())
        placement = {first[n]["model"]: n for n in DEVICES}
        self.assertEqual(set(placement), {"tiny-a", "tiny-b"}, first)
        pids = {n: first[n]["pid"] for n in DEVICES}
        for model in ("tiny-a", "tiny-b", "tiny-a", "tiny-b", "tiny-a", "tiny-b"):
            self.chat(model)
            now = by_name(self.agent.inventory())
            self.assertEqual({n: now[n]["pid"] for n in DEVICES}, pids, f"a child was restarted for {model}")
            self.assertEqual(now[placement[model]]["model"], model)
        for name in DEVICES:
            self.assertEqual(now[name]["restarts"], 0)
            self.assertEqual(now[name]["state"], "ready")
        status, _, raw = self.agent.request("GET", "/v1/models")
        loaded_on = {m["id"]: m["loaded_on"] for m in json.loads(raw)["data"]}
        self.assertEqual(loaded_on, {"tiny-a": [placement["tiny-a"]], "tiny-b": [placement["tiny-b"]]})
        self.assertEqual(self.agent.log_text().count("stopping llama-server"), 0)


class BusyMultiDeviceTests(SynchronousTestCase):
    """``cpu_devices: 2`` with slow fake children, so a device stays busy on demand."""

    def setUp(self) -> None:
        require_two_cores()
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        models = []
        for name in ("m1", "m2"):
            path = os.path.join(self.dir, f"{name}.gguf")
            open(path, "wb").close()
            models.append({"model_id": name, "path": path})
        self.agent = AgentProcess(self.dir, {
            "cpu_devices": 2,
            "llama_server_bin": write_fake_llama_server_bin(self.dir),
            "max_pending_requests_per_device": 2,
            "shutdown_grace_s": 5,
            "models": models,
        }, env={"FAKE_LLAMA": "slow_tokens=0.05"})
        self.addCleanup(self.agent.stop)
        # Load m1 and m2 side by side.
        for model in ("m1", "m2"):
            self.assertEqual(self.request(model)[0], 200)
        devices = by_name(self.agent.inventory())
        self.placement = {devices[n]["model"]: n for n in DEVICES}
        self.assertEqual(set(self.placement), {"m1", "m2"}, devices)
        self.pids = {n: devices[n]["pid"] for n in DEVICES}

    def request(self, model: str) -> Tuple[int, Dict[str, str], bytes]:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        return self.agent.request("POST", "/v1/chat/completions", body, timeout=30)

    def open_stream(self, model: str) -> http.client.HTTPConnection:
        """Send a long streaming request; the caller reads (or not) and closes."""
        conn = http.client.HTTPConnection("127.0.0.1", self.agent.port, timeout=30)
        self.addCleanup(conn.close)
        body = {"model": model, "stream": True, "max_tokens": 100000,
                "messages": [{"role": "user", "content": "hi"}]}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        return conn

    def running_stream(self, model: str) -> http.client.HTTPConnection:
        conn = self.open_stream(model)
        response = conn.getresponse()
        self.assertEqual(response.status, 200)
        self.assertTrue(response.readline().startswith(b"data: "))
        return conn

    def counts(self) -> Dict[str, Tuple[int, int]]:
        return {n: (d["in_flight"], d["queued"]) for n, d in by_name(self.agent.inventory()).items()}

    def wait_counts(self, expected: Dict[str, Tuple[int, int]], timeout: float = 10) -> None:
        wait_until(lambda: self.counts() == expected, timeout, interval=0.05,
                   what=f"in-flight/queued counts {expected} (now {self.counts()})")

    def assert_no_restart(self) -> None:
        devices = by_name(self.agent.inventory())
        self.assertEqual({n: devices[n]["pid"] for n in DEVICES}, self.pids)
        self.assertEqual({devices[n]["model"]: n for n in DEVICES}, self.placement)
        self.assertEqual([devices[n]["restarts"] for n in DEVICES], [0, 0])

    def test_busy_device_with_queue_room_is_waited_for_not_the_other_evicted(self) -> None:
        busy, other = self.placement["m1"], self.placement["m2"]
        stream = self.running_stream("m1")
        self.wait_counts({busy: (1, 0), other: (0, 0)})

        result: List[Tuple[int, Dict[str, str], bytes]] = []
        waiter = threading.Thread(target=lambda: result.append(self.request("m1")))
        waiter.start()
        self.addCleanup(waiter.join, 30)
        # It queues behind the stream on the busy device; the idle device keeps m2.
        self.wait_counts({busy: (1, 1), other: (0, 0)})
        self.assert_no_restart()
        self.assertEqual(result, [])

        stream.close()
        waiter.join(30)
        self.assertFalse(waiter.is_alive())
        status, _, raw = result[0]
        self.assertEqual(status, 200, raw)
        self.assertEqual(json.loads(raw)["model"], "m1")
        self.wait_counts({busy: (0, 0), other: (0, 0)})
        self.assert_no_restart()

    def test_both_devices_full_is_429_and_then_serves_again(self) -> None:
        d1, d2 = self.placement["m1"], self.placement["m2"]
        running = [self.running_stream("m1"), self.running_stream("m2")]
        queued = [self.open_stream("m1"), self.open_stream("m2")]
        self.wait_counts({d1: (1, 1), d2: (1, 1)})

        for model in ("m1", "m2"):
            status, headers, raw = self.request(model)
            self.assertEqual(status, 429, raw)
            self.assertEqual(json.loads(raw)["error"]["code"], "queue_full")
            self.assertIn("retry-after", headers)
        self.assert_no_restart()

        for conn in queued + running:
            conn.close()
        self.wait_counts({d1: (0, 0), d2: (0, 0)})
        for model in ("m1", "m2"):
            self.assertEqual(self.request(model)[0], 200)
        self.assert_no_restart()
