"""Unit tests of the device supervisor: fake processes, a Clock, no real I/O."""

from __future__ import annotations

import signal

import attr
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet import defer
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base import errors
from rolemesh.base.backoff import load_retry_delay, restart_delay
from rolemesh.children.probes import inference_probe
from rolemesh.children.process import wrap_argv
from rolemesh.children.state import FAILED, READY, STARTING, STOPPED, STOPPING
from rolemesh.children.supervisor import DeviceSupervisor
from tests.fixtures.fakes import FakeBackend, FakeProbe, GroupSignals, ProcessReactor, make_config


class Harness:
    def __init__(self, reactor=None, **top):
        self.config = make_config(
            [{"model_id": "a", "roles": ["chat"]}, {"model_id": "b", "alias": "bee"}],
            **{"llama_server_startup_timeout_s": 10.0, "llama_server_probe_interval_s": 0.5,
               "llama_server_stop_timeout_s": 5.0, **top},
        )
        self.reactor = reactor or ProcessReactor()
        self.probe = FakeProbe()
        self.signals = GroupSignals(self.reactor)
        self.backend = FakeBackend()
        self.ports = iter(range(20000, 21000))
        self.transitions = []
        self.sup = DeviceSupervisor(
            self.backend.refs[0],
            self.backend,
            self.config,
            "/opt/llama/llama-server",
            reactor=self.reactor,
            probe=self.probe,
            pick_port=lambda: next(self.ports),
            signal_group=self.signals,
            environ={"PATH": "/usr/bin", "HOME": "/root"},
        )
        #: The cgroup's OOM-kill count the supervisor reads (no real /proc, /sys).
        self.oom_kills = [0]
        self.sup.oom_counter = lambda pid: lambda: self.oom_kills[0]
        self.sup.subscribe(lambda s: self.transitions.append(s.state))
        self.a = self.config.model("a")
        self.b = self.config.model("b")

    def make_ready(self, model_id):
        self.probe.ready = {model_id if model_id != "b" else "bee"}
        self.reactor.advance(0.5)


