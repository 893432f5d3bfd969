"""Unit tests of rolemesh.children.restart_policy: pure decisions and the per-model
failure memory, no clock (times are passed in)."""

from __future__ import annotations

import signal

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base.backoff import load_retry_delay, restart_delay
from rolemesh.children import diagnosis
from rolemesh.children.restart_policy import (
    BIND_RETRIES,
    INFERENCE_PROBE_FAILURES,
    STABLE_AFTER_S,
    History,
    RestartPolicy,
    Schedule,
    bind_failed,
    killed_from_outside,
    retry_after_seconds,
    schedule_delay,
    schedule_steps,
    schedule_text,
)
from tests.fixtures.fakes import make_config


class PureTests(SynchronousTestCase):
    @given(st.floats(0, 1e6))
    def test_retry_after_is_whole_seconds_at_least_one_never_early(self, delay: float) -> None:
        seconds = retry_after_seconds(delay)
        self.assertGreaterEqual(seconds, 1)
        self.assertGreaterEqual(seconds, delay - 0.001)  # rounded up, to the millisecond
        self.assertLess(seconds, delay + 1.001)

    def test_killed_from_outside(self) -> None:
        for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            self.assertTrue(killed_from_outside(diagnosis.Exit(sig, None)))
        self.assertFalse(killed_from_outside(diagnosis.Exit(signal.SIGSEGV, None)))
        self.assertFalse(killed_from_outside(diagnosis.Exit(None, 1)))

    def test_bind_failed(self) -> None:
        self.assertTrue(bind_failed(["main: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 20000"]))
        self.assertTrue(bind_failed(["error: Address already in use"]))
        self.assertFalse(bind_failed(["llama_model_load: error loading model"]))


