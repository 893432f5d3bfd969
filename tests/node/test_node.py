"""Unit tests of the node: real DeviceSupervisors on a recording reactor, a
fake readiness probe and a fake device backend; no real time, no processes."""

from __future__ import annotations

import itertools
import signal
from typing import Any, Callable, Dict, List, Optional, Sequence

from twisted.internet import defer
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base import errors
from rolemesh.children.state import READY, STARTING, STOPPED, STOPPING
from rolemesh.children.supervisor import DeviceSupervisor
from rolemesh.node.node import Lease, Node
from rolemesh.scheduling.books import CANCELLED, DONE, QUEUED, RUNNING
from tests.fixtures.fakes import (
    FakeBackend,
    FakeProbe,
    FakeProcess,
    GroupSignals,
    ProcessReactor,
    StubbornSignals,
    make_config,
)

#: a: served as "alpha"; b: no alias; e: an embedder served as "emb".
MODELS: List[Dict[str, Any]] = [
    {"model_id": "a", "alias": "alpha", "roles": ["chat"]},
    {"model_id": "b", "roles": ["chat", "summarize"]},
    {"model_id": "e", "alias": "emb", "roles": ["embed"]},
]


class NodeHarness:
    """A Node over real supervisors, fake children and a Clock."""

    def __init__(self, models: Optional[Sequence[Dict[str, Any]]] = None, devices: int = 1,
                 signals: Callable[[ProcessReactor], GroupSignals] = GroupSignals, **top: Any) -> None:
        top.setdefault("llama_server_startup_timeout_s", 10.0)
        top.setdefault("llama_server_probe_interval_s", 0.5)
        top.setdefault("llama_server_stop_timeout_s", 5.0)
        self.config = make_config(MODELS if models is None else models, **top)
        self.reactor = ProcessReactor()
        self.probe = FakeProbe()
        self.signals = signals(self.reactor)
        self.backend = FakeBackend(count=devices)
        ports = itertools.count(20000)
        self.supervisors = [
            DeviceSupervisor(
                ref,
                self.backend,
                self.config,
                "/opt/llama/llama-server",
                reactor=self.reactor,
                probe=self.probe,
                pick_port=lambda: next(ports),
                signal_group=self.signals,
                environ={"PATH": "/usr/bin"},
            )
            for ref in self.backend.refs
        ]
        self.node = Node(self.config, self.backend, self.backend.refs, self.supervisors, reactor=self.reactor)
        self.events: List[Any] = []
        self.node.events.subscribe(lambda event, **fields: self.events.append((event, fields)))

    def model(self, model_id: str) -> Any:
        return self.config.model(model_id)

    def sup(self, device: str = "gpu:0") -> DeviceSupervisor:
        return self.node.supervisors[device]

    def model_on(self, device: str = "gpu:0") -> Optional[str]:
        """The model id the device's supervisor holds (whatever its state)."""
        model = self.node.supervisors[device].model
        return model.model_id if model is not None else None

    def book(self, device: str = "gpu:0") -> Any:
        return self.node.scheduler.devices[device]

    def answer(self, *served_names: str) -> None:
        """Children serving these names pass the probe from now on; one probe tick."""
        self.probe.ready |= set(served_names)
        self.reactor.advance(self.config.llama_server_probe_interval_s)

    def child(self, device: str = "gpu:0") -> FakeProcess:
        """The live fake child of ``device``."""
        index = self.node.supervisors[device].device.index
        live = [p for p in self.reactor.processes
                if not p.ended and p.env.get("FAKE_VISIBLE_DEVICES") == str(index)]
        assert len(live) == 1, live
        return live[0]

    def reap(self, device: str = "gpu:0") -> None:
        """The child of ``device`` got its signal and exits."""
        self.child(device).exit(0)

    def load(self, model_id: str, device: Optional[str] = None) -> str:
        """Load ``model_id`` (through the node, as a request would) and leave it idle."""
        d = self.node.acquire(self.model(model_id), device=device)
        self.answer(self.model(model_id).served_name)
        results: List[Any] = []
        d.addBoth(results.append)
        assert results and isinstance(results[0], Lease), results
        results[0].release()
        return results[0].device

    def idle(self) -> bool:
        return all(book.pending == 0 for book in self.node.scheduler.devices.values())


class AcquireTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.h = NodeHarness()

    def test_acquire_ensures_the_model_then_leases_the_device(self) -> None:
        h = self.h
        d = h.node.acquire(h.model("a"))
        self.assertNoResult(d)
        self.assertEqual(h.sup().state, STARTING)
        self.assertEqual(len(h.reactor.processes), 1)
        self.assertEqual(len(h.book().running), 1)
        h.answer("alpha")
        lease = self.successResultOf(d)
        self.assertEqual(lease.device, "gpu:0")
        self.assertEqual(lease.endpoint.model_id, "a")
        self.assertEqual(lease.endpoint.base_url, "http://127.0.0.1:20000")
        self.assertEqual(lease.endpoint.pid, h.child().pid)
        self.assertEqual(lease.ticket.state, RUNNING)
        self.assertIs(lease.supervisor, h.sup())

    def test_release_frees_the_slot_once(self) -> None:
        h = self.h
        d = h.node.acquire(h.model("a"))
        h.answer("alpha")
        lease = self.successResultOf(d)
        self.assertEqual(h.book().pending, 1)
        lease.release()
        self.assertEqual(h.book().pending, 0)
        self.assertEqual(lease.ticket.state, DONE)
        self.assertTrue(lease.released)
        lease.release()  # idempotent
        self.assertEqual(h.book().pending, 0)

    def test_release_starts_the_next_queued_request(self) -> None:
        h = self.h
        first = h.node.acquire(h.model("a"))
        second = h.node.acquire(h.model("a"))
        h.answer("alpha")
        lease = self.successResultOf(first)
        self.assertNoResult(second)
        self.assertEqual(len(h.book().queue), 1)
        lease.release()
        second_lease = self.successResultOf(second)
        self.assertEqual(second_lease.endpoint, lease.endpoint, "same child, no reload")
        self.assertEqual(len(h.reactor.processes), 1)

    def test_a_ready_model_is_leased_at_once(self) -> None:
        h = self.h
        h.load("a")
        lease = self.successResultOf(h.node.acquire(h.model("a")))
        self.assertEqual(lease.device, "gpu:0")
        self.assertEqual(len(h.reactor.processes), 1)

    def test_queue_full_is_429_with_retry_after(self) -> None:
        h = self.h  # max_pending_requests_per_device defaults to 2
        pending = [h.node.acquire(h.model("a")) for _ in range(2)]
        failure = self.failureResultOf(h.node.acquire(h.model("a")), errors.ApiError)
        error = failure.value
        self.assertEqual((error.status, error.code, error.type), (429, "queue_full", "rate_limit_error"))
        self.assertIsNotNone(error.retry_after)
        self.assertGreaterEqual(error.retry_after, 1)
        self.assertEqual(h.book().pending, 2, "the rejected request took no slot")
        self.assertIn(("queue_full", {"model": "a"}), h.events)
        for d in pending:
            self.assertNoResult(d)

    def test_queue_full_for_a_pinned_device(self) -> None:
        h = self.h
        for _ in range(2):
            h.node.acquire(h.model("a"), device="gpu:0")
        failure = self.failureResultOf(h.node.acquire(h.model("b"), device="gpu:0"), errors.ApiError)
        self.assertEqual(failure.value.status, 429)
        self.assertIn("gpu:0", failure.value.message)

    def test_cancel_while_queued_leaves_the_queue(self) -> None:
        h = self.h
        first = h.node.acquire(h.model("a"))
        second = h.node.acquire(h.model("a"))
        ticket = h.book().queue[0]
        second.cancel()
        self.failureResultOf(second, defer.CancelledError)
        self.assertEqual(ticket.state, CANCELLED)
        self.assertEqual(len(h.book().queue), 0)
        self.assertEqual(h.book().pending, 1)
        # The freed slot is usable at once: two more fit again only after it.
        third = h.node.acquire(h.model("a"))
        self.assertNoResult(third)
        h.answer("alpha")
        self.successResultOf(first).release()
        self.successResultOf(third)

    def test_cancel_while_loading_frees_the_slot_and_keeps_the_load(self) -> None:
        h = self.h
        first = h.node.acquire(h.model("a"))
        second = h.node.acquire(h.model("a"))
        first.cancel()
        self.failureResultOf(first, defer.CancelledError)
        self.assertEqual(h.sup().state, STARTING, "the shared load goes on")
        # The queued request moved up and shares the same load.
        self.assertEqual(len(h.book().running), 1)
        self.assertEqual(len(h.book().queue), 0)
        h.answer("alpha")
        self.successResultOf(second).release()
        self.assertTrue(h.idle())
        self.assertEqual(len(h.reactor.processes), 1)

    def test_cancel_while_loading_alone_leaves_books_empty(self) -> None:
        h = self.h
        d = h.node.acquire(h.model("a"))
        d.cancel()
        self.failureResultOf(d, defer.CancelledError)
        self.assertTrue(h.idle())
        h.answer("alpha")
        self.assertEqual(h.sup().state, READY)
        self.successResultOf(h.node.acquire(h.model("a")))

    def test_load_failure_fails_the_request_and_frees_the_device(self) -> None:
        h = self.h
        d = h.node.acquire(h.model("a"))
        queued = h.node.acquire(h.model("a"))
        h.child().output("error loading model\n")
        h.child().exit(1)
        failure = self.failureResultOf(d, errors.ApiError)
        self.assertEqual((failure.value.status, failure.value.code), (503, "model_load_failed"))
        # The queued request meets the back-off: 503 at once, nothing spawned.
        failure = self.failureResultOf(queued, errors.ApiError)
        self.assertEqual((failure.value.status, failure.value.code), (503, "model_load_failed"))
        self.assertEqual(failure.value.retry_after, 15)
        self.assertEqual(len(h.reactor.processes), 1)
        self.assertTrue(h.idle())
        h.reactor.advance(15)
        d = h.node.acquire(h.model("a"))
        self.assertEqual(len(h.reactor.processes), 2)
        h.answer("alpha")
        self.successResultOf(d).release()
        self.assertTrue(h.idle())

    def test_switch_waits_for_in_flight_request(self) -> None:
        h = self.h
        first = h.node.acquire(h.model("a"))
        h.answer("alpha")
        lease = self.successResultOf(first)
        other = h.node.acquire(h.model("b"))
        self.assertNoResult(other)
        self.assertEqual(h.sup().state, READY, "no switch under a request in flight")
        self.assertEqual(h.signals.calls, [])
        lease.release()
        self.assertEqual(h.sup().state, STOPPING)
        h.reap()
        h.answer("b")
        self.assertEqual(self.successResultOf(other).endpoint.model_id, "b")

    def test_draining_node_refuses_acquire(self) -> None:
        h = self.h
        h.node.drain(1.0)
        failure = self.failureResultOf(h.node.acquire(h.model("a")), errors.ApiError)
        self.assertEqual((failure.value.status, failure.value.code), (503, "shutting_down"))
        self.assertTrue(h.idle())


class ResolveTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.h = NodeHarness()

    def test_by_model_id_and_alias(self) -> None:
        node = self.h.node
        self.assertEqual(node.resolve("a").model_id, "a")
        self.assertEqual(node.resolve("alpha").model_id, "a")
        self.assertEqual(node.resolve("emb").model_id, "e")
        self.assertEqual(node.resolve("b").model_id, "b")

    def test_role_resolves_to_first_serving_model(self) -> None:
        self.assertEqual(self.h.node.resolve("chat").model_id, "a")
        self.assertEqual(self.h.node.resolve("summarize").model_id, "b")
        self.assertEqual(self.h.node.resolve("embed").model_id, "e")

    def test_role_prefers_a_loaded_model(self) -> None:
        h = self.h
        h.load("b")
        self.assertEqual(h.node.resolve("chat").model_id, "b")

    def test_role_prefers_a_loading_model(self) -> None:
        h = self.h
        h.node.acquire(h.model("b"))
        self.assertEqual(h.sup().state, STARTING)
        self.assertEqual(h.node.resolve("chat").model_id, "b")

    def test_role_falls_back_after_unload(self) -> None:
        h = self.h
        h.load("b")
        h.sup().stop()
        h.reap()
        self.assertEqual(h.node.resolve("chat").model_id, "a")

    def test_unknown_is_404(self) -> None:
        for name in ("nope", "ALPHA", "a ", "", "/models/a.gguf"):
            with self.assertRaises(errors.ApiError) as caught:
                self.h.node.resolve(name)
            self.assertEqual((caught.exception.status, caught.exception.code), (404, "model_not_found"))

    def test_model_id_wins_over_a_role_of_the_same_name(self) -> None:
        h = NodeHarness([{"model_id": "chat", "roles": ["x"]}, {"model_id": "z", "roles": ["chat"]}])
        h.load("z")
        self.assertEqual(h.node.resolve("chat").model_id, "chat")


class SupervisorListenerTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.h = NodeHarness()

    def test_loading_and_ready_are_booked(self) -> None:
        h = self.h
        h.node.acquire(h.model("a"))
        self.assertEqual(h.book().model, "a")
        self.assertEqual(h.node.loaded_on("a"), ["gpu:0"])

    def test_crash_unloads_the_model_in_the_books(self) -> None:
        h = self.h
        h.load("a")
        self.assertEqual(h.book().model, "a")
        h.child().exit(signal=signal.SIGSEGV)
        self.assertEqual(h.sup().state, STOPPED)
        self.assertIsNone(h.book().model)
        self.assertEqual(h.node.loaded_on("a"), [])
        self.assertIn(("child_state", {"device": "gpu:0", "state": STOPPED, "model": "a"}), h.events)
        # The next request starts it again.
        d = h.node.acquire(h.model("a"))
        self.assertEqual(len(h.reactor.processes), 2)
        h.answer("alpha")
        self.successResultOf(d)

    def test_crash_under_a_request_lets_the_queue_move_on(self) -> None:
        h = self.h
        first = h.node.acquire(h.model("a"))
        h.answer("alpha")
        lease = self.successResultOf(first)
        queued = h.node.acquire(h.model("a"))
        h.child().exit(signal=signal.SIGKILL)
        self.assertIsNone(h.book().model)
        self.assertNoResult(queued)
        lease.release()  # the proxy saw a 502 and released
        self.assertEqual(h.sup().state, STARTING)
        h.answer("alpha")
        self.successResultOf(queued).release()
        self.assertTrue(h.idle())


def assert_a_request_restarts_the_countdown(test: SynchronousTestCase, h: NodeHarness,
                                            lease: Callable[[], Optional[Lease]]) -> None:
    """With ``idle_unload_s: 60``: a request (``lease()``) 30 s into the
    countdown stops it; its release starts it again from 60."""
    h.load("a")
    h.reactor.advance(30)
    held = lease()
    assert held is not None
    h.reactor.advance(100)
    test.assertEqual(h.sup().state, READY, "never unloaded under a request")
    held.release()
    h.reactor.advance(59)
    test.assertEqual(h.sup().state, READY)
    h.reactor.advance(1)
    test.assertEqual(h.sup().state, STOPPING)


