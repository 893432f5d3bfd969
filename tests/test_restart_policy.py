"""Unit tests of rolemesh.restart_policy: pure decisions and the per-model
failure memory, no clock (times are passed in)."""

from __future__ import annotations

import signal

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from rolemesh import diagnosis
from rolemesh.backoff import load_retry_delay, restart_delay
from rolemesh.restart_policy import (
    BIND_RETRIES,
    INFERENCE_PROBE_FAILURES,
    STABLE_AFTER_S,
    RestartPolicy,
    bind_failed,
    killed_from_outside,
    retry_after_seconds,
)
from tests.fakes import make_config


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
    @given(st.integers(1, 40), st.booleans())
    def test_failures_in_a_row_follow_the_backoff_and_set_the_next_try(self, count: int, load: bool) -> None:
        policy = RestartPolicy()
        now = 100.0
        for n in range(1, count + 1):
            delay = policy.record_failure("a", now, ready_at=now - 1.0, load=load)
            self.assertEqual(delay, load_retry_delay(n) if load else restart_delay(n))
            self.assertEqual(policy.backing_off("a", now), delay)
        self.assertEqual(policy.failures, {"a": count})
        self.assertLessEqual(policy.backing_off("b", now), 0, "other models are not held back")

    def test_a_child_that_was_stable_starts_a_fresh_count(self) -> None:
        policy = RestartPolicy()
        policy.record_failure("a", 10.0, None, load=False)
        policy.record_failure("a", 20.0, None, load=False)
        self.assertEqual(policy.failures["a"], 2)
        self.assertEqual(policy.record_failure("a", 100.0, ready_at=100.0 - STABLE_AFTER_S, load=False), 0.0)
        self.assertEqual(policy.failures["a"], 1)
        policy.stopped("a", 200.0, ready_at=200.0 - STABLE_AFTER_S)
        self.assertEqual(policy.failures["a"], 0)

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
