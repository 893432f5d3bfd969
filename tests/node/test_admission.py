"""Admission (rolemesh.node.admission): refusals, queueing, queue timeouts,
tenant caps and prefix preference on a real scheduler with stand-in
supervisors and a Clock, then ``lease_now`` and queue timeouts through the node."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base import errors
from rolemesh.children.state import READY
from rolemesh.children.views import ChildEndpoint
from rolemesh.node.admission import Admission
from rolemesh.node.leases import Lease
from rolemesh.scheduling.books import CANCELLED, QUEUED, RUNNING, Ticket
from rolemesh.scheduling.fairqueue import Share
from rolemesh.scheduling.prefix import PrefixMemory
from rolemesh.scheduling.scheduler import Scheduler
from tests.fixtures.fakes import make_config
from tests.node.test_node import NodeHarness, assert_a_request_restarts_the_countdown

CHAT = {"messages": [{"role": "user", "content": "the same long question"}]}


class Supervisor:
    """What admission asks of a supervisor: its refusal and its ready endpoint."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.refused: Optional[errors.ApiError] = None
        self.ready: Optional[ChildEndpoint] = None

    def refusal(self, model: Any) -> Optional[errors.ApiError]:
        return self.refused

    def serving(self, model: Any) -> Optional[ChildEndpoint]:
        return self.ready


class AdmissionPartTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.config = make_config([{"model_id": "a"}, {"model_id": "b"}], queue_timeout_s=10,
                                  max_pending_requests_per_device=2)
        self.clock = Clock()
        self.sups = {name: Supervisor(name) for name in ("gpu:0", "gpu:1")}
        self.started_tickets: List[Ticket] = []
        self.scheduler = Scheduler(list(self.sups), 3, self.started_tickets.append)
        self.draining = False
        self.placed: Any = (["gpu:0", "gpu:1"], {}, None)
        self.prefixes = PrefixMemory(64)
        self.warmed: List[str] = []
        self.started: List[Tuple[str, str, float]] = []
        self.released: List[Lease] = []
        self.events: List[Tuple[str, Dict[str, Any]]] = []
        self.admission = Admission(
            self.scheduler, self.sups, lambda: self.config, self.place, self.prefixes, lambda: self.draining,
            lambda model_id: [], lambda model: self.warmed.append(model.model_id),
            lambda device, model, waited, share: self.started.append((device, model.model_id, waited)),
            self.released.append, lambda event, **fields: self.events.append((event, fields)), reactor=self.clock)

    def place(self, model: Any, device: Optional[str]) -> Any:
        if isinstance(self.placed, errors.ApiError):
            raise self.placed
        lanes, need, _ = self.placed
        return lanes, need, device

    def model(self, model_id: str = "a") -> Any:
        return self.config.model(model_id)

    def test_a_draining_node_refuses_every_verb(self) -> None:
        self.draining = True
        self.assertEqual(self.failureResultOf(self.admission.acquire(self.model()), errors.ApiError).value.code,
                         "shutting_down")
        self.assertEqual(self.failureResultOf(self.admission.unload("gpu:0"), errors.ApiError).value.code,
                         "shutting_down")
        self.assertIsNone(self.admission.lease_now(self.model()))
        self.assertEqual(self.scheduler.devices["gpu:0"].pending, 0)

    def test_the_placement_refusal_is_the_answer(self) -> None:
        self.placed = errors.model_too_large("a", "needs 20 GiB", "the largest device has 16 GiB")
        self.assertIs(self.failureResultOf(self.admission.acquire(self.model()), errors.ApiError).value, self.placed)
        self.assertIsNone(self.admission.lease_now(self.model()))

    def test_backing_off_everywhere_is_the_soonest_refusal_and_elsewhere_narrows_the_lanes(self) -> None:
        soon = errors.ApiError(503, "soon", "server_error", "model_load_failed", retry_after=2)
        self.sups["gpu:0"].refused = errors.ApiError(503, "late", "server_error", "model_load_failed", retry_after=9)
        self.sups["gpu:1"].refused = soon
        self.assertIs(self.failureResultOf(self.admission.acquire(self.model()), errors.ApiError).value, soon)
        self.sups["gpu:1"].refused = None
        self.admission.acquire(self.model())
        self.assertEqual([t.device for t in self.started_tickets], ["gpu:1"])

    def test_a_tenant_at_its_cap_is_429_tenant_limit(self) -> None:
        share = Share("t", max_concurrent=1)
        self.admission.acquire(self.model(), share=share)
        failure = self.failureResultOf(self.admission.acquire(self.model(), share=share), errors.ApiError)
        self.assertEqual((failure.value.status, failure.value.code), (429, "tenant_limit"))
        self.assertIn(("tenant_limit", {"tenant": "t"}), self.events)
        self.assertIsNone(self.admission.lease_now(self.model(), share=share))

    def test_a_full_queue_is_429_queue_full(self) -> None:
        for _ in range(6):
            self.admission.acquire(self.model(), share=Share("t"))
        failure = self.failureResultOf(self.admission.acquire(self.model()), errors.ApiError)
        self.assertEqual((failure.value.status, failure.value.code), (429, "queue_full"))
        self.assertIn("every device that can take it", failure.value.message)
        self.assertIn(("queue_full", {"model": "a"}), self.events)

    def test_a_queued_request_times_out_warms_its_model_and_a_cancel_leaves_the_queue(self) -> None:
        self.placed = (["gpu:0"], {}, None)
        self.admission.acquire(self.model("b"))  # runs: gpu:0 switches to b
        waiting = self.admission.acquire(self.model("a"))
        cancelled = self.admission.acquire(self.model("a"))
        self.assertEqual(self.warmed, ["a", "a"], "a switch is coming")
        cancelled.cancel()
        self.failureResultOf(cancelled, defer.CancelledError)
        self.assertEqual(len([c for c in self.clock.getDelayedCalls() if c.active()]), 1)
        self.clock.advance(10)
        failure = self.failureResultOf(waiting, errors.ApiError)
        self.assertEqual((failure.value.status, failure.value.code), (503, "queue_timeout"))
        self.assertIn(("queue_timeout", {"model": "a"}), self.events)
        self.assertEqual(list(self.scheduler.devices["gpu:0"].queue), [])

    def test_lease_now_leases_a_ready_child_and_leaves_everything_else_to_acquire(self) -> None:
        self.assertIsNone(self.admission.lease_now(self.model()), "nothing ready")
        self.assertEqual((self.scheduler.devices["gpu:0"].pending, self.started), (0, []))
        self.sups["gpu:1"].ready = ChildEndpoint("a", "http://127.0.0.1:20001", 20001, 7, 1)
        self.scheduler.model_loaded("gpu:1", "a")
        lease = self.admission.lease_now(self.model())
        assert lease is not None
        self.assertEqual((lease.device, lease.ticket.state, self.started), ("gpu:1", RUNNING, [("gpu:1", "a", 0.0)]))
        lease.release()
        self.assertEqual(self.released, [lease])

    def test_the_lane_that_served_a_prefix_is_preferred_and_hits_are_counted_per_model(self) -> None:
        self.assertEqual(self.admission.cache_hit_rates(), {"a": None, "b": None})
        for sup in self.sups.values():
            sup.ready = ChildEndpoint("a", "http://127.0.0.1:20001", 20001, 7, 1)
            self.scheduler.model_loaded(sup.name, "a")
        devices = []
        for _ in range(3):
            lease = self.admission.lease_now(self.model(), prompt=CHAT)
            assert lease is not None
            devices.append(lease.device)
            self.scheduler.finish(lease.ticket)
        self.assertEqual(devices, [devices[0]] * 3)
        self.assertEqual(self.admission.cache_hit_rates(), {"a": 2 / 3, "b": None}, "the first lookup found none")
        plain = self.admission.lease_now(self.model())  # no prompt: no lookup
        self.assertIsNotNone(plain)
        self.assertEqual(self.admission.cache_hit_rates()["a"], 2 / 3)

    def test_an_unload_waits_its_turn_and_leaves_the_queue_if_cancelled(self) -> None:
        self.placed = (["gpu:0"], {}, None)
        self.admission.acquire(self.model())
        d = self.admission.unload("gpu:0")
        ticket = self.scheduler.devices["gpu:0"].queue[0]
        self.assertEqual(ticket.state, QUEUED)
        d.cancel()
        self.failureResultOf(d, defer.CancelledError)
        self.assertEqual(ticket.state, CANCELLED)


