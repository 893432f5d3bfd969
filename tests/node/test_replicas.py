"""Replicas on purpose (issue 27): the config keys, and how the node uses them.

The scheduler's part (scale out under the cap, never past it) is
tests.scheduling.test_scheduler.ReplicaTests and the state machine there.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base.errors import ConfigError
from rolemesh.config.file import validate

PLAIN = {"model_id": "plain", "path": "/models/plain.gguf"}


def models(*entries):
    return validate({"models": list(entries)}, check_files=False, environ={}).models


def error(entry) -> str:
    try:
        models(entry)
    except ConfigError as e:
        return str(e)
    raise AssertionError(f"no ConfigError for {entry}")


class ConfigTests(SynchronousTestCase):
    def test_defaults_keep_todays_behaviour(self) -> None:
        (model,) = models(PLAIN)
        self.assertEqual((model.min_replicas, model.max_replicas), (1, None))

    def test_values_are_kept(self) -> None:
        (model,) = models(dict(PLAIN, min_replicas=2, max_replicas=3))
        self.assertEqual((model.min_replicas, model.max_replicas), (2, 3))

    def test_mistakes_are_one_line_each(self) -> None:
        cases = [
            (dict(PLAIN, max_replicas=0), "models[0].max_replicas: expected a positive integer, got 0"),
            (dict(PLAIN, min_replicas="two"), 'models[0].min_replicas: expected a positive integer, got "two"'),
            (dict(PLAIN, min_replicas=3, max_replicas=2), "models[0].min_replicas: 3 is more than max_replicas (2)"),
            (dict(PLAIN, min_replicas=2, devices=["cpu0"]),
             "models[0].min_replicas: a model with `devices` runs on one device (or one group); "
             "drop min_replicas or devices"),
        ]
        for entry, message in cases:
            self.assertEqual(error(entry), message)


class NodeReplicaTests(SynchronousTestCase):
    """Through the node (real supervisors, fake children, a Clock)."""

    def started(self, models, devices=2, **top):
        from tests.node.test_node import NodeHarness

        h = NodeHarness(models, devices=devices, **top)
        h.node.startService()
        self.addCleanup(lambda: h.node.running and h.node.stopService())
        return h

    def test_min_replicas_preloads_on_that_many_devices(self) -> None:
        h = self.started([{"model_id": "a", "preload": True, "min_replicas": 2}], devices=3)
        h.answer("a")
        self.assertEqual([h.model_on(f"gpu:{i}") for i in range(3)], ["a", "a", None])
        self.assertEqual(h.node.preloading, 0)

    def test_preload_targets_skip_devices_another_preload_names(self) -> None:
        h = self.started([{"model_id": "a", "min_replicas": 2}, {"model_id": "b"}], devices=3,
                         preload=[{"model": "b", "device": "gpu:0"}])
        self.assertEqual(h.node.preload_targets(h.model("a")), ["gpu:1", "gpu:2"])
        self.assertEqual(h.node.preload_targets(h.model("b")), [None])

    def test_idle_unload_keeps_min_replicas(self) -> None:
        h = self.started([{"model_id": "a", "preload": True, "min_replicas": 2}], devices=3, idle_unload_s=60)
        h.answer("a")
        h.reactor.advance(120)
        self.assertEqual([h.model_on(f"gpu:{i}") for i in range(2)], ["a", "a"])
        self.assertEqual([e for e in h.events if e[0] == "idle_unload"], [])

    def test_a_request_that_would_wait_scales_out_under_max_replicas(self) -> None:
        h = self.started([{"model_id": "a", "max_replicas": 2}], devices=3)
        first = h.node.acquire(h.model("a"))
        second = h.node.acquire(h.model("a"))
        third = h.node.acquire(h.model("a"))
        h.answer("a")
        leases = []
        for d in (first, second):
            d.addCallback(leases.append)
        self.assertEqual(sorted(lease.device for lease in leases), ["gpu:0", "gpu:1"])
        self.assertFalse(third.called, "at its cap: it waits for a copy")
        self.assertIsNone(h.model_on("gpu:2"))

    def test_without_max_replicas_the_second_request_waits_on_the_first_device(self) -> None:
        h = self.started([{"model_id": "a"}], devices=2)
        first = h.node.acquire(h.model("a"))
        second = h.node.acquire(h.model("a"))
        h.answer("a")
        self.assertTrue(first.called)
        self.assertFalse(second.called)
        self.assertIsNone(h.model_on("gpu:1"))