class StateMachineTests(SynchronousTestCase):
    def setUp(self):
        self.h = Harness()

    def test_cold_start_to_ready(self):
        h = self.h
        d = h.sup.ensure(h.a)
        self.assertEqual(h.sup.state, STARTING)
        self.assertNoResult(d)
        self.assertEqual(len(h.reactor.processes), 1)
        h.reactor.advance(0.5)  # probe says not yet
        self.assertNoResult(d)
        h.make_ready("a")
        endpoint = self.successResultOf(d)
        self.assertEqual(h.sup.state, READY)
        self.assertEqual(endpoint.base_url, "http://127.0.0.1:20000")
        self.assertEqual(endpoint.pid, h.reactor.last.pid)
        self.assertEqual(h.transitions, [STARTING, READY])

    def test_argv_env_and_wrapper(self):
        h = self.h
        h.sup.ensure(h.a)
        process = h.reactor.last
        self.assertIn("--", process.argv)
        inner = process.argv[process.argv.index("--") + 1:]
        self.assertEqual(inner[:7], ["/opt/llama/llama-server", "--model", "/models/a.gguf", "--host",
                                     "127.0.0.1", "--port", "20000"])
        self.assertIn("--alias", inner)
        # Vertex AI's prediction mode on the child's own port: it serves /predict (rolemesh/config/vertex_ai.py).
        self.assertEqual(process.env, {"PATH": "/usr/bin", "HOME": "/root", "FAKE_VISIBLE_DEVICES": "0",
                                       "AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "20000",
                                       "AIP_PREDICT_ROUTE": "/predict"})

    def test_ready_again_is_immediate(self):
        h = self.h
        h.sup.ensure(h.a)
        h.make_ready("a")
        self.successResultOf(h.sup.ensure(h.a))
        self.assertEqual(len(h.reactor.processes), 1)

    def test_concurrent_callers_share_one_load(self):
        h = self.h
        ds = [h.sup.ensure(h.a) for _ in range(5)]
        self.assertEqual(len(h.reactor.processes), 1)
        h.make_ready("a")
        endpoints = {self.successResultOf(d) for d in ds}
        self.assertEqual(len(endpoints), 1)

    def test_output_hint_triggers_probe_at_once(self):
        h = self.h
        d = h.sup.ensure(h.a)
        h.probe.ready = {"a"}
        h.reactor.last.output("main: server is listening on http://127.0.0.1:20000 - starting the main loop\n")
        self.successResultOf(d)
        self.assertEqual(h.reactor.seconds(), 0)

    def test_startup_timeout_kills_and_fails_waiters(self):
        h = self.h
        d = h.sup.ensure(h.a)
        h.reactor.advance(10.0)
        failure = self.failureResultOf(d, errors.ApiError)
        self.assertEqual(failure.value.code, "model_load_timeout")
        self.assertEqual(failure.value.status, 503)
        self.assertIsNotNone(failure.value.retry_after)
        self.assertIn("within 10s", failure.value.message)
        self.assertEqual(h.signals.calls, [(h.reactor.last.pid, signal.SIGKILL)])
        self.assertEqual(h.sup.state, STOPPING)
        h.reactor.last.exit(signal=signal.SIGKILL)
        self.assertEqual(h.sup.state, FAILED)

    def test_exit_while_starting_fails_at_once_with_log_tail(self):
        h = self.h
        d = h.sup.ensure(h.a)
        h.reactor.last.output("llama_model_load: error loading model: /models/a.gguf is not a gguf file\n")
        h.reactor.last.output("main: failed to load model\n")
        h.reactor.last.exit(1)
        failure = self.failureResultOf(d, errors.ApiError)
        self.assertEqual(failure.value.code, "model_load_failed")
        self.assertIn("a is not a gguf file", failure.value.message, "the decisive line, path shown as the id")
        self.assertIn("exited with status 1", failure.value.message)
        self.assertEqual(h.sup.last_error_code, "model_load_failed")
        self.assertNotIn("/models/a.gguf", failure.value.message, "paths are shown as the model id")
        self.assertEqual(h.sup.state, FAILED)
        self.assertEqual(h.reactor.seconds(), 0)

    def test_failed_load_backs_off_at_once_and_spawns_nothing_meanwhile(self):
        h = self.h
        d = h.sup.ensure(h.a)
        h.reactor.last.exit(1)
        self.failureResultOf(d, errors.ApiError)
        # A load that ended on its own repeats until someone acts: no free
        # retry.  Meanwhile requests are refused fast, with Retry-After.
        for _ in range(3):
            failure = self.failureResultOf(h.sup.ensure(h.a), errors.ApiError)
            self.assertEqual((failure.value.status, failure.value.code), (503, "model_load_failed"))
            self.assertEqual(failure.value.retry_after, 15)
            self.assertIn("next attempt in 15s", failure.value.message)
        self.assertEqual(len(h.reactor.processes), 1)
        h.reactor.advance(14)
        self.assertEqual(self.failureResultOf(h.sup.ensure(h.a), errors.ApiError).value.retry_after, 1)
        # Another model is not held back by a's failures.
        h.sup.ensure(h.b)
        self.assertEqual(len(h.reactor.processes), 2)

    def test_a_reload_that_changes_the_command_starts_the_model_clean(self):
        """Back-off, failure runs and safe mode belong to the command that failed (issue 39, item 1)."""
        h = self.h
        for wait in (load_retry_delay(1), 0):  # two failed loads in a row: 300 s of back-off
            d = h.sup.ensure(h.a)
            h.reactor.last.exit(1)
            self.failureResultOf(d)
            h.reactor.advance(wait)
        self.assertEqual(self.failureResultOf(h.sup.ensure(h.a)).value.retry_after, 300)
        # Roles are no part of the command: the back-off stays.
        renamed = attr.evolve(h.a, roles=("other",))
        self.assertEqual(self.failureResultOf(h.sup.ensure(renamed)).value.retry_after, 300)
        # The operator points the model at a good file and reloads: it loads at once.
        fixed = attr.evolve(h.a, path="/models/fixed.gguf")
        d = h.sup.ensure(fixed)
        self.assertEqual(len(h.reactor.processes), 3)
        self.assertIn("/models/fixed.gguf", h.reactor.last.argv)
        self.assertEqual(h.sup.backoffs(), [])
        # ... and a failure of it is its own first one: 15 s, not 600.
        h.reactor.last.exit(1)
        self.assertEqual(self.failureResultOf(d).value.retry_after, 15)

    def test_a_failure_of_a_replaced_command_in_flight_refuses_nobody_for_the_new_one(self):
        """A load still running for the command a reload replaced ends badly: the new command is not held back."""
        h = self.h
        old = h.sup.ensure(h.a)
        h.reactor.advance(3)
        fixed = attr.evolve(h.a, path="/models/fixed.gguf")
        self.assertIsNone(h.sup.refusal(fixed))  # asked while the old load runs
        h.reactor.last.exit(1)
        self.failureResultOf(old)
        self.assertIsNone(h.sup.refusal(fixed))
        h.sup.ensure(fixed)
        self.assertIn("/models/fixed.gguf", h.reactor.last.argv)

    def test_safe_mode_belongs_to_the_command_too(self):
        h = self.h
        d = h.sup.ensure(h.a)
        h.reactor.last.exit(signal=signal.SIGILL)
        self.assertIn("--no-repack", h.reactor.last.argv)  # retried once in safe mode ...
        h.reactor.last.exit(1)
        self.failureResultOf(d)
        self.assertEqual(len(h.sup.warnings), 1)
        h.sup.ensure(attr.evolve(h.a, path="/models/other-build.gguf"))  # ... a command a reload replaced
        self.assertNotIn("--no-repack", h.reactor.last.argv)
        self.assertEqual(h.sup.warnings, [])

    def test_a_failed_device_says_stopped_once_the_back_off_is_over(self):
        """Issue 39: a dispatcher routing by the heartbeat's state would never send the retry to 'failed'."""
        h = self.h
        d = h.sup.ensure(h.a)
        h.reactor.last.exit(1)
        self.failureResultOf(d)
        self.assertEqual(h.sup.state, FAILED)
        h.reactor.advance(14)
        self.assertEqual(h.sup.state, FAILED)
        h.reactor.advance(1)
        self.assertEqual(h.sup.state, STOPPED)
        self.assertEqual(h.sup.last_error_code, "model_load_failed")  # the diagnosis stays
        h.sup.ensure(h.a)
        self.assertEqual(len(h.reactor.processes), 2)

    def test_backoff_expires_and_grows_past_what_clients_honour(self):
        h = self.h
        d = h.sup.ensure(h.a)
        h.reactor.last.exit(1)
        self.failureResultOf(d)
        h.reactor.advance(load_retry_delay(1))
        d = h.sup.ensure(h.a)
        self.assertEqual(len(h.reactor.processes), 2)
        h.reactor.last.exit(1)
        failure = self.failureResultOf(d, errors.ApiError)
        self.assertEqual(failure.value.retry_after, 300)
        self.assertGreater(failure.value.retry_after, 120, "past the 2 minutes OpenAI's SDK honours")
        self.assertIn("2 times in a row", self.failureResultOf(h.sup.ensure(h.a)).value.message)

    def test_killed_from_outside_while_loading_is_retried_at_once(self):
        h = self.h
        d = h.sup.ensure(h.a)
        h.reactor.last.exit(signal=signal.SIGKILL)
        self.assertIn("killed by SIGKILL", self.failureResultOf(d, errors.ApiError).value.message)
        h.sup.ensure(h.a)
        self.assertEqual(len(h.reactor.processes), 2)

    def test_sigill_at_load_is_retried_once_with_no_repack(self):
        h = self.h
        d = h.sup.ensure(h.a)
        self.assertNotIn("--no-repack", h.reactor.last.argv)
        h.reactor.last.exit(signal=signal.SIGILL)
        self.assertNoResult(d)
        self.assertEqual(len(h.reactor.processes), 2)
        self.assertIn("--no-repack", h.reactor.last.argv)
        self.assertEqual(h.sup.safe_mode_retries, 1)
        self.assertEqual(len(h.sup.warnings), 1)
        self.assertIn("SIGILL", h.sup.warnings[0])
        self.assertIn("--no-repack", h.sup.warnings[0])
        h.make_ready("a")
        self.successResultOf(d)
        # The model keeps the safe flag on later starts.
        h.sup.stop()
        h.reactor.last.exit(0)
        h.sup.ensure(h.a)
        self.assertIn("--no-repack", h.reactor.last.argv)

    def test_sigill_twice_is_diagnosed_in_one_short_line(self):
        h = self.h
        d = h.sup.ensure(h.a)
        h.reactor.last.output("load_tensors: loading model tensors from /models/a.gguf\n")
        h.reactor.last.exit(signal=signal.SIGILL)
        h.reactor.last.exit(signal=signal.SIGILL)
        failure = self.failureResultOf(d, errors.ApiError)
        message = failure.value.message
        self.assertEqual((failure.value.status, failure.value.code), (503, "model_load_failed"))
        self.assertIn("killed by SIGILL", message)
        self.assertIn("illegal instruction", message)
        self.assertLessEqual(len(message), 300)
        self.assertNotIn("/models/a.gguf", message)
        self.assertEqual(h.sup.last_error, message)
        self.assertEqual(h.sup.last_error_code, "illegal_instruction")
        self.assertEqual(len(h.reactor.processes), 2, "one safe retry, not more")

    def test_failure_message_holds_only_the_last_attempt(self):
        h = self.h
        d = h.sup.ensure(h.a)
        h.reactor.last.output("llama_model_load: error loading model: first attempt broke\n")
        h.reactor.last.exit(1)
        self.failureResultOf(d)
        h.reactor.advance(load_retry_delay(1))
        d = h.sup.ensure(h.a)
        h.reactor.last.output("llama_model_load: error loading model: second attempt broke\n")
        h.reactor.last.exit(1)
        message = self.failureResultOf(d, errors.ApiError).value.message
        self.assertIn("second attempt broke", message)
        self.assertNotIn("first attempt", message)

    def test_a_silent_load_fails_at_the_stall_window_not_the_outer_bound(self):
        h = Harness(llama_server_startup_timeout_s=300.0, llama_server_stall_timeout_s=20.0)
        d = h.sup.ensure(h.a)
        h.reactor.last.output("llama_model_loader: loaded meta data\n")
        h.reactor.advance(19.9)
        self.assertNoResult(d)
        h.reactor.advance(0.1)
        failure = self.failureResultOf(d, errors.ApiError)
        self.assertEqual((failure.value.status, failure.value.code), (503, "model_load_timeout"))
        self.assertIn("stalled: printed nothing for 20s", failure.value.message)
        self.assertEqual(h.signals.calls, [(h.reactor.last.pid, signal.SIGKILL)])
        self.assertEqual(failure.value.retry_after, 15)

    def test_a_slow_load_that_progresses_is_not_stalled(self):
        # A big model: four minutes of loading, a progress dot every 10 s.
        h = Harness(llama_server_startup_timeout_s=300.0, llama_server_stall_timeout_s=20.0)
        d = h.sup.ensure(h.a)
        for _ in range(24):
            h.reactor.advance(10)
            h.reactor.last.output(".")  # llama.cpp's progress dots come without a newline
        self.assertNoResult(d)
        self.assertEqual(h.sup.state, STARTING)
        h.make_ready("a")
        self.successResultOf(d)

    def test_the_outer_bound_still_holds_for_a_chatty_child(self):
        h = Harness(llama_server_startup_timeout_s=30.0, llama_server_stall_timeout_s=20.0)
        d = h.sup.ensure(h.a)
        for _ in range(3):
            h.reactor.advance(10)
            h.reactor.last.output("still loading\n")
        failure = self.failureResultOf(d, errors.ApiError)
        self.assertIn("did not become ready within 30s", failure.value.message)

    def test_inference_probe_replaces_a_child_after_three_failures_in_a_row(self):
        h = self.h
        answers = []
        h.sup.probes.inference_fn = lambda base_url, model: defer.succeed(answers.pop(0))
        h.sup.ensure(h.a)
        h.make_ready("a")
        pid = h.reactor.last.pid
        answers[:] = [False, False, True, False, False]
        for _ in range(5):  # a success in between resets the count
            self.successResultOf(h.sup.check_inference())
        self.assertEqual(h.sup.state, READY)
        answers[:] = [False]
        self.assertFalse(self.successResultOf(h.sup.check_inference()))
        self.assertEqual(h.sup.state, STOPPING)
        self.assertEqual(h.signals.calls, [(pid, signal.SIGTERM)])
        self.assertEqual(h.sup.last_error_code, "inference_probe_failed")

    def test_inference_probe_that_hangs_counts_as_a_failure(self):
        h = self.h
        h.sup.ensure(h.a)
        h.make_ready("a")
        calls = []

        class HangingHttp:
            def post(self, url, json=None, timeout=None):
                calls.append((url, json))
                return defer.Deferred()

        h.sup.probes.inference_fn = inference_probe(HangingHttp(), h.reactor, timeout=30)
        d = h.sup.check_inference()
        self.assertNoResult(d)
        h.reactor.advance(30)
        self.assertFalse(self.successResultOf(d))
        self.assertEqual(calls, [("http://127.0.0.1:20000/v1/completions",
                                  {"model": "a", "prompt": "ok", "max_tokens": 1})])

    def test_switch_stops_then_starts(self):
        h = self.h
        h.sup.ensure(h.a)
        h.make_ready("a")
        first = h.reactor.last
        d = h.sup.ensure(h.b)
        self.assertEqual(h.sup.state, STOPPING)
        self.assertEqual(h.signals.calls, [(first.pid, signal.SIGTERM)])
        self.assertEqual(len(h.reactor.processes), 1, "no new child before the old one is reaped")
        first.exit(0)
        self.assertEqual(h.sup.state, STARTING)
        self.assertEqual(len(h.reactor.processes), 2)
        h.make_ready("b")
        endpoint = self.successResultOf(d)
        self.assertEqual(endpoint.model_id, "b")
        self.assertEqual(endpoint.generation, 2)
        self.assertEqual(h.transitions, [STARTING, READY, STOPPING, STOPPED, STARTING, READY])

    def test_switch_during_load_supersedes_waiters(self):
        h = self.h
        d1 = h.sup.ensure(h.a)
        d2 = h.sup.ensure(h.b)
        failure = self.failureResultOf(d1, errors.ApiError)
        self.assertIn("superseded", failure.value.message)
        h.reactor.processes[0].exit(0)
        h.make_ready("b")
        self.successResultOf(d2)

    def test_sigterm_escalates_to_sigkill(self):
        h = self.h
        h.sup.ensure(h.a)
        h.make_ready("a")
        pid = h.reactor.last.pid
        d = h.sup.stop()
        h.reactor.pump([0.25] * 19)  # 4.75 s: SIGTERM repeated, no SIGKILL yet
        self.assertEqual({sig for _, sig in h.signals.calls}, {signal.SIGTERM})
        self.assertEqual(len(h.signals.calls), 20, "SIGTERM repeated every 0.25 s (a fresh child may miss one)")
        h.reactor.advance(0.25)
        self.assertEqual(h.signals.calls[-1], (pid, signal.SIGKILL))
        self.assertEqual(sum(1 for _, sig in h.signals.calls if sig == signal.SIGKILL), 1)
        self.assertNoResult(d)
        h.reactor.last.exit(signal=signal.SIGKILL)
        self.successResultOf(d)
        self.assertEqual(h.sup.state, STOPPED)

    def test_stop_fires_only_when_reaped(self):
        h = self.h
        h.sup.ensure(h.a)
        h.make_ready("a")
        d = h.sup.stop()
        self.assertNoResult(d)
        h.reactor.last.exit(0)
        self.successResultOf(d)
        self.assertEqual(h.reactor.getDelayedCalls(), [], "no timer left behind")

    def test_stop_when_stopped(self):
        self.successResultOf(self.h.sup.stop())

    def test_stop_service_waits_and_refuses_new_loads(self):
        h = self.h
        h.sup.startService()
        h.sup.ensure(h.a)
        h.make_ready("a")
        d = h.sup.stopService()
        self.assertNoResult(d)
        failure = self.failureResultOf(h.sup.ensure(h.a), errors.ApiError)
        self.assertEqual(failure.value.code, "shutting_down")
        h.reactor.last.exit(0)
        self.successResultOf(d)

    def test_stop_while_starting_fails_waiters(self):
        h = self.h
        d = h.sup.ensure(h.a)
        stopped = h.sup.stop()
        self.failureResultOf(d, errors.ApiError)
        h.reactor.last.exit(0)
        self.successResultOf(stopped)

    def test_crash_when_ready_goes_stopped_and_restarts_on_demand(self):
        h = self.h
        h.sup.ensure(h.a)
        h.make_ready("a")
        h.reactor.last.output("GGML_ASSERT failed\n")
        h.reactor.last.exit(signal=signal.SIGSEGV)
        self.assertEqual(h.sup.state, STOPPED)
        self.assertEqual(h.sup.restarts, 1)
        self.assertIn("SIGSEGV", h.sup.last_error)
        d = h.sup.ensure(h.a)
        self.assertEqual(len(h.reactor.processes), 2)
        h.make_ready("a")
        self.successResultOf(d)

    def test_repeated_crashes_back_off(self):
        h = self.h
        for _ in range(2):
            h.sup.ensure(h.a)
            h.make_ready("a")
            h.reactor.last.exit(signal=signal.SIGSEGV)
        self.assertEqual(h.sup.state, FAILED)
        self.failureResultOf(h.sup.ensure(h.a), errors.ApiError)

    def test_stable_child_crash_starts_a_fresh_count(self):
        h = self.h
        for _ in range(3):
            h.sup.ensure(h.a)
            h.make_ready("a")
            h.reactor.advance(31)
            h.reactor.last.exit(signal=signal.SIGSEGV)
            self.assertEqual(h.sup.state, STOPPED)

    def test_port_taken_between_pick_and_bind_is_retried(self):
        h = self.h
        d = h.sup.ensure(h.a)
        h.reactor.last.output("couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 20000\n")
        h.reactor.last.exit(1)
        self.assertEqual(h.sup.state, STARTING)
        self.assertEqual(len(h.reactor.processes), 2)
        self.assertEqual(h.sup.port, 20001)
        h.make_ready("a")
        self.successResultOf(d)

    def test_spawn_failure_fails_without_wedging(self):
        h = self.h
        h.reactor.spawn_error = OSError("no such interpreter")
        self.failureResultOf(h.sup.ensure(h.a), errors.ApiError)
        self.assertEqual(h.sup.state, FAILED)
        h.reactor.spawn_error = None
        h.sup.ensure(h.a)  # first failure: retried at once
        h.make_ready("a")
        self.assertEqual(h.sup.state, READY)

    def test_cancelled_waiter_does_not_cancel_the_shared_load(self):
        h = self.h
        d1 = h.sup.ensure(h.a)
        d2 = h.sup.ensure(h.a)
        d1.cancel()
        self.failureResultOf(d1, defer.CancelledError)
        h.make_ready("a")
        self.successResultOf(d2)

    def test_log_ring_buffer_is_bounded(self):
        h = self.h
        h.sup.ensure(h.a)
        for i in range(3000):
            h.reactor.last.output(f"line {i}\n")
        self.assertEqual(len(h.sup.logs), 1000)
        self.assertEqual(h.sup.log_tail(2), ["line 2998", "line 2999"])
        self.assertEqual(h.sup.log_tail(0), [])

    def test_partial_lines_are_joined(self):
        h = self.h
        d = h.sup.ensure(h.a)
        h.reactor.last.output("hel")
        h.reactor.last.output("lo\nwor")
        h.reactor.last.exit(1)
        self.failureResultOf(d, errors.ApiError)
        self.assertIn("hello", h.sup.logs)
        self.assertIn("wor", h.sup.logs)

    def test_replace_if_unhealthy(self):
        h = self.h
        h.sup.ensure(h.a)
        h.make_ready("a")
        h.probe.ready = set()
        self.assertTrue(self.successResultOf(h.sup.replace_if_unhealthy()))
        self.assertEqual(h.sup.state, STOPPING)
        h.reactor.last.exit(0)
        self.assertEqual(h.sup.state, STOPPED)

    def test_replace_if_unhealthy_keeps_healthy_child(self):
        h = self.h
        h.sup.ensure(h.a)
        h.make_ready("a")
        self.assertFalse(self.successResultOf(h.sup.replace_if_unhealthy()))
        self.assertEqual(h.sup.state, READY)

    def test_snapshot(self):
        h = self.h
        self.assertEqual(h.sup.snapshot()["state"], STOPPED)
        h.sup.ensure(h.a)
        h.make_ready("a")
        snap = h.sup.snapshot()
        self.assertEqual((snap["state"], snap["model"], snap["port"]), (READY, "a", 20000))
        self.assertEqual(snap["pid"], h.reactor.last.pid)