class LeaseNowTests(SynchronousTestCase):
    """``lease_now``: the request path's lease without a Deferred, for a
    request that starts there and then on a ready child; anything else is
    left to ``acquire``."""

    def test_a_ready_child_with_a_free_slot_is_leased_at_once(self) -> None:
        h = NodeHarness()
        h.load("a")
        h.events.clear()
        lease = h.node.lease_now(h.model("a"))
        assert lease is not None
        self.assertEqual((lease.device, lease.endpoint.model_id, lease.ticket.state), ("gpu:0", "a", RUNNING))
        self.assertEqual(h.book().running, [lease.ticket])
        self.assertEqual(h.events, [("queue_wait", {"device": "gpu:0", "model": "a", "seconds": 0.0,
                                                    "tenant": "default"})])
        lease.release()
        lease.release()
        self.assertTrue(h.idle())

    def test_anything_else_is_left_to_acquire_and_changes_nothing(self) -> None:
        h = NodeHarness()
        self.assertIsNone(h.node.lease_now(h.model("a")), "not loaded: acquire loads it")
        self.assertEqual((h.reactor.processes, h.book().pending), ([], 0))
        h.load("a")
        self.assertIsNone(h.node.lease_now(h.model("b")), "another model: acquire switches")
        self.assertEqual(h.sup().state, READY)
        first = h.node.lease_now(h.model("a"))
        self.assertIsNotNone(first)
        self.assertIsNone(h.node.lease_now(h.model("a")), "its one slot is taken: acquire queues")
        self.assertEqual(h.book().pending, 1)
        assert first is not None
        first.release()
        h.node.draining = True
        self.assertIsNone(h.node.lease_now(h.model("a")), "draining: acquire refuses")

    def test_a_child_that_is_loading_is_waited_for_through_acquire(self) -> None:
        h = NodeHarness()
        d = h.node.acquire(h.model("a"))  # loading: the books say "a", the child does not answer yet
        self.assertIsNone(h.node.lease_now(h.model("a")))
        h.answer("alpha")
        self.successResultOf(d).release()
        self.assertIsNotNone(h.node.lease_now(h.model("a")))

    def test_a_lease_stops_the_idle_countdown_and_its_release_restarts_it(self) -> None:
        h = NodeHarness(idle_unload_s=60)
        h.node.startService()
        self.addCleanup(lambda: h.node.running and h.node.stopService())
        assert_a_request_restarts_the_countdown(self, h, lambda: h.node.lease_now(h.model("a")))


class QueueTimeoutTests(SynchronousTestCase):
    def test_a_request_that_waits_too_long_in_the_queue_gets_503_and_leaves_it(self) -> None:
        h = NodeHarness(queue_timeout_s=10, max_pending_requests_per_device=3)
        first = h.node.acquire(h.model("a"))
        h.answer("alpha")
        lease = self.successResultOf(first)
        queued = h.node.acquire(h.model("a"))
        h.reactor.advance(9.9)
        self.assertNoResult(queued)
        h.reactor.advance(0.1)
        failure = self.failureResultOf(queued, errors.ApiError)
        self.assertEqual((failure.value.status, failure.value.code), (503, "queue_timeout"))
        self.assertIsNotNone(failure.value.retry_after)
        self.assertEqual(h.node.in_flight(), 1, "the ticket left the queue")
        lease.release()
        self.assertTrue(h.idle())

    def test_the_timer_stops_once_the_request_starts(self) -> None:
        h = NodeHarness(queue_timeout_s=10)
        first = h.node.acquire(h.model("a"))
        h.answer("alpha")
        lease = self.successResultOf(first)
        queued = h.node.acquire(h.model("a"))
        h.reactor.advance(5)
        lease.release()
        second = self.successResultOf(queued)
        h.reactor.advance(60)
        self.assertFalse(second.released)
        second.release()
        self.assertTrue(h.idle())

    def test_a_request_that_starts_at_once_has_no_timer(self) -> None:
        h = NodeHarness(queue_timeout_s=5)
        d = h.node.acquire(h.model("a"))
        h.reactor.advance(6)  # a load longer than the queue timeout is not a queue wait
        h.answer("alpha")
        self.successResultOf(d).release()
