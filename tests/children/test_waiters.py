"""Who waits on a device, and when they are told (rolemesh.children.waiters)."""

from __future__ import annotations

from typing import Any, List

from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base import errors
from rolemesh.base.events import Outbox
from rolemesh.children.supervisor import DeviceSupervisor
from rolemesh.children.waiters import Waiters


def superseded(model_id: str) -> errors.ApiError:
    return errors.model_load_failed(f"{model_id} superseded")


class WaitersTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.outbox = Outbox()
        self.waiters = Waiters(self.outbox)

    def test_fired_once_the_transition_is_complete(self) -> None:
        d = self.waiters.for_load("a")
        self.outbox.enter()
        self.waiters.ready("a", "endpoint", superseded)
        self.assertNoResult(d)
        self.outbox.leave()
        self.assertEqual(self.successResultOf(d), "endpoint")
        self.assertEqual(self.waiters.models, [])

    def test_ready_tells_the_other_models_waiters_they_were_superseded(self) -> None:
        a, b = self.waiters.for_load("a"), self.waiters.for_load("b")
        self.waiters.ready("b", "endpoint", superseded)
        self.assertEqual(self.failureResultOf(a, errors.ApiError).value.message, "a superseded")
        self.assertEqual(self.successResultOf(b), "endpoint")

    def test_fail_keeps_the_waiters_of_the_model_asked_to_keep(self) -> None:
        a, b1, b2 = self.waiters.for_load("a"), self.waiters.for_load("b"), self.waiters.for_load("b")
        self.waiters.fail(errors.model_load_failed("switched"), keep="b")
        self.failureResultOf(a, errors.ApiError)
        self.assertNoResult(b1)
        self.assertNoResult(b2)
        self.assertEqual(self.waiters.models, ["b", "b"])
        self.waiters.fail(errors.model_load_failed("stopped"))
        self.assertEqual(self.failureResultOf(b1, errors.ApiError).value.message, "stopped")
        self.failureResultOf(b2, errors.ApiError)
        self.assertEqual(self.waiters.models, [])

    def test_a_cancelled_waiter_leaves_and_is_never_fired(self) -> None:
        a, other = self.waiters.for_load("a"), self.waiters.for_load("a")
        a.cancel()
        self.failureResultOf(a)  # CancelledError
        self.assertEqual(self.waiters.models, ["a"])
        self.waiters.ready("a", "endpoint", superseded)
        self.assertEqual(self.successResultOf(other), "endpoint")

    def test_cancelled_while_its_result_waits_in_the_outbox(self) -> None:
        d = self.waiters.for_load("a")
        results: List[Any] = []
        d.addBoth(results.append)
        self.outbox.enter()
        self.waiters.ready("a", "endpoint", superseded)
        d.cancel()
        self.outbox.leave()
        self.assertEqual(len(results), 1, "cancelled once, not fired after (nor an AlreadyCalledError logged)")

    def test_stop_waiters_fire_with_none_when_reaped(self) -> None:
        one, two = self.waiters.for_stop(), self.waiters.for_stop()
        self.assertEqual(self.waiters.stopping, 2)
        self.waiters.stopped()
        self.assertEqual((self.successResultOf(one), self.successResultOf(two), self.waiters.stopping),
                         (None, None, 0))

    def test_the_supervisor_has_no_settle_of_its_own(self) -> None:
        """``_settle`` means "pump the lanes" in the scheduler; firing a
        waiter is Waiters._fire_after_transition."""
        self.assertFalse(hasattr(DeviceSupervisor, "_settle"))
        self.assertTrue(hasattr(Waiters, "_fire_after_transition"))