class LostErrorTests(SynchronousTestCase):
    """A bug in a callback chain is logged, never dropped, and leaves nothing waiting."""

    def test_metrics_bookkeeping_error_is_logged_and_sampling_goes_on(self) -> None:
        from twisted.logger import capturedLogs

        h = NodeHarness()
        h.backend.sample = lambda devices: defer.succeed([object()])  # not a DeviceMetrics
        with capturedLogs() as events:
            h.node.startService()
            self.addCleanup(h.node.stopService)
        failures = [e for e in events if e.get("log_failure") is not None]
        self.assertEqual(len(failures), 1, events)
        self.assertIn("device metrics bookkeeping failed", failures[0]["log_format"])
        self.flushLoggedErrors(AttributeError)
        self.assertFalse(h.node.sampler.sampling, "the next tick may sample again")

    def test_a_request_whose_start_breaks_is_answered_not_left_waiting(self) -> None:
        import rolemesh.node.leases as leases_module  # where a started ticket becomes a Lease

        h = NodeHarness()
        d = h.node.acquire(h.model("a"))

        def broken_lease(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("a bug in the ready callback")

        real_lease, leases_module.Lease = leases_module.Lease, broken_lease  # type: ignore[assignment]
        try:
            h.answer("alpha")
        finally:
            leases_module.Lease = real_lease  # type: ignore[misc]
        self.failureResultOf(d, RuntimeError)
        self.assertTrue(h.idle(), "the ticket was freed")
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)


class PreloadTests(SynchronousTestCase):
    def test_preload_at_start(self) -> None:
        models = [dict(MODELS[0], preload=True), MODELS[1]]
        h = NodeHarness(models=models)
        h.node.startService()
        self.addCleanup(h.node.stopService)
        self.assertEqual(h.sup().state, STARTING)
        self.assertEqual(h.model_on(), "a")
        h.answer("alpha")
        self.assertEqual(h.sup().state, READY)
        self.assertTrue(h.idle(), "the preload holds no slot once loaded")

    def test_top_level_preload_on_a_device(self) -> None:
        h = NodeHarness(devices=2, preload=[{"model": "b", "device": "gpu:1"}, "a"])
        h.node.startService()
        self.addCleanup(h.node.stopService)
        h.answer("alpha", "b")
        self.assertEqual((h.sup("gpu:0").state, h.model_on("gpu:0")), (READY, "a"))
        self.assertEqual((h.sup("gpu:1").state, h.model_on("gpu:1")), (READY, "b"))
        self.assertTrue(h.idle())

    def test_no_preload_no_child(self) -> None:
        h = NodeHarness()
        h.node.startService()
        self.addCleanup(h.node.stopService)
        self.assertEqual(h.reactor.processes, [])

    def test_preload_failure_is_logged_not_raised(self) -> None:
        h = NodeHarness()
        d = h.node.preload(h.model("a"))
        h.child().exit(1)
        self.assertIsNone(self.successResultOf(d))
        self.assertTrue(h.idle())

    def test_preload_on_a_given_device(self) -> None:
        h = NodeHarness(devices=2)
        d = h.node.preload(h.model("a"), device="gpu:1")
        h.answer("alpha")
        self.assertEqual(self.successResultOf(d), "gpu:1")
        self.assertEqual(h.sup("gpu:1").state, READY)
        self.assertEqual(h.sup("gpu:0").state, STOPPED)


class TwoDeviceTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.h = NodeHarness(devices=2)

    def test_models_spread_over_devices(self) -> None:
        h = self.h
        self.assertEqual(h.load("a"), "gpu:0")
        self.assertEqual(h.load("b"), "gpu:1")
        self.assertEqual(len(h.reactor.processes), 2)

    def test_busy_device_with_the_model_is_preferred_over_evicting_another(self) -> None:
        h = self.h
        h.load("b", device="gpu:1")
        first = h.node.acquire(h.model("a"))
        h.answer("alpha")
        lease = self.successResultOf(first)
        self.assertEqual(lease.device, "gpu:0")
        second = h.node.acquire(h.model("a"))
        self.assertNoResult(second)  # waits behind the request in flight
        self.assertEqual(len(h.book("gpu:0").queue), 1)
        self.assertEqual(h.sup("gpu:1").state, READY)
        self.assertEqual(h.model_on("gpu:1"), "b", "b is not evicted")
        self.assertEqual(h.signals.calls, [])
        self.assertEqual(len(h.reactor.processes), 2)
        lease.release()
        self.assertEqual(self.successResultOf(second).device, "gpu:0")

    def test_full_device_with_the_model_spills_to_another(self) -> None:
        h = self.h
        h.load("a", device="gpu:0")
        first = h.node.acquire(h.model("a"))
        h.node.acquire(h.model("a"))
        self.assertEqual((len(h.book("gpu:0").running), len(h.book("gpu:0").queue)), (1, 1))
        spill = h.node.acquire(h.model("a"))
        self.assertEqual(h.book("gpu:1").pending, 1)
        self.assertEqual(h.sup("gpu:1").state, STARTING)
        h.answer("alpha")
        self.assertEqual(self.successResultOf(spill).device, "gpu:1")
        self.assertEqual(self.successResultOf(first).device, "gpu:0")
        # gpu:1 now holds a and has room: the next one queues there.
        h.node.acquire(h.model("a"))
        self.assertEqual(len(h.book("gpu:1").queue), 1)
        failure = self.failureResultOf(h.node.acquire(h.model("a")), errors.ApiError)
        self.assertEqual(failure.value.status, 429)

    def test_queue_full_only_when_every_device_is_full(self) -> None:
        h = self.h
        for _ in range(4):
            h.node.acquire(h.model("a"))
        self.assertEqual([h.book("gpu:0").pending, h.book("gpu:1").pending], [2, 2])
        failure = self.failureResultOf(h.node.acquire(h.model("b")), errors.ApiError)
        self.assertEqual(failure.value.code, "queue_full")
        self.assertIn("every device", failure.value.message)

    def test_parallel_slots_run_concurrently(self) -> None:
        h = NodeHarness(models=[{"model_id": "p", "server_args": {"parallel": 2}}],
                        max_pending_requests_per_device=3)
        ds = [h.node.acquire(h.model("p")) for _ in range(3)]
        h.answer("p")
        self.successResultOf(ds[0])
        self.successResultOf(ds[1])
        self.assertNoResult(ds[2])
        self.assertEqual(QUEUED, h.book().queue[0].state)

    def test_request_during_idle_unload_keeps_the_books_right(self) -> None:
        # a unloads after 10 s idle on gpu:0; b stays on gpu:1.  A request for a
        # that arrives while a's child is stopping reloads it on gpu:0; after
        # that the books must still say gpu:0 holds a, so the next request for
        # a waits there instead of evicting b.
        models = [dict(MODELS[0], idle_unload_s=10), MODELS[1]]
        h = NodeHarness(models=models, devices=2)
        h.node.startService()
        self.addCleanup(h.node.stopService)
        h.load("a", device="gpu:0")
        h.load("b", device="gpu:1")
        h.reactor.advance(10)
        self.assertEqual(h.sup("gpu:0").state, STOPPING)
        first = h.node.acquire(h.model("a"))
        h.reap("gpu:0")
        self.assertEqual(h.sup("gpu:0").state, STARTING)
        h.answer("alpha")
        self.assertEqual(self.successResultOf(first).device, "gpu:0")
        self.assertEqual(h.book("gpu:0").model, "a")
        second = h.node.acquire(h.model("a"))
        self.assertNoResult(second)
        self.assertEqual(len(h.book("gpu:0").queue), 1)
        self.assertEqual(h.model_on("gpu:1"), "b")
        self.assertEqual(h.sup("gpu:1").state, READY)