class PureTests(SynchronousTestCase):
    @given(st.integers(min_value=0, max_value=200))
    def test_restart_delay_grows_and_caps(self, n):
        delay = restart_delay(n)
        self.assertGreaterEqual(delay, 0)
        self.assertLessEqual(delay, 60.0)
        self.assertLessEqual(delay, restart_delay(n + 1))
        if n <= 1:
            self.assertEqual(delay, 0)

    def test_wrap_argv(self):
        argv = wrap_argv(["/bin/llama-server", "--port", "1"], 42, (2, 3))
        self.assertEqual(argv[argv.index("--parent") + 1], "42")
        self.assertEqual(argv[argv.index("--cpus") + 1], "2,3")
        self.assertEqual(argv[argv.index("--") + 1:], ["/bin/llama-server", "--port", "1"])


class HttpProbeTests(SynchronousTestCase):
    """The real readiness probe against an in-memory llama-server stand-in."""

    def probe(self, health, models):
        import json

        from treq.testing import StubTreq
        from twisted.web.resource import Resource

        from rolemesh.children.probes import http_probe

        class Stub(Resource):
            isLeaf = True

            def render_GET(self, request):
                if request.path == b"/health":
                    request.setResponseCode(health)
                    return b'{"status": "ok"}' if health == 200 else b'{"error": {"message": "Loading model"}}'
                return json.dumps({"object": "list", "data": models}).encode()

        stub = StubTreq(Stub())
        d = http_probe(stub)("http://127.0.0.1:1234", "alpha")
        stub.flush()
        return self.successResultOf(d)

    def test_loading_is_not_ready(self):
        self.assertFalse(self.probe(503, [{"id": "alpha"}]))

    def test_ready_when_listed_by_id_or_alias(self):
        self.assertTrue(self.probe(200, [{"id": "alpha"}]))
        self.assertTrue(self.probe(200, [{"id": "/models/x.gguf", "aliases": ["alpha"]}]))

    def test_other_model_is_not_ready(self):
        self.assertFalse(self.probe(200, [{"id": "beta"}]))

    def test_a_body_that_never_ends_is_bounded(self):
        """treq's timeout covers only the headers: a child that sends the
        headers of /health and then nothing must not hang the probe."""
        from twisted.internet.task import Clock

        from rolemesh.children.probes import http_probe

        class Response:
            code = 200

            def content(self):
                return defer.Deferred()  # the body never ends

        class Client:
            def get(self, url, timeout=None):
                return defer.succeed(Response())

        clock = Clock()
        d = http_probe(Client(), timeout=2.0, clock=clock)("http://127.0.0.1:1234", "alpha")
        self.assertNoResult(d)
        clock.advance(4)
        self.failureResultOf(d, defer.TimeoutError)


