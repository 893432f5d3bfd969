"""One spawn of a device's child (rolemesh.children.attempt): its process, pid
file, OOM-kill baseline, load watch, output and end -- fake processes on a
Clock, no real I/O."""

from __future__ import annotations

import signal
from typing import Any, List, Optional, Tuple

from twisted.internet.defer import succeed
from twisted.logger import capturedLogs, formatEvent
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.children.attempt import ChildAttempt, start_command
from rolemesh.children.process import ChildProcess, Launcher, OutputRing
from rolemesh.children.state import FAILED
from tests.fixtures.fakes import FakeBackend, GroupSignals, ProcessReactor, make_config

SERVING_LINE = "0.01.000 I slot launch_slot_: id 0 | task 1"


class PidFilesStub:
    def __init__(self) -> None:
        self.written: List[Tuple[str, int, List[str]]] = []
        self.removed: List[str] = []

    def write(self, device: str, pid: int, argv: List[str]) -> None:
        self.written.append((device, pid, list(argv)))

    def remove(self, device: str) -> None:
        self.removed.append(device)


class Harness:
    def __init__(self) -> None:
        self.config = make_config([{"model_id": "a"}], llama_server_probe_interval_s=0.5,
                                  llama_server_startup_timeout_s=10.0)
        self.model = self.config.model("a")
        self.reactor = ProcessReactor()
        self.signals = GroupSignals(self.reactor)
        backend = FakeBackend()
        self.launcher = Launcher("/opt/llama-server", backend, (backend.refs[0],), lambda: 20000, {"PATH": "/bin"},
                                 lambda argv, pid, cpus: ["wrapper", *argv], self.signals)
        self.output = OutputRing()
        self.pidfiles = PidFilesStub()
        self.ended: List[Tuple[ChildAttempt, Optional[ChildProcess], Failure]] = []
        self.oom = [0]
        self.oom_pids: List[Optional[int]] = []
        self.attempt = ChildAttempt("gpu:0", "a", self.output, lambda *told: self.ended.append(told),
                                    self.pidfiles, started_at=5.0)  # type: ignore[arg-type]

    def oom_counter(self, pid: Optional[int]) -> Any:
        self.oom_pids.append(pid)
        return lambda: self.oom[0]

    def spawn(self) -> ChildProcess:
        argv, env, wrapped = start_command(self.launcher, self.model, 20000, False, self.output, "gpu:0")
        return self.attempt.spawn(self.reactor, self.launcher, wrapped, env, argv, self.oom_counter)


class SpawnTests(SynchronousTestCase):
    def test_the_child_is_spawned_with_its_pid_file_and_oom_baseline(self) -> None:
        h = Harness()
        child = h.spawn()
        process = h.reactor.last
        self.assertIs(h.attempt.child, child)
        self.assertEqual(child.pid, process.pid)
        self.assertEqual(process.argv[0], "wrapper")
        self.assertEqual(h.pidfiles.written, [("gpu:0", process.pid, process.argv[1:])])
        self.assertEqual(h.oom_pids, [process.pid])

    def test_the_command_is_said_in_the_output(self) -> None:
        h = Harness()
        with capturedLogs() as events:
            h.spawn()
        self.assertTrue(h.output.lines[0].startswith("[rolemesh] starting a on gpu:0: /opt/llama-server "))
        self.assertEqual(h.output.attempt(), [], "a new attempt begins after the command")
        self.assertIn("starting llama-server for a on gpu:0 (port 20000)", [formatEvent(e) for e in events])

    def test_a_spawn_that_fails_leaves_no_child(self) -> None:
        h = Harness()
        h.reactor.spawn_error = OSError("gone")
        self.assertRaises(OSError, h.spawn)
        self.assertIsNone(h.attempt.child)
        self.assertEqual(h.pidfiles.written, [])


class OutputTests(SynchronousTestCase):
    def test_lines_are_kept_and_logged_until_it_serves(self) -> None:
        h = Harness()
        h.spawn()
        with capturedLogs() as events:
            h.reactor.last.output(SERVING_LINE + "\n")
            self.assertEqual(h.attempt.ready(7.5), 2.5)
            h.reactor.last.output(SERVING_LINE + "\n")
            h.reactor.last.output("0.02.000 E srv: something failed\n")
        self.assertEqual(h.output.lines[-3:], [SERVING_LINE, SERVING_LINE, "0.02.000 E srv: something failed"])
        logged = [formatEvent(e) for e in events]
        self.assertEqual(logged, [f"gpu:0 a: {SERVING_LINE}", "gpu:0 a: 0.02.000 E srv: something failed"])
        self.assertEqual({e["log_namespace"] for e in events}, {"rolemesh.supervisor"})
        self.assertTrue(h.attempt.child.serving)  # type: ignore[union-attr]

    def test_a_ready_hint_probes_at_once(self) -> None:
        h = Harness()
        h.spawn()
        probes: List[int] = []
        ready: List[bool] = []
        h.attempt.watch_load(h.reactor, h.config, lambda: probes.append(1) or succeed(False),
                             lambda: ready.append(True), lambda what: None)
        h.reactor.last.output("main: server is listening on http://127.0.0.1:20000\n")
        self.assertEqual(probes, [1], "probed before the interval")
        h.attempt.stop_watch()
        self.assertEqual(h.reactor.getDelayedCalls(), [])


class EndTests(SynchronousTestCase):
    def test_the_end_is_handed_on_with_the_pid_file_removed(self) -> None:
        h = Harness()
        child = h.spawn()
        h.oom[0] += 1
        h.reactor.last.exit(signal=signal.SIGKILL)
        [(attempt, ended, reason)] = h.ended
        self.assertIs(attempt, h.attempt)
        self.assertIs(ended, child)
        exit = h.attempt.ended(reason)
        self.assertIsNone(h.attempt.child)
        self.assertEqual(h.pidfiles.removed, ["gpu:0"])
        self.assertTrue(exit.oom_killed, "the OOM-kill count rose while it ran")
        self.assertEqual(exit.how, "killed by SIGKILL")

    def test_stop_signals_the_child_and_says_whether_there_was_one(self) -> None:
        h = Harness()
        self.assertFalse(h.attempt.stop("stop requested", False, 5.0))
        h.spawn()
        h.attempt.ready(6.0)
        h.attempt.stopping(FAILED, healthy=False)
        self.assertEqual((h.attempt.stop_reason, h.attempt.stop_healthy, h.attempt.serving), (FAILED, False, False))
        self.assertTrue(h.attempt.stop("load timed out", True, 5.0))
        self.assertEqual(h.signals.calls, [(h.reactor.last.pid, signal.SIGKILL)])
        h.reactor.last.exit(signal=signal.SIGKILL)
        h.reactor.advance(10)
        self.assertEqual(h.reactor.getDelayedCalls(), [])
