"""Per-device timers (rolemesh.node.timers): the idle unload and the
inference probe on a Clock with stand-in supervisors, then through the node."""

from __future__ import annotations

import signal
from typing import Any, Dict, List, Tuple

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.children.state import READY, STARTING, STOPPED, STOPPING
from rolemesh.node.timers import DeviceTimers
from tests.fixtures.fakes import make_config
from tests.node.test_node import MODELS, NodeHarness, assert_a_request_restarts_the_countdown


class Supervisor:
    """What the timers ask of a supervisor: its model and state, stop, check_inference."""

    def __init__(self, model: Any, state: Any = READY) -> None:
        self.model, self.state = model, state
        self.stops = 0
        self.checks: List["defer.Deferred[Any]"] = []

    def stop(self) -> "defer.Deferred[None]":
        self.stops += 1
        return defer.succeed(None)

    def check_inference(self) -> "defer.Deferred[Any]":
        d: "defer.Deferred[Any]" = defer.Deferred()
        self.checks.append(d)
        return d


class DeviceTimersPartTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.config = make_config([{"model_id": "a", "idle_unload_s": 60, "inference_probe_interval_s": 30},
                                   {"model_id": "k"}])
        self.clock = Clock()
        self.sup = Supervisor(self.config.model("a"))
        self.idle = {"gpu:0": True}
        self.running, self.draining = True, False
        self.events: List[Tuple[str, Dict[str, Any]]] = []
        self.timers = DeviceTimers({"gpu:0": self.sup}, self.idle.__getitem__, self.config.idle_unload_for,
                                   lambda: self.running, lambda: self.draining,
                                   lambda event, **fields: self.events.append((event, fields)), reactor=self.clock)

    def active(self) -> List[float]:
        return sorted(c.getTime() for c in self.clock.getDelayedCalls() if c.active())

    def test_a_quiet_device_unloads_after_its_idle_unload_s(self) -> None:
        self.timers.arm_idle("gpu:0")
        self.clock.advance(59)
        self.assertEqual(self.sup.stops, 0)
        self.clock.advance(1)
        self.assertEqual(self.sup.stops, 1)
        self.assertEqual(self.events, [("idle_unload", {"device": "gpu:0", "model": "a"})])
        self.assertEqual(self.active(), [])

    def test_no_countdown_without_a_model_a_live_child_a_limit_or_a_running_node(self) -> None:
        for model, state, running in ((None, READY, True), (self.config.model("a"), STOPPED, True),
                                      (self.config.model("k"), READY, True), (self.config.model("a"), READY, False)):
            self.sup.model, self.sup.state, self.running = model, state, running
            self.timers.device_quiet("gpu:0")
            self.assertEqual(self.active(), [], (model, state, running))

    def test_a_countdown_that_ends_on_a_busy_or_unready_device_unloads_nothing(self) -> None:
        self.timers.arm_idle("gpu:0")
        self.idle["gpu:0"] = False
        self.clock.advance(60)
        self.sup.state, self.idle["gpu:0"] = STARTING, True
        self.timers.arm_idle("gpu:0")
        self.clock.advance(60)
        self.assertEqual((self.sup.stops, self.events), (0, []))

    def test_a_request_stops_both_countdowns_and_arming_again_restarts_them(self) -> None:
        self.timers.device_quiet("gpu:0")
        self.assertEqual(self.active(), [30.0, 60.0])
        self.clock.advance(20)
        self.timers.request_started("gpu:0")
        self.assertEqual(self.active(), [])
        self.timers.device_quiet("gpu:0")
        self.timers.device_quiet("gpu:0")  # armed twice: still one of each
        self.assertEqual(self.active(), [50.0, 80.0])

    def test_the_probe_asks_an_idle_ready_child_and_rearms_while_idle(self) -> None:
        self.timers.arm_probe("gpu:0")
        self.clock.advance(30)
        self.assertEqual(len(self.sup.checks), 1)
        self.sup.checks[0].callback(True)
        self.assertIn(60.0, self.active())
        self.idle["gpu:0"] = False
        self.clock.advance(30)
        self.assertEqual(len(self.sup.checks), 1, "not while a request runs")

    def test_no_probe_while_draining_and_a_failed_probe_is_logged(self) -> None:
        self.draining = True
        self.timers.arm_probe("gpu:0")
        self.clock.advance(30)
        self.assertEqual(self.sup.checks, [])
        self.draining = False
        self.timers.arm_probe("gpu:0")
        self.clock.advance(30)
        self.sup.checks[0].errback(RuntimeError("probe broke"))
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_stop_cancels_every_timer(self) -> None:
        self.timers.device_quiet("gpu:0")
        self.timers.stop()
        self.assertEqual(self.active(), [])
        self.clock.advance(3600)
        self.assertEqual((self.sup.stops, self.sup.checks), (0, []))