class ChildLogTests(SynchronousTestCase):
    """Child output: all of it in the ring buffer; in the agent's log, all of a
    start but only errors from a ready child."""

    def lines_logged(self, h, text):
        from twisted.logger import capturedLogs

        with capturedLogs() as events:
            h.reactor.last.output(text)
        return [e["line"] for e in events if "line" in e]

    def test_filter(self):
        h = Harness()
        h.sup.ensure(h.a)
        self.assertEqual(self.lines_logged(h, "0.00.001 I srv  load_model: loading\n"),
                         ["0.00.001 I srv  load_model: loading"])
        h.make_ready("a")
        self.assertEqual(self.lines_logged(h, "0.01.000 I slot launch_slot_: id 0 | task 1\n"), [])
        self.assertEqual(self.lines_logged(h, "0.01.001 W slot need to evaluate at least 1 token\n"), [])
        self.assertEqual(self.lines_logged(h, "0.01.002 E srv  something broke\n"), ["0.01.002 E srv  something broke"])
        self.assertEqual(len(self.lines_logged(h, "GGML_ASSERT(x) failed\n")), 1)
        self.assertIn("0.01.000 I slot launch_slot_: id 0 | task 1", h.sup.logs)


class DeliveryTests(SynchronousTestCase):
    """Listeners and waiters are told once a transition is complete, in order."""

    def setUp(self):
        self.h = Harness()

    def test_a_listener_told_of_a_start_sees_the_started_child(self):
        h = self.h
        seen = []
        h.sup.subscribe(lambda change: seen.append((change.state, h.sup.state, h.sup.pid, h.sup.snapshot()["pid"],
                                                    len(h.reactor.processes))))
        h.sup.ensure(h.a)
        pid = h.reactor.last.pid
        self.assertEqual(seen, [(STARTING, STARTING, pid, pid, 1)])

    def test_a_listener_that_stops_the_device_as_it_starts_leaves_no_child_behind(self):
        h = self.h
        stopped = []
        h.sup.subscribe(lambda change: stopped.append(h.sup.stop()) if change.state == STARTING else None)
        d = h.sup.ensure(h.a)
        child = h.reactor.last
        self.assertIn("cancelled: device stopped", self.failureResultOf(d, errors.ApiError).value.message)
        self.assertEqual(h.sup.state, STOPPING)
        self.assertEqual(h.signals.calls, [(child.pid, signal.SIGTERM)], "the child it started is stopped")
        self.assertNoResult(stopped[0])
        child.exit(0)
        self.successResultOf(stopped[0])
        self.assertEqual(h.sup.state, STOPPED)
        self.assertEqual(h.transitions, [STARTING, STOPPING, STOPPED])
        self.assertEqual(h.reactor.getDelayedCalls(), [])

    def test_each_change_is_told_with_its_own_state_after_the_whole_transition(self):
        h = self.h
        h.sup.ensure(h.a)
        h.make_ready("a")
        first = h.reactor.last
        told = []
        h.sup.subscribe(lambda change: told.append((change.previous, change.state, change.model.model_id,
                                                    h.sup.state, h.sup.generation)))
        h.sup.ensure(h.b)
        first.exit(0)  # reaped: stopped, and at once starting the switch's target
        self.assertEqual(told, [
            (READY, STOPPING, "a", STOPPING, 1),
            (STOPPING, STOPPED, "a", STARTING, 2),
            (STOPPED, STARTING, "b", STARTING, 2),
        ])

    def test_listeners_are_told_before_waiters_fire_and_a_listener_that_calls_in_waits_its_turn(self):
        h = self.h
        order = []

        def listener(change):
            order.append(("told", change.state))
            if change.state == READY:
                again = h.sup.ensure(h.a)  # calls back in: answered from the completed state
                order.append(("again", self.successResultOf(again).model_id))

        h.sup.subscribe(listener)
        d = h.sup.ensure(h.a).addCallback(lambda endpoint: order.append(("waiter", endpoint.model_id)))
        h.make_ready("a")
        self.successResultOf(d)
        self.assertEqual(order, [("told", STARTING), ("told", READY), ("again", "a"), ("waiter", "a")])

    def test_a_failing_listener_is_logged_and_the_others_are_told(self):
        h = self.h
        h.sup.subscribe(lambda change: 1 / 0)
        after = []
        h.sup.subscribe(lambda change: after.append(change.state))
        h.sup.ensure(h.a)
        self.assertEqual(after, [STARTING])
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)

    def test_unsubscribed_listener_is_not_told(self):
        h = self.h
        told = []
        unsubscribe = h.sup.subscribe(lambda change: told.append(change.state))
        unsubscribe()
        unsubscribe()
        h.sup.ensure(h.a)
        self.assertEqual(told, [])

    def test_counted_events_come_from_the_source_and_match_the_counters(self):
        h = self.h
        events = []
        h.sup.events.subscribe(lambda event, **fields: events.append((event, fields.get("model")))
                               if event != "child_state" else None)
        d = h.sup.ensure(h.a)
        h.reactor.last.exit(1)  # a load failure
        self.failureResultOf(d, errors.ApiError)
        h.reactor.advance(load_retry_delay(1))
        d = h.sup.ensure(h.b)
        h.reactor.advance(10.0)  # a load timeout
        self.failureResultOf(d, errors.ApiError)
        h.reactor.last.exit(signal=signal.SIGKILL)
        h.reactor.advance(load_retry_delay(1))
        h.sup.ensure(h.a)
        h.make_ready("a")  # a load
        h.reactor.last.exit(1)  # a crash, and a restart
        self.assertEqual(events, [("load_failure", "a"), ("load_timeout", "b"), ("load", "a"), ("crash", "a"),
                                  ("restart", "a")])
        self.assertEqual((h.sup.load_failures, h.sup.load_timeouts, h.sup.loads, h.sup.crashes, h.sup.restarts),
                         (1, 1, 1, 1, 1))

    def test_states_are_named_constants_that_read_as_their_values(self):
        import json

        from rolemesh.children.state import DeviceState

        self.assertIs(self.h.sup.state, DeviceState.STOPPED)
        self.assertEqual(json.dumps({"state": READY}), '{"state": "ready"}')
        self.assertEqual((f"{STOPPING}", str(FAILED), READY == "ready"), ("stopping", "failed", True))
        self.assertEqual(self.h.sup.snapshot()["state"], "stopped")


