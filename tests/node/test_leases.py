"""A ticket that may run becomes a lease (rolemesh.node.leases): the starts on a
real scheduler with stand-in supervisors, the refusals a drain makes, then
checking and retrying a lease's child through the node."""

from __future__ import annotations

import signal
from typing import Any, Dict, List, Optional, Tuple

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base import errors
from rolemesh.children.state import READY
from rolemesh.children.views import ChildEndpoint
from rolemesh.node.leases import Acquisition, Lease, LeaseStarts, UnloadRequest, refuse, refuse_waiting
from rolemesh.scheduling.books import CANCELLED, DONE, QUEUED, RUNNING
from rolemesh.scheduling.scheduler import UNLOAD, Scheduler
from tests.fixtures.fakes import make_config
from tests.node.test_node import NodeHarness


class Supervisor:
    """What the starts ask of a supervisor; ``ensure`` waits for the test."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.model: Any = None
        self.ready: Optional[ChildEndpoint] = None
        self.loading_or_loaded: Optional[str] = None
        self.ensures: List[Tuple[Any, "defer.Deferred[ChildEndpoint]"]] = []
        self.stops: List["defer.Deferred[None]"] = []
        self.probed: List[Tuple[str, int]] = []

    def serving(self, model: Any) -> Optional[ChildEndpoint]:
        return self.ready if self.ready is not None and self.ready.model_id == model.model_id else None

    def ensure(self, model: Any) -> "defer.Deferred[ChildEndpoint]":
        d: "defer.Deferred[ChildEndpoint]" = defer.Deferred()
        self.ensures.append((model, d))
        self.loading_or_loaded = model.model_id
        return d

    def stop(self) -> "defer.Deferred[None]":
        d: "defer.Deferred[None]" = defer.Deferred()
        self.stops.append(d)
        return d

    def replace_if_unhealthy(self, after: str, generation: int) -> "defer.Deferred[bool]":
        self.probed.append((after, generation))
        return defer.succeed(True)


def endpoint(model_id: str, generation: int = 1) -> ChildEndpoint:
    return ChildEndpoint(model_id, "http://127.0.0.1:20000", 20000, 1001, generation)


class LeaseStartsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.config = make_config([{"model_id": "a"}, {"model_id": "b"}])
        self.clock = Clock()
        self.sups = {"gpu:0": Supervisor("gpu:0")}
        self.draining = False
        self.started: List[Tuple[str, str, float]] = []
        self.quiet: List[str] = []
        self.cancelled_idle: List[str] = []
        self.scheduler = Scheduler(["gpu:0"], 4, lambda ticket: self.starts.start(ticket))
        self.starts = LeaseStarts(
            self.scheduler, self.sups, lambda: self.config, lambda: self.draining,
            lambda device, model, waited, share: self.started.append((device, model.model_id, waited)),
            self.quiet.append, self.cancelled_idle.append, lambda old, new: self.new_child, reactor=self.clock)
        self.new_child = False

    def request(self, model_id: str = "a", queued_at: float = 0.0) -> Acquisition:
        return Acquisition(self.config.model(model_id), defer.Deferred(), queued_at=queued_at)

    def submit(self, request: Any, parallel: int = 1) -> Any:
        return self.scheduler.submit(request.model.model_id, parallel, None, context=request, lanes=["gpu:0"])

    def test_a_ready_child_is_leased_at_once_and_its_release_frees_the_ticket(self) -> None:
        self.sups["gpu:0"].ready = endpoint("a")
        self.clock.advance(3)
        request = self.request(queued_at=1.0)
        ticket = self.submit(request)
        lease = self.successResultOf(request.result)
        self.assertEqual((lease.device, lease.endpoint.model_id, lease.model), ("gpu:0", "a", self.config.model("a")))
        self.assertEqual(self.started, [("gpu:0", "a", 2.0)])
        self.assertEqual(self.sups["gpu:0"].ensures, [], "nothing to load")
        lease.release()
        lease.release()
        self.assertEqual((ticket.state, self.quiet), (DONE, ["gpu:0"]))

    def test_otherwise_the_supervisor_loads_the_model_first(self) -> None:
        request = self.request()
        ticket = self.submit(request)
        self.assertNoResult(request.result)
        (model, loading), = self.sups["gpu:0"].ensures
        self.assertIs(request.loading, loading)
        loading.callback(endpoint("a"))
        self.assertEqual(self.successResultOf(request.result).ticket, ticket)

    def test_a_failed_load_fails_the_request_frees_the_ticket_and_unbooks_the_model(self) -> None:
        request = self.request()
        ticket = self.submit(request)
        self.scheduler.model_loaded("gpu:0", "a")
        self.sups["gpu:0"].loading_or_loaded = None  # the supervisor does not hold it
        self.sups["gpu:0"].ensures[0][1].errback(errors.ApiError(503, "no", "server_error", "model_load_failed"))
        self.assertEqual(self.failureResultOf(request.result, errors.ApiError).value.code, "model_load_failed")
        self.assertEqual((ticket.state, self.scheduler.devices["gpu:0"].model, self.quiet), (DONE, None, ["gpu:0"]))

    def test_a_request_cancelled_during_its_load_gets_no_lease_and_frees_its_ticket(self) -> None:
        request = self.request()
        ticket = self.submit(request)
        request.result.cancel()
        self.sups["gpu:0"].ensures[0][1].callback(endpoint("a"))
        self.failureResultOf(request.result, defer.CancelledError)
        self.assertEqual(ticket.state, DONE, "the lease made for it was released")

    def test_a_ticket_started_while_draining_is_refused_not_begun(self) -> None:
        self.draining = True
        request = self.request()
        ticket = self.submit(request)
        self.assertEqual(self.failureResultOf(request.result, errors.ApiError).value.code, "shutting_down")
        self.assertEqual((ticket.state, self.started, self.sups["gpu:0"].ensures), (DONE, [], []))

    def test_an_unload_ticket_stops_the_child_then_answers(self) -> None:
        unload = UnloadRequest(defer.Deferred())
        ticket = self.scheduler.submit(UNLOAD, 1, "gpu:0", context=unload, lanes=["gpu:0"])
        self.assertEqual((ticket.state, self.cancelled_idle), (RUNNING, ["gpu:0"]))
        self.assertNoResult(unload.result)
        self.sups["gpu:0"].stops[0].callback(None)
        self.successResultOf(unload.result)
        self.assertEqual((ticket.state, self.quiet), (DONE, ["gpu:0"]))

    def test_check_child_never_probes_under_other_requests(self) -> None:
        self.sups["gpu:0"].ready = endpoint("a")
        first, second = self.request(), self.request()
        self.submit(first, parallel=2)
        self.submit(second, parallel=2)
        lease, other = self.successResultOf(first.result), self.successResultOf(second.result)
        self.assertFalse(self.successResultOf(self.starts.check_child(lease, "an upstream timeout")))
        self.assertEqual(self.sups["gpu:0"].probed, [], "not even probed")
        other.release()
        self.assertTrue(self.successResultOf(self.starts.check_child(lease, "an upstream timeout")))
        self.assertEqual(self.sups["gpu:0"].probed, [("an upstream timeout", 1)])

    def test_a_retry_goes_to_the_record_the_request_was_admitted_for_unless_the_child_serves_both(self) -> None:
        self.sups["gpu:0"].ready = endpoint("a")
        request = self.request()
        self.submit(request)
        lease = self.successResultOf(request.result)
        self.config = make_config([{"model_id": "a", "roles": ["chat"]}])
        newer = self.sups["gpu:0"].model = self.config.model("a")
        for new_child, expected in ((True, lease.model), (False, newer)):
            self.new_child = new_child
            self.assertNoResult(self.starts.retry_endpoint(lease))
            self.assertIs(self.sups["gpu:0"].ensures[-1][0], expected)

    def test_a_retry_for_a_model_a_reload_removed_is_a_503(self) -> None:
        self.sups["gpu:0"].ready = endpoint("a")
        request = self.request()
        self.submit(request)
        lease = self.successResultOf(request.result)
        self.config = make_config([{"model_id": "b"}])
        error = self.failureResultOf(self.starts.retry_endpoint(lease), errors.ApiError).value
        self.assertEqual((error.status, error.code), (503, "model_removed"))


class RefusalTests(SynchronousTestCase):
    """What a drain does to the requests that have not begun."""

    def test_refuse_stops_the_queue_timer_and_answers_shutting_down_once(self) -> None:
        clock = Clock()
        request = Acquisition(make_config([{"model_id": "a"}]).model("a"), defer.Deferred())
        request.queue_timer = clock.callLater(10, lambda: None)
        refuse(request)
        self.assertIsNone(request.queue_timer)
        self.assertEqual(clock.getDelayedCalls(), [])
        self.assertEqual(self.failureResultOf(request.result, errors.ApiError).value.code, "shutting_down")
        refuse(request)  # answered already: nothing more

    def test_refuse_waiting_cancels_the_queued_and_the_loading_not_the_answering(self) -> None:
        config = make_config([{"model_id": "a"}, {"model_id": "b"}])
        started: Dict[int, Any] = {}
        scheduler = Scheduler(["gpu:0"], 4, lambda ticket: started.setdefault(ticket.id, ticket))
        answering = Acquisition(config.model("a"), defer.Deferred())
        loading = Acquisition(config.model("a"), defer.Deferred(), loading=defer.Deferred())
        queued = Acquisition(config.model("b"), defer.Deferred())
        tickets = [scheduler.submit(r.model.model_id, 2, None, context=r, lanes=["gpu:0"])
                   for r in (answering, loading, queued)]
        self.assertEqual([t.state for t in tickets], [RUNNING, RUNNING, QUEUED])
        refuse_waiting(scheduler)
        self.assertNoResult(answering.result)
        for request in (loading, queued):
            self.assertEqual(self.failureResultOf(request.result, errors.ApiError).value.code, "shutting_down")
        self.failureResultOf(loading.loading, defer.CancelledError)
        self.assertEqual(tickets[2].state, CANCELLED)


class LeaseTests(SynchronousTestCase):
    def test_release_runs_once(self) -> None:
        released: List[Lease] = []
        sup: Any = Supervisor("gpu:1")
        lease = Lease(object(), endpoint("a"), sup, released.append)  # type: ignore[arg-type]
        self.assertEqual(lease.device, "gpu:1")
        lease.release()
        lease.release()
        self.assertEqual(released, [lease])


class CheckChildTests(SynchronousTestCase):
    """After a timeout or a silent answer the node probes the child, and
    replaces it only when no other request is being answered by it."""

    def parallel_harness(self) -> NodeHarness:
        return NodeHarness(models=[{"model_id": "p", "server_args": {"parallel": 2}}],
                           max_pending_requests_per_device=4)

    def test_an_unhealthy_child_alone_is_replaced(self) -> None:
        h = self.parallel_harness()
        d = h.node.acquire(h.model("p"))
        h.answer("p")
        lease = self.successResultOf(d)
        h.probe.ready.clear()  # the child stops answering its probe
        self.assertTrue(self.successResultOf(h.node.check_child(lease, "an upstream timeout")))
        self.assertEqual(h.sup().state, "stopping")
        self.assertEqual(h.sup().last_error_code, "unhealthy")
        lease.release()

    def test_a_child_still_answering_others_is_not_killed_under_them(self) -> None:
        h = self.parallel_harness()
        first, second = h.node.acquire(h.model("p")), h.node.acquire(h.model("p"))
        h.answer("p")
        a, b = self.successResultOf(first), self.successResultOf(second)
        h.probe.ready.clear()
        probes = len(h.probe.calls)
        self.assertFalse(self.successResultOf(h.node.check_child(a, "an upstream timeout")))
        self.assertEqual(h.sup().state, READY, "b's answer goes on")
        self.assertEqual(len(h.probe.calls), probes, "not even probed")
        a.release()
        b.release()

    def test_a_child_already_replaced_is_left_alone(self) -> None:
        h = self.parallel_harness()
        d = h.node.acquire(h.model("p"))
        h.answer("p")
        lease = self.successResultOf(d)
        h.child().exit(signal=signal.SIGKILL)  # it died; the next ensure starts another
        h.sup().ensure(h.model("p"))
        h.answer("p")
        generation = h.sup().generation
        h.probe.ready.clear()
        self.assertFalse(self.successResultOf(h.node.check_child(lease, "an upstream timeout")))
        self.assertEqual((h.sup().state, h.sup().generation), (READY, generation))
        lease.release()

    def test_retry_endpoint_is_a_fresh_child_after_a_refused_connection(self) -> None:
        h = self.parallel_harness()
        d = h.node.acquire(h.model("p"))
        h.answer("p")
        lease = self.successResultOf(d)
        h.probe.ready.clear()
        retry = h.node.retry_endpoint(lease)
        self.assertNoResult(retry)
        h.reap()
        h.answer("p")
        endpoint = self.successResultOf(retry)
        self.assertGreater(endpoint.generation, lease.endpoint.generation)
        lease.release()

    def test_a_retry_after_a_reload_keeps_the_child_that_serves_others(self) -> None:
        # The reload changed p's command line (ctx_size): the retry of lease a
        # goes to the child a was admitted for, not to a switch to the
        # reloaded record that would stop the child under b.
        h = self.parallel_harness()
        first, second = h.node.acquire(h.model("p")), h.node.acquire(h.model("p"))
        h.answer("p")
        a, b = self.successResultOf(first), self.successResultOf(second)
        h.node.reconfigure(make_config([{"model_id": "p", "server_args": {"parallel": 2}, "ctx_size": 8192}],
                                       max_pending_requests_per_device=4))
        spawned = len(h.reactor.processes)
        endpoint = self.successResultOf(h.node.retry_endpoint(a))
        self.assertEqual(h.sup().state, READY, "b's answer goes on")
        self.assertEqual((endpoint.generation, endpoint.pid), (a.endpoint.generation, a.endpoint.pid))
        self.assertEqual(len(h.reactor.processes), spawned, "nothing started")
        a.release()
        b.release()

    def test_a_retry_after_a_reload_that_only_changed_roles_reuses_the_child(self) -> None:
        h = self.parallel_harness()
        d = h.node.acquire(h.model("p"))
        h.answer("p")
        lease = self.successResultOf(d)
        h.node.reconfigure(make_config([{"model_id": "p", "server_args": {"parallel": 2}, "roles": ["chat"]}],
                                       max_pending_requests_per_device=4))
        endpoint = self.successResultOf(h.node.retry_endpoint(lease))
        self.assertEqual((h.sup().state, endpoint.generation), (READY, lease.endpoint.generation))
        lease.release()

    def test_a_retry_after_a_reload_that_removed_the_model_is_a_clear_503(self) -> None:
        h = self.parallel_harness()
        d = h.node.acquire(h.model("p"))
        h.answer("p")
        lease = self.successResultOf(d)
        h.node.reconfigure(make_config([{"model_id": "q"}], max_pending_requests_per_device=4))
        failure = self.failureResultOf(h.node.retry_endpoint(lease), errors.ApiError)
        error = failure.value
        self.assertEqual((error.status, error.code), (503, "model_removed"))
        self.assertIn("'p'", error.message)
        self.assertIn("reload", error.message)
        lease.release()
