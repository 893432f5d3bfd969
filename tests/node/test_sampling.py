"""The metrics tick (rolemesh.node.sampling): the sampler alone on a Clock
with a scripted device sample, the group free-memory rule, then through the node."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base.devices import DeviceMetrics, DeviceRef
from rolemesh.node.node import METRICS_TIMEOUT_S as NODE_METRICS_TIMEOUT_S
from rolemesh.node.sampling import METRICS_TIMEOUT_S, DeviceSampler, group_free_memory
from tests.fixtures.fakes import FakeBackend
from tests.node.test_node import NodeHarness

GIB = 1 << 30


def metrics(device: str, free: Optional[int], stale: bool = False, error: Optional[str] = None) -> DeviceMetrics:
    return DeviceMetrics(device, 0.0, 16 * GIB, None if free is None else 16 * GIB - free, free, 10.0,
                         stale=stale, error=error)


class GroupFreeMemoryTests(SynchronousTestCase):
    def test_the_members_sum_their_least_on_a_shared_pool_none_while_one_is_unknown(self) -> None:
        known = {"a": metrics("a", 3 * GIB), "b": metrics("b", 5 * GIB)}
        self.assertEqual(group_free_memory(["a", "b"], known, shared=False), 8 * GIB)
        self.assertEqual(group_free_memory(["a", "b"], known, shared=True), 3 * GIB)
        self.assertIsNone(group_free_memory(["a", "c"], known, shared=False))
        self.assertIsNone(group_free_memory(["a", "b"], {**known, "b": metrics("b", None)}, shared=False))


class DeviceSamplerPartTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.refs = FakeBackend(count=2).refs
        self.answers: List["defer.Deferred[List[DeviceMetrics]]"] = []
        self.free: List[Tuple[str, Optional[int]]] = []
        self.changed: List[None] = []
        self.ticks: List[str] = []
        self.telemetry_breaks = False
        self.sampler = DeviceSampler(
            self.sample, lambda: self.refs, {"gpu:0+gpu:1": ["gpu:0", "gpu:1"]}, {"gpu:0", "gpu:0+gpu:1"},
            lambda lane, free: self.free.append((lane, free)), lambda: False, lambda: self.changed.append(None),
            lambda: self.ticks.append("feed"), self.telemetry, interval=5.0, reactor=self.clock)

    def sample(self, devices: Sequence[DeviceRef]) -> "defer.Deferred[List[DeviceMetrics]]":
        d: "defer.Deferred[List[DeviceMetrics]]" = defer.Deferred()
        self.answers.append(d)
        return d

    def telemetry(self) -> None:
        if self.telemetry_breaks:
            raise RuntimeError("telemetry bug")
        self.ticks.append("telemetry")

    def test_a_sample_is_kept_and_each_known_lane_told_its_free_memory(self) -> None:
        d = self.sampler.sample_metrics()
        self.assertTrue(self.sampler.sampling)
        self.answers[0].callback([metrics("gpu:0", 3 * GIB), metrics("gpu:1", 5 * GIB)])
        self.successResultOf(d)
        self.assertFalse(self.sampler.sampling)
        self.assertEqual(self.sampler.metrics["gpu:1"].memory_free_bytes, 5 * GIB)
        self.assertEqual(self.free, [("gpu:0", 3 * GIB), ("gpu:0+gpu:1", 8 * GIB)], "gpu:1 has no book here")
        self.assertEqual(self.changed, [None])

    def test_a_sample_under_way_is_not_taken_again(self) -> None:
        first = self.sampler.sample_metrics()
        self.successResultOf(self.sampler.sample_metrics())
        self.assertEqual(len(self.answers), 1)
        self.answers[0].callback([])
        self.successResultOf(first)

    def test_a_device_the_backend_could_not_measure_keeps_its_last_figures_marked_stale(self) -> None:
        self.sampler.sample_metrics()
        self.answers[0].callback([metrics("gpu:0", 3 * GIB)])
        self.sampler.sample_metrics()
        self.answers[1].callback([metrics("gpu:0", None, stale=True, error="NVML busy")])
        kept = self.sampler.metrics["gpu:0"]
        self.assertEqual((kept.stale, kept.error, kept.memory_free_bytes), (True, "NVML busy", 3 * GIB))

    def test_a_failed_or_slow_sample_marks_every_device_stale_with_the_reason(self) -> None:
        self.sampler.sample_metrics()
        self.answers[0].errback(RuntimeError("driver went away"))
        self.assertEqual({m.error for m in self.sampler.metrics.values()}, {"driver went away"})
        self.assertEqual(self.sampler.metrics["gpu:1"].memory_total_bytes, 16 * GIB, "what the ref knows")
        d = self.sampler.sample_metrics()
        self.clock.advance(METRICS_TIMEOUT_S)
        self.successResultOf(d)
        self.assertEqual({m.error for m in self.sampler.metrics.values()}, {"timed out"})
        self.assertEqual(self.changed, [None, None])
        self.assertFalse(self.sampler.sampling)

    def test_each_tick_checks_the_feed_and_samples_telemetry_even_when_that_breaks(self) -> None:
        self.telemetry_breaks = True
        self.sampler.tick()
        self.assertEqual(self.ticks, ["feed"])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertEqual(len(self.answers), 1, "the device sample is taken all the same")

    def test_the_loop_ticks_on_the_clock_until_stopped(self) -> None:
        self.sampler.start()
        self.assertEqual(self.ticks, ["feed", "telemetry"])
        self.answers[-1].callback([])
        self.clock.advance(5)
        self.assertEqual(len(self.answers), 2)
        self.answers[-1].callback([])
        self.sampler.stop()
        self.sampler.stop()
        self.clock.advance(50)
        self.assertEqual(len(self.answers), 2)

    def test_the_node_names_the_same_bound(self) -> None:
        self.assertEqual(NODE_METRICS_TIMEOUT_S, METRICS_TIMEOUT_S)


class MetricsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.h = NodeHarness()

    def test_sample_records_figures_and_free_memory(self) -> None:
        h = self.h
        self.successResultOf(h.node.sample_metrics())
        sample = h.node.metrics["gpu:0"]
        self.assertFalse(sample.stale)
        self.assertEqual(sample.memory_free_bytes, 8 << 30)
        self.assertEqual(h.book().free_memory, 8 << 30)

    def test_failed_sample_marks_stale_and_keeps_last_figures(self) -> None:
        h = self.h
        self.successResultOf(h.node.sample_metrics())
        h.backend.fail_with = RuntimeError("NVML: driver went away")
        self.successResultOf(h.node.sample_metrics())
        sample = h.node.metrics["gpu:0"]
        self.assertTrue(sample.stale)
        self.assertIn("driver went away", sample.error)
        self.assertEqual(sample.memory_free_bytes, 8 << 30)
        self.assertEqual(sample.utilization_pct, 10.0)
        # And it recovers.
        h.backend.fail_with = None
        h.backend.free = 4 << 30
        self.successResultOf(h.node.sample_metrics())
        self.assertFalse(h.node.metrics["gpu:0"].stale)
        self.assertEqual(h.node.metrics["gpu:0"].memory_free_bytes, 4 << 30)

    def test_failed_first_sample_is_stale_with_what_is_known(self) -> None:
        h = self.h
        h.backend.fail_with = RuntimeError("no driver")
        self.successResultOf(h.node.sample_metrics())
        sample = h.node.metrics["gpu:0"]
        self.assertTrue(sample.stale)
        self.assertEqual(sample.memory_total_bytes, 16 << 30)
        self.assertIsNone(sample.memory_free_bytes)

    def test_raising_backend_is_a_stale_sample(self) -> None:
        h = self.h

        def boom(devices: Any) -> Any:
            raise OSError("nvidia-smi: not found")

        h.backend.sample = boom  # type: ignore[method-assign]
        self.successResultOf(h.node.sample_metrics())
        self.assertTrue(h.node.metrics["gpu:0"].stale)
        self.assertIn("not found", h.node.metrics["gpu:0"].error)

    def test_hung_sample_is_bounded_and_does_not_block(self) -> None:
        h = self.h
        self.successResultOf(h.node.sample_metrics())
        h.backend.hang = True
        d = h.node.sample_metrics()
        self.assertNoResult(d)
        # Meanwhile requests are served and a second sample does not pile up.
        self.successResultOf(h.node.sample_metrics())
        self.assertEqual(h.backend.samples, 2)
        acquired = h.node.acquire(h.model("a"))
        h.answer("alpha")
        self.successResultOf(acquired).release()
        self.assertFalse(h.node.metrics["gpu:0"].stale)
        h.reactor.advance(METRICS_TIMEOUT_S)
        self.successResultOf(d)
        sample = h.node.metrics["gpu:0"]
        self.assertTrue(sample.stale)
        self.assertIn("timed out", sample.error)
        self.assertEqual(sample.memory_free_bytes, 8 << 30)
        # The next sample runs again.
        h.backend.hang = False
        self.successResultOf(h.node.sample_metrics())
        self.assertEqual(h.backend.samples, 3)
        self.assertFalse(h.node.metrics["gpu:0"].stale)

    def test_sampling_loop_runs_on_the_clock(self) -> None:
        h = NodeHarness()
        h.node.startService()
        self.addCleanup(h.node.stopService)
        self.assertEqual(h.backend.samples, 1)
        h.reactor.advance(5)
        self.assertEqual(h.backend.samples, 2)

    def test_hung_sample_does_not_stop_the_loop(self) -> None:
        h = NodeHarness()
        h.backend.hang = True
        h.node.startService()
        self.addCleanup(h.node.stopService)
        h.reactor.advance(METRICS_TIMEOUT_S)
        self.assertTrue(h.node.metrics["gpu:0"].stale)
        h.backend.hang = False
        h.reactor.advance(5)
        self.assertFalse(h.node.metrics["gpu:0"].stale)