class BackOffTests(SynchronousTestCase):
    """Issue 31: what counts as a failure in a row, and what a back-off holds back."""

    def setUp(self):
        self.h = Harness()

    def fail_load(self, model, how=None):
        """Ask for ``model``; its load ends on its own (``how``: exit status
        1, or killed by that signal).  Returns the waiter's error."""
        h = self.h
        h.probe.ready = set()
        d = h.sup.ensure(model)
        if h.sup.state == STOPPING:  # a switch: the child before it goes first
            h.reactor.last.exit(0)
        self.assertEqual((h.sup.state, h.sup.model), (STARTING, model))
        h.reactor.last.exit(1) if how is None else h.reactor.last.exit(signal=how)
        return self.failureResultOf(d, errors.ApiError).value

    def load(self, model):
        h = self.h
        d = h.sup.ensure(model)
        if h.sup.state == STOPPING:
            h.reactor.processes[-1].exit(0)
        h.make_ready(model.model_id)
        return self.successResultOf(d)

    def test_a_child_the_agent_stopped_never_counts_whatever_its_exit_status(self):
        h = self.h
        ends = [dict(code=1), dict(code=0), dict(signal=signal.SIGKILL), dict(signal=signal.SIGTERM),
                dict(signal=signal.SIGSEGV), dict(code=137)]
        for end in ends:
            # A switch away from a ready child, and a stop of a loading one.
            self.load(h.a)
            d = h.sup.ensure(h.b)
            h.reactor.advance(0.25)  # the second SIGTERM
            h.reactor.processes[-2 if h.sup.state != STOPPING else -1].exit(**end)
            h.make_ready("b")
            self.successResultOf(d)
            h.probe.ready = set()
            d = h.sup.ensure(h.a)
            stopped = h.sup.stop()
            h.reactor.last.exit(**end)
            self.successResultOf(stopped)
            self.failureResultOf(d, errors.ApiError)
            self.assertEqual((h.sup.state, h.sup.backoffs(), h.sup.restarts), (STOPPED, [], 0), end)
        self.assertEqual(self.fail_load(h.a).retry_after, 15, "a's first failure in a row")
        self.assertEqual(h.sup.load_failures, 1)

    def test_a_load_that_becomes_ready_ends_the_run_of_failed_loads(self):
        h = self.h
        self.assertEqual(self.fail_load(h.a).retry_after, 15)
        h.reactor.advance(15)
        self.load(h.a)
        self.load(h.b)
        self.assertEqual(self.fail_load(h.a).retry_after, 15, "the first failure since a last loaded, not the 2nd")
        h.reactor.advance(15)
        self.assertEqual(self.fail_load(h.a).retry_after, 300, "two in a row with no load between")

    def test_kills_from_outside_in_a_row_back_off_but_a_load_between_them_starts_over(self):
        h = self.h
        for n in range(1, 5):
            error = self.fail_load(h.a, signal.SIGKILL)
            self.assertEqual(error.retry_after, retry_after_for(restart_delay(n)))
            h.reactor.advance(restart_delay(n))
        self.load(h.a)
        self.load(h.b)
        self.fail_load(h.a, signal.SIGKILL)
        self.assertEqual(h.sup.backoffs(), [], "retried at once")
        self.load(h.a)

    def test_a_model_backing_off_is_refused_in_any_state_and_the_device_goes_on_serving_others(self):
        h = self.h
        self.fail_load(h.a)
        self.load(h.b)
        child = h.reactor.last
        failure = self.failureResultOf(h.sup.ensure(h.a), errors.ApiError)
        self.assertEqual((failure.value.status, failure.value.retry_after), (503, 15))
        self.assertEqual((h.sup.state, h.sup.model), (READY, h.b), "b's child is not stopped for a refused load")
        self.assertEqual(child.signals, [])
        d = h.sup.ensure(h.b)
        self.assertEqual(self.successResultOf(d).pid, child.pid)
        # While b loads, too.
        h.sup.stop()
        child.exit(0)
        h.probe.ready = set()
        loading = h.sup.ensure(h.b)
        self.assertEqual(self.failureResultOf(h.sup.ensure(h.a), errors.ApiError).value.retry_after, 15)
        self.assertEqual(h.sup.state, STARTING)
        h.make_ready("b")
        self.successResultOf(loading)

    def test_a_crash_loop_still_backs_off_but_a_child_that_served_until_switched_away_ends_the_run(self):
        h = self.h
        self.load(h.a)
        h.reactor.last.exit(signal=signal.SIGSEGV)
        self.assertEqual(h.sup.state, STOPPED, "the first crash is retried at once")
        self.load(h.a)
        self.load(h.b)  # a served until the agent switched away from it
        self.load(h.a)
        h.reactor.last.exit(signal=signal.SIGSEGV)
        self.assertEqual(h.sup.state, STOPPED, "first crash in a row again")
        self.load(h.a)
        h.reactor.last.exit(signal=signal.SIGSEGV)
        self.assertEqual(h.sup.state, FAILED, "a crash loop backs off")
        self.assertEqual(self.failureResultOf(h.sup.ensure(h.a), errors.ApiError).value.retry_after, 1)

    def test_a_child_replaced_for_failing_its_health_probe_does_not_end_the_run_of_crashes(self):
        h = self.h
        self.load(h.a)
        h.reactor.last.exit(signal=signal.SIGSEGV)
        self.load(h.a)
        h.probe.ready = set()
        self.assertTrue(self.successResultOf(h.sup.replace_if_unhealthy()))
        h.reactor.last.exit(0)
        self.load(h.a)
        h.reactor.last.exit(signal=signal.SIGSEGV)
        self.assertEqual(h.sup.state, FAILED, "2nd crash in a row: the replacement was no success")

    def test_the_log_line_says_why_the_failure_count_and_the_schedule_step(self):
        from twisted.logger import capturedLogs, formatEvent

        h = self.h
        with capturedLogs() as events:
            self.fail_load(h.a, signal.SIGKILL)
            h.reactor.advance(0)
            self.fail_load(h.a, signal.SIGKILL)
        lines = [formatEvent(e) for e in events if "step" in e]
        self.assertEqual(lines, [
            "a will be loaded again on gpu:0 at the next request: 1st failed load in a row; step 1 of the "
            "restart schedule (0 s, 1 s, 2 s, 4 s, 8 s, 16 s, 32 s, 60 s (then the last, each time))",
            "a backs off on gpu:0 for 1s, loads refused until then: 2nd failed load in a row; step 2 of the "
            "restart schedule (0 s, 1 s, 2 s, 4 s, 8 s, 16 s, 32 s, 60 s (then the last, each time))",
        ])
        self.assertEqual([(e["failures"], e["step"], e["schedule"]) for e in events if "step" in e],
                         [(1, 1, "restart"), (2, 2, "restart")])


