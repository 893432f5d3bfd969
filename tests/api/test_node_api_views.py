"""The node's views for the API (``Node.has_device`` ... ``device_log_tail``):
what the routes read of a device's child without reaching a supervisor."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from rolemesh.children.state import READY, STARTING, STOPPED
from tests.node.test_node import NodeHarness


class DeviceViewTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.h = NodeHarness(devices=2)

    def test_has_device(self) -> None:
        self.assertTrue(self.h.node.has_device("gpu:0"))
        self.assertTrue(self.h.node.has_device("gpu:1"))
        self.assertFalse(self.h.node.has_device("gpu:2"))
        self.assertFalse(self.h.node.has_device(""))

    def test_ready_only_once_the_child_is(self) -> None:
        h = self.h
        self.assertFalse(h.node.device_ready("gpu:0"))
        h.node.acquire(h.model("a"), device="gpu:0")
        self.assertEqual(h.sup().state, STARTING)
        self.assertFalse(h.node.device_ready("gpu:0"))
        h.answer("alpha")
        self.assertEqual(h.sup().state, READY)
        self.assertTrue(h.node.device_ready("gpu:0"))
        self.assertFalse(h.node.device_ready("gpu:1"))

    def test_snapshot_is_the_supervisors(self) -> None:
        h = self.h
        self.assertEqual(h.node.device_snapshot("gpu:0")["state"], STOPPED.value)
        h.load("a", device="gpu:0")
        snap = h.node.device_snapshot("gpu:0")
        self.assertEqual(snap, h.sup().snapshot())
        self.assertEqual((snap["state"], snap["model"]), (READY.value, "a"))

    def test_log_tail(self) -> None:
        h = self.h
        h.load("a", device="gpu:0")
        for i in range(3):
            h.child().output(f"line {i}\n")
        self.assertEqual(h.node.device_log_tail("gpu:0", 2), ["line 1", "line 2"])
        self.assertEqual(h.node.device_log_tail("gpu:0", 0), [])
        self.assertEqual(h.node.device_log_tail("gpu:1", 5), [])

    def test_unknown_device_is_a_key_error(self) -> None:
        for view in (self.h.node.device_ready, self.h.node.device_snapshot):
            self.assertRaises(KeyError, view, "gpu:9")
        self.assertRaises(KeyError, self.h.node.device_log_tail, "gpu:9", 1)