#: The served names the fake probe answers for, per model id.
SERVED = {"a": "alpha", "b": "b", "e": "emb"}


class BackOffTests(SynchronousTestCase):
    """Issue 31: a back-off belongs to the (model, device) that failed, and
    only to the failures in a row since that model last worked there.  The
    children here are stubborn: the first SIGTERM of a stop is ignored, the
    second ends them with status 1 ("Received second interrupt")."""

    def setUp(self) -> None:
        self.h = NodeHarness(signals=StubbornSignals, max_pending_requests_per_device=16)

    def request(self, model_id: str, device: Optional[str] = None) -> List[Any]:
        results: List[Any] = []
        self.h.node.acquire(self.h.model(model_id), device=device).addBoth(results.append)
        return results

    def wait(self, results: List[Any], bound: float = 5.0) -> None:
        """Advance the clock until ``results`` has an answer, at most ``bound`` s."""
        waited = 0.0
        while not results and waited < bound:
            self.h.reactor.advance(0.25)
            waited += 0.25

    def serve(self, model_id: str, device: Optional[str] = None) -> Lease:
        """A request for the model is served (its child loads if need be)."""
        self.h.probe.ready = {SERVED[model_id]}
        results = self.request(model_id, device)
        self.wait(results)
        answer = results[0] if results else "no answer"
        if not isinstance(answer, Lease):
            self.fail(f"a request for {model_id} was not served: {answer}")
        answer.release()
        return answer

    def kill_load(self, model_id: str) -> errors.ApiError:
        """A request for the model switches to it, and its load is SIGKILLed from outside."""
        h = self.h
        h.probe.ready = set()
        results = self.request(model_id)
        self.wait(results, bound=1.0)  # the stubborn stop of the child before it
        self.assertEqual((h.sup().state, h.model_on()), (STARTING, model_id), results)
        h.child().exit(signal=signal.SIGKILL)
        self.assertTrue(results, "the killed load is answered at once")
        failure = results[0]
        self.assertIsInstance(failure.value, errors.ApiError)
        self.assertIn("killed by SIGKILL while loading", failure.value.message)
        return failure.value

    def test_one_killed_load_after_a_history_of_kills_loads_and_stubborn_stops_refuses_nothing(self) -> None:
        # The chaos test in small: every model's load is killed from
        # outside now and then, between loads that work, and every switch stops
        # a child that exits 1 at its second SIGTERM.  Before the fix the kills
        # added up (a load that worked ended nothing), so soon one kill meant
        # up to 60 s of refusals -- and with each model backing off in turn,
        # the device refused every model.
        h = self.h
        for _ in range(8):
            for model_id in ("b", "a", "e"):
                self.kill_load(model_id)  # retried at once: the first failure since it worked
                self.serve(model_id)
        # The moment of the issue: a switch away from a (its child exits 1),
        # then b's load is killed.  Nothing is refused: b is tried again at
        # once, and the other models are served.
        self.serve("a")
        self.kill_load("b")
        self.assertEqual(h.sup().backoffs(), [], "a first failure in a row is retried at once")
        for model_id in ("b", "a", "e", "b"):
            self.serve(model_id)
        self.assertEqual(h.sup().restarts, 0)
        self.assertGreater(sum(1 for p in h.reactor.processes if p.signals.count(signal.SIGTERM) == 2), 24,
                           "the stops were stubborn ones")

    def test_a_model_backing_off_is_refused_with_retry_after_and_the_others_are_served(self) -> None:
        h = self.h
        self.serve("a")
        h.probe.ready = set()
        results = self.request("b")
        self.wait(results, bound=1.0)
        h.child().exit(1)  # b's load ends on its own: 15 s of back-off
        failed_at = h.reactor.seconds()
        self.assertEqual(results[0].value.retry_after, 15)
        self.serve("a")
        self.serve("e")  # the device switches between the others as usual
        h.reactor.advance(failed_at + 5 - h.reactor.seconds())
        refused = self.request("b")
        self.assertEqual(refused[0].value.code, "model_load_failed")
        self.assertEqual(refused[0].value.retry_after, 10, "when b will be tried again")
        self.assertIn("next attempt in 10s", refused[0].value.message)
        self.assertIn("exited with status 1 while loading", refused[0].value.message, "b's own error")
        # Asking for b did not stop e's child, nor book a switch.
        self.assertEqual((h.sup().state, h.model_on()), (READY, "e"))
        self.assertEqual(h.book().model, "e")
        self.assertNotIn(signal.SIGTERM, h.child().signals)
        h.reactor.advance(10)
        self.serve("b")  # tried again once the back-off is over

    def test_requests_queued_for_a_model_whose_load_fails_leave_no_booking_behind(self) -> None:
        h = self.h
        h.probe.ready = set()
        first = self.request("b")
        queued = [self.request("b") for _ in range(3)]
        h.child().exit(1)
        self.assertEqual([r[0].value.code for r in [first] + queued], ["model_load_failed"] * 4)
        self.assertEqual([r[0].value.retry_after for r in queued], [15] * 3)
        self.assertIsNone(h.book().model, "the books do not say the device holds b")
        self.serve("e")

    def test_a_model_backing_off_on_one_device_is_served_by_another(self) -> None:
        h = NodeHarness(devices=2, signals=StubbornSignals)
        self.h = h
        h.probe.ready = set()
        results = self.request("b")
        self.assertEqual(h.model_on("gpu:0"), "b")
        h.child("gpu:0").exit(1)
        self.assertEqual(results[0].value.retry_after, 15)
        self.assertEqual(self.serve("b").device, "gpu:1", "gpu:1 has not failed b")
        # Pinned to the device it backs off on: refused there, with its Retry-After.
        self.assertEqual(self.request("b", device="gpu:0")[0].value.retry_after, 15)
        self.assertEqual(self.serve("a").device, "gpu:0", "gpu:0 serves other models")

    def test_a_stop_the_agent_asked_for_never_counts_whatever_its_exit_status(self) -> None:
        # An unload and a reload that changes the command: the children exit 1.
        h = self.h
        self.serve("b")
        unloaded: List[Any] = []
        h.node.unload("gpu:0").addBoth(unloaded.append)
        h.reactor.advance(0.25)
        self.assertEqual(unloaded, [None])
        self.serve("b")
        config = make_config([dict(MODELS[0]), dict(MODELS[1], ctx_size=512), dict(MODELS[2])],
                             llama_server_startup_timeout_s=10.0, llama_server_probe_interval_s=0.5,
                             llama_server_stop_timeout_s=5.0, max_pending_requests_per_device=16)
        h.node.reconfigure(config)
        h.config = config
        self.serve("b")  # a new child for the new command, after the old one exited 1
        self.assertEqual(h.sup().last_error, None)
        self.serve("a")  # and a switch away from it: exit 1 again
        h.probe.ready = set()
        results = self.request("b")
        self.wait(results, bound=1.0)
        h.child().exit(1)
        self.assertEqual(results[0].value.retry_after, 15, "b's first failure: none of those stops counted")

    def test_the_inventory_says_which_model_backs_off_where_until_when_and_why(self) -> None:
        h = self.h
        h.reactor.advance(100)
        h.probe.ready = set()
        results = self.request("b")
        h.child().exit(1)
        self.assertTrue(results)
        h.reactor.advance(4)
        device = h.node.inventory()["devices"][0]
        self.assertEqual(device["backoff"], [{
            "model": "b", "until": 115.0, "retry_after_s": 11, "failures": 1, "history": "load",
            "schedule": "load", "step": 1, "code": "model_load_failed",
            "message": "llama-server for model 'b' exited with status 1 while loading on gpu:0"}])
        h.reactor.advance(11)
        self.assertEqual(h.node.inventory()["devices"][0]["backoff"], [])