class IdleUnloadTests(SynchronousTestCase):
    def started(self, **top: Any) -> NodeHarness:
        h = NodeHarness(**top)
        h.node.startService()
        self.addCleanup(lambda: h.node.running and h.node.stopService())
        return h

    def test_unloads_after_idle_unload_s(self) -> None:
        h = self.started(idle_unload_s=60)
        h.load("a")
        h.reactor.advance(59)
        self.assertEqual(h.sup().state, READY)
        self.assertEqual(h.signals.calls, [])
        h.reactor.advance(1)
        self.assertEqual(h.sup().state, STOPPING)
        self.assertEqual(h.signals.calls, [(h.child().pid, signal.SIGTERM)])
        h.reap()
        self.assertEqual(h.sup().state, STOPPED)
        self.assertIsNone(h.book().model)
        self.assertIn(("idle_unload", {"device": "gpu:0", "model": "a"}), h.events)

    def test_a_request_after_unload_starts_it_again(self) -> None:
        h = self.started(idle_unload_s=60)
        h.load("a")
        h.reactor.advance(60)
        h.reap()
        d = h.node.acquire(h.model("a"))
        self.assertEqual(h.sup().state, STARTING)
        self.assertEqual(len(h.reactor.processes), 2)
        h.answer("alpha")
        self.successResultOf(d)

    def test_a_request_restarts_the_countdown(self) -> None:
        h = self.started(idle_unload_s=60)
        assert_a_request_restarts_the_countdown(self, h, lambda: self.successResultOf(h.node.acquire(h.model("a"))))

    def test_model_level_override(self) -> None:
        models = [dict(MODELS[0], idle_unload_s=10), MODELS[1]]
        h = self.started(models=models, idle_unload_s=60)
        h.load("a")
        h.reactor.advance(10)
        self.assertEqual(h.sup().state, STOPPING)

    def test_model_level_override_without_node_default(self) -> None:
        models = [dict(MODELS[0], idle_unload_s=10), MODELS[1]]
        h = self.started(models=models)
        h.load("a")
        h.reactor.advance(10)
        self.assertEqual(h.sup().state, STOPPING)
        h.reap()
        h.load("b")
        h.reactor.advance(100000)
        self.assertEqual(h.sup().state, READY, "b has no idle_unload_s")

    def test_null_keeps_the_model_forever(self) -> None:
        models = [dict(MODELS[0], idle_unload_s=None), MODELS[1]]
        h = self.started(models=models, idle_unload_s=60)
        h.load("a")
        h.reactor.advance(100000)
        self.assertEqual(h.sup().state, READY)
        self.assertEqual(h.signals.calls, [])

    def test_unset_keeps_the_model_forever(self) -> None:
        h = self.started()
        h.load("a")
        h.reactor.advance(100000)
        self.assertEqual(h.sup().state, READY)

    def test_stop_service_cancels_idle_timers(self) -> None:
        h = self.started(idle_unload_s=60)
        h.load("a")
        d = h.node.stopService()
        h.reap()
        self.successResultOf(d)
        self.assertEqual([c for c in h.reactor.getDelayedCalls() if c.active()], [])


class InferenceProbeTests(SynchronousTestCase):
    def test_an_idle_child_is_probed_after_the_interval_and_again_after_that(self) -> None:
        h = NodeHarness(models=[{"model_id": "p", "inference_probe_interval_s": 60}])
        h.node.startService()
        self.addCleanup(h.node.stopService)
        calls: List[str] = []
        h.sup().probes.inference_fn = lambda base_url, model: (calls.append(model.model_id), defer.succeed(True))[1]
        d = h.node.acquire(h.model("p"))
        h.answer("p")
        lease = self.successResultOf(d)
        h.reactor.advance(120)
        self.assertEqual(calls, [], "never while a request runs")
        lease.release()
        h.reactor.advance(59)
        self.assertEqual(calls, [])
        h.reactor.advance(1)
        self.assertEqual(calls, ["p"])
        h.reactor.advance(60)
        self.assertEqual(calls, ["p", "p"])

    def test_off_by_default(self) -> None:
        h = NodeHarness()
        h.node.startService()
        self.addCleanup(h.node.stopService)
        h.sup().probes.inference_fn = lambda base_url, model: self.fail("probed")
        h.load("a")
        h.reactor.advance(3600)
