"""How a child's failures are told (rolemesh.children.failures): pure accounts,
messages and the back-off's log line."""

from __future__ import annotations

import signal

from twisted.logger import LogLevel, capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base import errors
from rolemesh.children import failures as child_failures
from rolemesh.children.diagnosis import Exit
from rolemesh.children.restart_policy import BackOff, History, Schedule
from rolemesh.config.file import ModelConfig

MODEL = ModelConfig(model_id="qwen", path="/models/qwen-7b.gguf")
ERROR = "0.00.010.100 E llama_model_load: error loading model: tensor 'x' missing in /models/qwen-7b.gguf"


def backoff(delay: float, failures: int = 2) -> BackOff:
    return BackOff("qwen", failures, History.LOAD, Schedule.LOAD, delay, 100.0, 100.0 + delay, "model_load_failed",
                   "it broke")


class AccountTests(SynchronousTestCase):
    def test_a_load_that_ended_on_its_own_follows_the_load_schedule(self) -> None:
        account = child_failures.load_ended(MODEL, "gpu:0", Exit(code=1), [ERROR])
        self.assertEqual((account.code, account.history, account.schedule, account.events),
                         ("model_load_failed", History.LOAD, Schedule.LOAD, ("load_failure",)))
        self.assertIn("exited with status 1 while loading on gpu:0: tensor 'x' missing in qwen", account.message)

    def test_a_load_killed_from_outside_gets_its_first_retry_free(self) -> None:
        account = child_failures.load_ended(MODEL, "gpu:0", Exit(signal=signal.SIGKILL), [])
        self.assertEqual(account.schedule, Schedule.RESTART)

    def test_a_crash_counts_as_a_crash_and_a_restart_with_its_code(self) -> None:
        account = child_failures.crash(MODEL, Exit(signal=signal.SIGILL), [ERROR])
        self.assertEqual((account.code, account.history, account.schedule, account.events),
                         ("illegal_instruction", History.CRASH, Schedule.RESTART, ("crash", "restart")))
        self.assertTrue(account.message.startswith("llama-server for 'qwen' killed by SIGILL unexpectedly ("))
        self.assertEqual(child_failures.crash(MODEL, Exit(code=3), []).code, "child_crashed")

    def test_a_timeout_says_what_and_the_decisive_line(self) -> None:
        account = child_failures.timed_out(MODEL, "did not become ready within 10s", "gpu:0", [ERROR])
        self.assertEqual(account.message, "model 'qwen' did not become ready within 10s on gpu:0; "
                                          "last error: tensor 'x' missing in qwen")
        self.assertEqual((account.code, account.events), ("model_load_timeout", ("load_timeout",)))
        self.assertNotIn("last error", child_failures.timed_out(MODEL, "stalled", "gpu:0", []).message)

    def test_a_spawn_that_failed(self) -> None:
        account = child_failures.spawn_failed("gpu:0", OSError("no such file"))
        self.assertEqual((account.code, account.message, account.schedule),
                         ("model_load_failed", "cannot start llama-server on gpu:0: no such file", Schedule.RESTART))


class MessageTests(SynchronousTestCase):
    def test_no_refusal_without_a_back_off(self) -> None:
        self.assertIsNone(child_failures.refusal("qwen", "gpu:0", None, 100.0))

    def test_a_refusal_says_when_and_repeats_the_last_error(self) -> None:
        refusal = child_failures.refusal("qwen", "gpu:0", backoff(10.0), 102.5)
        assert refusal is not None
        self.assertEqual((refusal.code, refusal.retry_after), ("model_load_failed", 8))
        self.assertEqual(refusal.message, "model 'qwen' failed 2 times in a row on gpu:0; next attempt in 8s. "
                                          "Last error: it broke")

    def test_superseded_unhealthy_and_inference(self) -> None:
        self.assertIsInstance(child_failures.superseded("a", "gpu:0"), errors.ApiError)
        self.assertEqual(child_failures.superseded("a", "gpu:0").message, "model 'a' was superseded on gpu:0")
        self.assertEqual(child_failures.unhealthy("a", "an upstream timeout", "gpu:0"),
                         "llama-server for 'a' failed a health probe after an upstream timeout on gpu:0; restarted")
        self.assertIn("failed 3 inference probes in a row on gpu:0",
                      child_failures.inference_probe_failed("a", "gpu:0"))


class LogTests(SynchronousTestCase):
    def test_a_back_off_warns_and_a_free_retry_informs_in_the_supervisors_namespace(self) -> None:
        with capturedLogs() as events:
            child_failures.log_backoff(backoff(4.0), "gpu:0")
            child_failures.log_backoff(backoff(0.0, failures=1), "gpu:0")
        self.assertEqual([e["log_level"] for e in events], [LogLevel.warn, LogLevel.info])
        self.assertEqual({e["log_namespace"] for e in events}, {"rolemesh.supervisor"})
        self.assertIn("qwen backs off on gpu:0 for 4s, loads refused until then: 2nd failed load in a row",
                      formatEvent(events[0]))
        self.assertIn("qwen will be loaded again on gpu:0 at the next request", formatEvent(events[1]))
