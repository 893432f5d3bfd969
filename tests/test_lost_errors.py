"""Errors raised inside callbacks reach the log instead of vanishing
(``addCallbacks(got, failed)`` does not hand an error in ``got`` to
``failed``; ``addBoth(lambda _: ...)`` drops a Failure)."""

from __future__ import annotations

from typing import Any, List

from twisted.internet import defer
from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.fleet.dispatcher import REGISTERED
from tests.fixtures.service_harness import ServiceHarness
from tests.fleet.test_dispatcher import Harness


def text_of(events: List[dict]) -> str:
    return "\n".join(formatEvent(e) for e in events)


class DispatcherLoopTests(SynchronousTestCase):
    def test_an_error_after_a_step_is_logged_and_the_loop_goes_on(self) -> None:
        h = Harness(slow_retry=30.0)
        real_step = h.client._step

        async def broken_step() -> Any:
            h.client._step = real_step  # type: ignore[method-assign]
            return None  # not a delay: done() fails scheduling the next step

        h.client._step = broken_step  # type: ignore[method-assign]
        with capturedLogs() as events:
            h.start()
        self.assertIn("dispatcher client loop failed; retrying in 30s", text_of(events))
        self.assertEqual(len(self.flushLoggedErrors(TypeError)), 1)
        h.advance(30)
        self.assertEqual(h.client.state, REGISTERED, "the loop went on")
        self.assertEqual(h.stop(), [None])


class ShutdownStepTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.h = ServiceHarness({"models": [{"model_id": "tiny", "preload": True}]})
        self.addCleanup(self.h.cleanup)
        self.h.start()
        self.h.answer("tiny")
        [self.child] = self.h.live_children()

    def stopped(self) -> str:
        """Stop the agent (its child exits); the stop completes; what it logged."""
        done: List[Any] = []
        with capturedLogs() as events:
            self.h.stop().addBoth(done.append)
            self.child.exit(0)
            self.h.reactor.advance(0)
        self.assertEqual(done, [None])
        return text_of(events)

    def test_a_failing_step_is_logged_and_the_children_still_stop(self) -> None:
        listener = self.h.root.listener
        assert listener is not None

        def stop_listener() -> None:
            raise RuntimeError("listener would not close")

        listener.stopService = stop_listener  # type: ignore[method-assign]
        self.assertIn("shutdown: closing the listener failed; going on", self.stopped())
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertFalse(self.h.root.node.running, "the children were stopped all the same")

    def test_a_failing_drain_is_logged_and_the_stop_goes_on(self) -> None:
        self.h.root.node.drain = lambda grace: defer.fail(ValueError("drain broke"))  # type: ignore[method-assign]
        self.assertIn("shutdown: the drain failed; stopping anyway", self.stopped())
        self.assertEqual(len(self.flushLoggedErrors(ValueError)), 1)

    def test_a_failing_report_at_the_deadline_still_exits(self) -> None:
        exits: List[int] = []
        self.h.root.hard_exit = exits.append
        self.h.stop()  # the child never ends
        self.h.root.node.supervisors = None  # type: ignore[assignment]  # the report will fail
        self.assertRaises(AttributeError, self.h.reactor.advance, 600)  # a real reactor logs it
        self.assertEqual(exits, [1])
        self.child.exit(0)
