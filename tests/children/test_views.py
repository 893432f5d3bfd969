"""The read-only views of a device's child (rolemesh.children.views) and its
states (rolemesh.children.state): pure."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from rolemesh.children import state as device_state
from rolemesh.children import supervisor
from rolemesh.children.state import ALIVE, FAILED, READY, STARTING, STOPPED, STOPPING, DeviceState
from rolemesh.children.views import ChildEndpoint, EndpointCache, loading_or_loaded, snapshot


class EndpointCacheTests(SynchronousTestCase):
    def test_built_once_per_child(self) -> None:
        cache = EndpointCache()
        first = cache.get("a", 20000, 1001, 1)
        self.assertEqual(first, ChildEndpoint("a", "http://127.0.0.1:20000", 20000, 1001, 1))
        self.assertIs(cache.get("a", 20000, 1001, 1), first)
        self.assertIsNot(cache.get("a", 20000, 1001, 2), first, "another generation: another child")
        self.assertEqual(cache.get("a", 20001, None, 2).pid, 0)


class SnapshotTests(SynchronousTestCase):
    def test_a_stopped_device_shows_no_model_and_a_dead_child_no_port_or_pid(self) -> None:
        self.assertEqual(snapshot(STOPPED, "a", 20000, 1001, 2, "gone"),
                         {"state": "stopped", "model": None, "port": None, "pid": None, "restarts": 2,
                          "last_error": "gone"})
        self.assertEqual(snapshot(FAILED, "a", 20000, 1001, 0, "x")["model"], "a")
        self.assertIsNone(snapshot(FAILED, "a", 20000, 1001, 0, "x")["pid"])
        for state in (STARTING, READY, STOPPING):
            snap = snapshot(state, "a", 20000, 1001, 0, None)
            self.assertEqual((snap["state"], snap["model"], snap["port"], snap["pid"]), (state.value, "a", 20000, 1001))

    def test_loading_or_loaded(self) -> None:
        self.assertEqual(loading_or_loaded(STARTING, "a", None), "a")
        self.assertEqual(loading_or_loaded(READY, "a", "b"), "a")
        self.assertEqual(loading_or_loaded(STOPPING, "a", "b"), "b", "a switch's target")
        self.assertIsNone(loading_or_loaded(STOPPING, "a", None))
        self.assertIsNone(loading_or_loaded(STOPPED, "a", None))
        self.assertIsNone(loading_or_loaded(FAILED, "a", "b"))


class DeviceStateTests(SynchronousTestCase):
    def test_one_enum_wherever_it_is_imported_from(self) -> None:
        self.assertIs(supervisor.DeviceState, DeviceState)
        for name in ("STOPPED", "STARTING", "READY", "STOPPING", "FAILED"):
            self.assertIs(getattr(supervisor, name), getattr(device_state, name))
        self.assertIs(supervisor.ChildEndpoint, ChildEndpoint)
        self.assertEqual(ALIVE, {STARTING, READY, STOPPING})
