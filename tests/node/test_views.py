"""The node's read-only views (rolemesh.node.views): device and group
states, load progress and the inventory over stand-in supervisors, then
the inventory through the node."""

from __future__ import annotations

import signal
from typing import Any, Dict, List, Optional

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.children.state import READY, STARTING, STOPPED
from rolemesh.node.views import NodeViews
from rolemesh.scheduling.placement import Placement
from rolemesh.scheduling.prefix import PrefixMemory
from rolemesh.scheduling.scheduler import Scheduler
from tests.fixtures.fakes import FakeBackend, make_config
from tests.node.test_node import NodeHarness


class Supervisor:
    """What the views read of a supervisor."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.state = STOPPED
        self.model: Any = None
        self.logs: List[str] = []
        self.last_error: Optional[str] = None
        self.last_error_code: Optional[str] = None
        self.warnings: List[str] = []

    def snapshot(self) -> Dict[str, Any]:
        model = self.model.model_id if self.model is not None else None
        return {"state": str(self.state), "model": model, "port": 20000 if model else None,
                "pid": 7 if model else None, "restarts": 0, "last_error": self.last_error}

    def backoffs(self) -> List[Any]:
        return []


class NodeViewsPartTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.config = make_config([{"model_id": "a"}, {"model_id": "G", "devices": ["gpu:0", "gpu:1"]}])
        self.clock = Clock()
        self.refs = FakeBackend(count=2).refs
        groups = {"gpu:0+gpu:1": ["gpu:0", "gpu:1"]}
        self.sups = {name: Supervisor(name) for name in ("gpu:0", "gpu:1", "gpu:0+gpu:1")}
        self.scheduler = Scheduler(["gpu:0", "gpu:1"], 2, lambda ticket: None, groups=groups)
        placement = Placement(lambda: self.config, "fake", lambda: self.refs, groups, {}, self.scheduler.devices)
        self.draining = False
        self.views = NodeViews(
            lambda: self.config, "fake", lambda: self.refs, self.sups, groups, self.scheduler, {}, placement,
            PrefixMemory(16), lambda name: None, lambda: {"a": 0.5, "G": None}, lambda: self.draining,
            reactor=self.clock)

    def test_each_device_and_group_in_the_documented_shape(self) -> None:
        gpu0, gpu1 = self.views.device_states()
        self.assertEqual((gpu0["device"], gpu0["state"], gpu0["model"], gpu0["group"]),
                         ("gpu:0", "stopped", None, None))
        self.assertEqual((gpu0["in_flight"], gpu0["queued"], gpu0["pending_limit"], gpu0["load"]), (0, 0, 2, None))
        group, = self.views.group_states()
        self.assertEqual((group["group"], group["members"], group["memory_total_bytes"]),
                         ("gpu:0+gpu:1", ["gpu:0", "gpu:1"], 32 << 30))

    def test_a_device_names_the_group_whose_child_holds_it(self) -> None:
        self.scheduler.model_loaded("gpu:0+gpu:1", "G")
        self.assertEqual([d["group"] for d in self.views.device_states()], ["gpu:0+gpu:1"] * 2)

    def test_load_progress_only_while_starting_counted_from_the_start(self) -> None:
        sup = self.sups["gpu:1"]
        sup.model = self.config.model("a")
        self.assertIsNone(self.views.load_progress("gpu:1"))
        self.clock.advance(100)
        self.views.child_starting("gpu:1")
        sup.state = STARTING
        self.clock.advance(4)
        progress = self.views.load_progress("gpu:1")
        assert progress is not None
        self.assertEqual(progress["model"], "a")
        self.assertEqual(self.views.device_states()[1]["load"], progress)
        sup.state = READY
        self.assertIsNone(self.views.load_progress("gpu:1"))

    def test_the_inventory_gathers_the_warnings_models_and_prefix_memory(self) -> None:
        self.sups["gpu:1"].warnings = ["runs with --no-repack"]
        self.draining = True
        inventory = self.views.inventory()
        self.assertEqual((inventory["node_id"], inventory["backend"], inventory["draining"]),
                         ("test-node", "fake", True))
        self.assertEqual(inventory["warnings"], ["runs with --no-repack"])
        self.assertEqual([d["warnings"] for d in inventory["devices"]], [[], ["runs with --no-repack"]])
        self.assertEqual([m["model_id"] for m in inventory["models"]], ["a", "G"])
        self.assertEqual(inventory["models"][1]["devices"], ["gpu:0+gpu:1"])
        self.assertEqual(inventory["prefix_memory"]["per_model_hit_rate"], {"a": 0.5, "G": None})


class ReportingTests(SynchronousTestCase):
    def test_device_states_and_inventory_shape(self) -> None:
        h = NodeHarness(devices=2)
        self.successResultOf(h.node.sample_metrics())
        d = h.node.acquire(h.model("a"))
        h.answer("alpha")
        self.successResultOf(d)
        h.node.acquire(h.model("a"))  # queued behind it
        inventory = h.node.inventory()
        self.assertEqual(set(inventory), {"node_id", "backend", "draining", "warnings", "devices", "groups", "models",
                                          "prefix_memory"})
        self.assertEqual(inventory["warnings"], [], "loopback: nothing to warn about")
        self.assertEqual((inventory["node_id"], inventory["backend"], inventory["draining"]),
                         ("test-node", "fake", False))
        gpu0, gpu1 = inventory["devices"]
        expected_keys = {"ref", "device", "state", "model", "port", "pid", "in_flight", "queued",
                         "pending_limit", "restarts", "metrics", "last_error", "last_error_code", "warnings", "backoff",
                         "slots_total", "slots_busy", "slots_free", "queue_depth", "tokens_per_s", "issues", "load",
                         "slots", "throughput", "group", "stale", "prompt_tokens"}
        self.assertEqual(set(gpu0), expected_keys)
        self.assertEqual(set(gpu1), expected_keys)
        self.assertEqual(gpu0["ref"]["name"], "gpu:0")
        self.assertEqual(gpu0["ref"]["memory_total_bytes"], 16 << 30)
        self.assertEqual((gpu0["device"], gpu0["state"], gpu0["model"], gpu0["port"]), ("gpu:0", READY, "a", 20000))
        self.assertEqual(gpu0["pid"], h.child("gpu:0").pid)
        self.assertEqual((gpu0["in_flight"], gpu0["queued"], gpu0["pending_limit"]), (1, 1, 2))
        self.assertEqual(gpu0["metrics"]["memory_free_bytes"], 8 << 30)
        self.assertIn("sample_age_s", gpu0["metrics"])
        self.assertEqual((gpu1["state"], gpu1["model"], gpu1["port"], gpu1["pid"]), (STOPPED, None, None, None))
        self.assertEqual((gpu1["in_flight"], gpu1["queued"]), (0, 0))
        self.assertEqual(h.node.device_states()[0]["device"], "gpu:0")
        self.assertNotIn("ref", h.node.device_states()[0])

    def test_inventory_warns_when_exposed_without_a_key(self) -> None:
        exposed = NodeHarness(listen_host="0.0.0.0").node.inventory()["warnings"]
        self.assertEqual(len(exposed), 1)
        self.assertIn("0.0.0.0", exposed[0])
        self.assertEqual(NodeHarness(listen_host="0.0.0.0", api_keys=["k"]).node.inventory()["warnings"], [])

    def test_inventory_before_any_sample(self) -> None:
        h = NodeHarness()
        device = h.node.inventory()["devices"][0]
        self.assertIsNone(device["metrics"])
        self.assertIsNone(device["last_error"])

    def test_inventory_shows_last_error(self) -> None:
        h = NodeHarness()
        h.load("a")
        h.child().output("GGML_ASSERT failed\n")
        h.child().exit(signal=signal.SIGSEGV)
        device = h.node.inventory()["devices"][0]
        self.assertEqual(device["restarts"], 1)
        self.assertIn("SIGSEGV", device["last_error"])
        self.assertEqual(device["last_error_code"], "child_crashed")

    def test_inventory_says_a_model_runs_in_safe_mode_after_sigill(self) -> None:
        h = NodeHarness()
        d = h.node.acquire(h.model("a"))
        h.child().exit(signal=signal.SIGILL)
        h.answer("alpha")
        self.successResultOf(d).release()
        inventory = h.node.inventory()
        device = inventory["devices"][0]
        self.assertEqual(len(device["warnings"]), 1)
        self.assertIn("--no-repack", device["warnings"][0])
        self.assertEqual(inventory["warnings"], device["warnings"])