class RestartPolicyTests(SynchronousTestCase):
    @given(st.integers(1, 40), st.sampled_from(list(History)), st.sampled_from(list(Schedule)))
    def test_failures_in_a_row_follow_the_schedule_and_set_the_next_try(
            self, count: int, history: History, schedule: Schedule) -> None:
        policy = RestartPolicy()
        now = 100.0
        for n in range(1, count + 1):
            backoff = policy.record_failure("a", now, history, schedule, ready_at=now - 1.0)
            expected = load_retry_delay(n) if schedule == Schedule.LOAD else restart_delay(n)
            self.assertEqual((backoff.delay, backoff.failures, backoff.until), (expected, n, now + expected))
            self.assertEqual(policy.backing_off("a", now), expected)
            self.assertEqual(backoff.step, min(n, len(schedule_steps(schedule))))
        self.assertEqual(policy.failures("a"), count)
        self.assertLessEqual(policy.backing_off("b", now), 0, "other models are not held back")
        self.assertIsNone(policy.backoff("b", now))

    def test_a_child_that_was_stable_starts_a_fresh_count_of_crashes(self) -> None:
        policy = RestartPolicy()
        policy.record_failure("a", 10.0, History.CRASH, Schedule.RESTART, ready_at=9.0)
        policy.record_failure("a", 20.0, History.CRASH, Schedule.RESTART, ready_at=19.0)
        self.assertEqual(policy.failures("a"), 2)
        backoff = policy.record_failure("a", 100.0, History.CRASH, Schedule.RESTART, ready_at=100.0 - STABLE_AFTER_S)
        self.assertEqual((backoff.delay, backoff.failures), (0.0, 1))
        policy.record_failure("a", 110.0, History.CRASH, Schedule.RESTART, ready_at=109.0)
        policy.stopped("a", 200.0, ready_at=200.0 - STABLE_AFTER_S, healthy=False)
        self.assertEqual(policy.record_failure("a", 300.0, History.CRASH, Schedule.RESTART, ready_at=299.0).failures, 1)

    def test_a_load_that_becomes_ready_ends_the_run_of_failed_loads(self) -> None:
        policy = RestartPolicy()
        for now in (10.0, 20.0, 30.0):
            policy.record_failure("a", now, History.LOAD, Schedule.RESTART)
        self.assertEqual(policy.backoff("a", 30.0).delay, restart_delay(3))  # type: ignore[union-attr]
        policy.loaded("a")
        self.assertIsNone(policy.backoff("a", 30.0), "a load that worked is not backing off")
        backoff = policy.record_failure("a", 40.0, History.LOAD, Schedule.RESTART)
        self.assertEqual((backoff.failures, backoff.delay), (1, 0.0), "first in a row again: retried at once")

    def test_a_load_that_becomes_ready_does_not_end_a_run_of_crashes(self) -> None:
        # A child that loads and then crashes under every request still backs off.
        policy = RestartPolicy()
        for n in range(1, 4):
            policy.loaded("a")
            self.assertEqual(policy.record_failure("a", 10.0 * n, History.CRASH, Schedule.RESTART,
                                                   ready_at=10.0 * n - 1).failures, n)

    def test_a_stop_of_a_child_that_served_ends_the_run_of_crashes_unless_it_was_replaced(self) -> None:
        policy = RestartPolicy()
        policy.record_failure("a", 10.0, History.CRASH, Schedule.RESTART, ready_at=9.0)
        policy.stopped("a", 20.0, ready_at=19.0, healthy=False)  # replaced after failing its probes
        self.assertEqual(policy.record_failure("a", 30.0, History.CRASH, Schedule.RESTART, ready_at=29.0).failures, 2)
        policy.stopped("a", 40.0, ready_at=None)  # stopped while loading: says nothing
        self.assertEqual(policy.record_failure("a", 50.0, History.CRASH, Schedule.RESTART, ready_at=49.0).failures, 3)
        policy.stopped("a", 60.0, ready_at=59.0)  # a switch away from a child that served
        self.assertEqual(policy.record_failure("a", 70.0, History.CRASH, Schedule.RESTART, ready_at=69.0).failures, 1)

    @given(st.lists(st.sampled_from(["loaded", "killed", "failed", "crash", "switched", "replaced"]), max_size=60))
    def test_a_failure_counts_only_the_failures_since_its_run_last_ended(self, steps) -> None:
        # Any history: a failed load counts the failed loads since the model
        # last loaded; a crash counts the crashes since a child of it last
        # served until the agent stopped it.  Nothing else counts.
        policy = RestartPolicy()
        loads = crashes = 0
        for n, step in enumerate(steps):
            now = 10.0 * n
            if step == "loaded":
                policy.loaded("a")
                loads = 0
            elif step in ("killed", "failed"):
                schedule = Schedule.RESTART if step == "killed" else Schedule.LOAD
                loads += 1
                backoff = policy.record_failure("a", now, History.LOAD, schedule)
                self.assertEqual((backoff.failures, backoff.delay), (loads, schedule_delay(schedule, loads)))
            elif step == "crash":
                crashes += 1
                self.assertEqual(policy.record_failure("a", now, History.CRASH, Schedule.RESTART,
                                                       ready_at=now - 1).failures, crashes)
            else:
                policy.stopped("a", now, ready_at=now - 1, healthy=step == "switched")
                crashes = 0 if step == "switched" else crashes
            self.assertIsNone(policy.backoff("b", now), "another model is never held back")

    def test_the_schedules_as_the_docs_give_them(self) -> None:
        self.assertEqual(schedule_steps(Schedule.RESTART), (0, 1, 2, 4, 8, 16, 32, 60))
        self.assertEqual(schedule_steps(Schedule.LOAD), (15, 300, 600))
        self.assertEqual(schedule_text(Schedule.LOAD), "15 s, 300 s, 600 s (then the last, each time)")

    def test_the_record_says_why_and_until_when(self) -> None:
        policy = RestartPolicy()
        policy.record_failure("a", 0.0, History.LOAD, Schedule.RESTART)
        backoff = policy.record_failure("a", 5.0, History.LOAD, Schedule.RESTART, code="model_load_failed",
                                        message="killed by SIGKILL while loading")
        self.assertEqual(backoff.why(), "2nd failed load in a row; step 2 of the restart schedule "
                                        "(0 s, 1 s, 2 s, 4 s, 8 s, 16 s, 32 s, 60 s (then the last, each time))")
        self.assertEqual(backoff.to_json(5.5), {
            "model": "a", "until": 6.0, "retry_after_s": 1, "failures": 2, "history": "load",
            "schedule": "restart", "step": 2, "code": "model_load_failed",
            "message": "killed by SIGKILL while loading"})
        self.assertEqual(policy.active(5.5), [backoff])
        self.assertEqual(policy.active(6.0), [], "over at its end")

    def test_a_port_collision_is_retried_a_bounded_number_of_times(self) -> None:
        policy = RestartPolicy()
        lines = ["couldn't bind HTTP server socket"]
        self.assertFalse(policy.retry_bind(["other trouble"]))
        self.assertEqual([policy.retry_bind(lines) for _ in range(BIND_RETRIES + 1)],
                         [True] * BIND_RETRIES + [False])

    def test_safe_mode_is_entered_once_per_model_and_not_for_a_model_that_asks_for_it(self) -> None:
        config = make_config([{"model_id": "a"}, {"model_id": "b", "server_args": {"no-repack": True}}])
        policy = RestartPolicy()
        warning = policy.enter_safe_mode(config.model("a"), "cpu:0")
        assert warning is not None
        self.assertIn("--no-repack", warning)
        self.assertEqual(policy.safe_mode, {"a": warning})
        self.assertIsNone(policy.enter_safe_mode(config.model("a"), "cpu:0"))
        self.assertIsNone(policy.enter_safe_mode(config.model("b"), "cpu:0"))

    def test_inference_failures_replace_the_child_at_the_limit(self) -> None:
        policy = RestartPolicy()
        self.assertEqual([policy.inference_failed() for _ in range(INFERENCE_PROBE_FAILURES)],
                         [False] * (INFERENCE_PROBE_FAILURES - 1) + [True])