def retry_after_for(delay):
    return max(1, int(delay + 0.999))


class OutsideSignalTests(SynchronousTestCase):
    """A signal the agent did not send is said to come from another process,
    and from the kernel's out-of-memory killer only when the cgroup's
    ``oom_kill`` count rose while the child ran (issue 26: an agent's sweep
    SIGKILLed another's child, reported as "often the OOM killer")."""

    def setUp(self):
        self.h = Harness()

    def loading_killed(self, rise: int, sig: int = signal.SIGKILL) -> str:
        d = self.h.sup.ensure(self.h.a)
        self.h.oom_kills[0] += rise
        self.h.reactor.last.exit(signal=sig)
        return self.failureResultOf(d, errors.ApiError).value.message

    def test_sigkill_without_an_oom_kill_is_another_process(self):
        message = self.loading_killed(rise=0)
        self.assertIn("killed by SIGKILL while loading", message)
        self.assertIn("a signal from another process, not the agent's", message)
        self.assertIn("not the kernel's out-of-memory killer", message)

    def test_sigkill_with_the_oom_count_rising_is_the_oom_killer(self):
        message = self.loading_killed(rise=1)
        self.assertIn("(the kernel's out-of-memory killer: the cgroup's oom_kill count rose", message)
        self.assertNotIn("another process", message)

    def test_a_host_that_does_not_count_says_so(self):
        self.h.sup.oom_counter = lambda pid: lambda: None
        message = self.loading_killed(rise=0)
        self.assertIn("a signal from another process", message)
        self.assertIn("does not count out-of-memory kills", message)

    def test_sigterm_from_outside(self):
        self.assertIn("killed by SIGTERM while loading on gpu:0 (a signal from another process, not the agent's)",
                      self.loading_killed(rise=0, sig=signal.SIGTERM))

    def test_a_ready_child_killed_from_outside(self):
        h = self.h
        h.sup.ensure(h.a)
        h.make_ready("a")
        h.reactor.last.exit(signal=signal.SIGKILL)
        self.assertIn("killed by SIGKILL unexpectedly (a signal from another process", h.sup.last_error)
        h.sup.ensure(h.a)
        h.make_ready("a")
        h.oom_kills[0] += 2
        h.reactor.last.exit(signal=signal.SIGKILL)
        self.assertIn("unexpectedly (the kernel's out-of-memory killer", h.sup.last_error)

    def test_the_count_is_read_for_each_child(self):
        h = self.h
        pids = []
        h.sup.oom_counter = lambda pid: pids.append(pid) or (lambda: h.oom_kills[0])
        h.sup.ensure(h.a)
        self.assertEqual(pids, [h.reactor.last.pid])
