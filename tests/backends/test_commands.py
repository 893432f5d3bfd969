"""The edge that runs vendor tools: run_async on a fake process-spawning Clock (output, exit
status, timeout kill, cancel, missing tool) and run_sync (real subprocess, injected failures)."""

from __future__ import annotations

import subprocess
import sys

from twisted.internet.defer import CancelledError
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.backends.commands import (
    ToolError,
    ToolNotFound,
    ToolTimeout,
    first_line,
    run_async,
    run_sync,
    tool_environment,
)
from tests.fixtures.backend_fakes import ProcessClock


def which(tool: str):
    return {"nvidia-smi": "/usr/bin/nvidia-smi"}.get(tool)


class RunAsyncTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = ProcessClock()

    def start(self, timeout: float = 5.0):
        d = run_async(
            self.reactor, ["nvidia-smi", "-L"], timeout, which=which, env={"PATH": "/usr/bin", "LANG": "de"}
        )
        (process,) = self.reactor.spawned
        return d, process

    def test_output_and_status(self) -> None:
        d, process = self.start()
        self.assertEqual(process.executable, "/usr/bin/nvidia-smi")
        self.assertEqual(process.args, ["/usr/bin/nvidia-smi", "-L"])
        self.assertEqual(process.env, {"PATH": "/usr/bin", "LANG": "C", "LC_ALL": "C"})
        self.assertTrue(process.transport.stdin_closed)
        process.protocol.childDataReceived(1, b"GPU 0: ")
        process.protocol.childDataReceived(2, b"warning\n")
        process.protocol.childDataReceived(1, b"H100\n")
        self.assertNoResult(d)
        process.protocol.processEnded(Failure(ProcessDone(0)))
        self.assertEqual(self.successResultOf(d), (0, "GPU 0: H100\n", "warning\n"))
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_non_zero_exit_is_a_result_not_an_error(self) -> None:
        d, process = self.start()
        process.protocol.childDataReceived(1, b"No devices were found\n")
        process.protocol.processEnded(Failure(ProcessTerminated(exitCode=6)))
        self.assertEqual(self.successResultOf(d), (6, "No devices were found\n", ""))

    def test_killed_by_a_signal(self) -> None:
        d, process = self.start()
        process.protocol.processEnded(Failure(ProcessTerminated(exitCode=None, signal=11)))
        self.assertEqual(self.successResultOf(d)[0], -11)

    def test_timeout_kills_the_tool(self) -> None:
        d, process = self.start(timeout=5.0)
        self.reactor.advance(4.9)
        self.assertNoResult(d)
        self.reactor.advance(0.1)
        self.assertEqual(process.transport.signals, ["KILL"])
        self.assertNoResult(d)
        process.transport.ended = True
        process.protocol.processEnded(Failure(ProcessTerminated(exitCode=None, signal=9)))
        failure = self.failureResultOf(d, ToolTimeout)
        self.assertEqual(str(failure.value), "nvidia-smi: no answer within 5s; killed")

    def test_cancel_kills_the_tool_and_ignores_its_end(self) -> None:
        d, process = self.start()
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(process.transport.signals, ["KILL"])
        self.assertEqual(self.reactor.getDelayedCalls(), [])
        process.transport.ended = True
        process.protocol.processEnded(Failure(ProcessTerminated(exitCode=None, signal=9)))

    def test_missing_tool(self) -> None:
        d = run_async(self.reactor, ["rocm-smi", "--json"], which=which)
        failure = self.failureResultOf(d, ToolNotFound)
        self.assertEqual(str(failure.value), "rocm-smi: not found on PATH")
        self.assertEqual(self.reactor.spawned, [])

    def test_spawn_failure(self) -> None:
        reactor = ProcessClock(spawn_error=OSError(13, "Permission denied"))
        failure = self.failureResultOf(run_async(reactor, ["nvidia-smi"], which=which), ToolError)
        self.assertEqual(str(failure.value), "nvidia-smi: could not start: Permission denied")

    def test_explicit_path_skips_which(self) -> None:
        run_async(self.reactor, ["/opt/rocm/bin/amd-smi", "metric"], which=lambda tool: None)
        self.assertEqual(self.reactor.spawned[0].executable, "/opt/rocm/bin/amd-smi")


class RunSyncTests(SynchronousTestCase):
    def test_a_real_process(self) -> None:
        rc, out, err = run_sync(
            [
                sys.executable,
                "-c",
                "import os, sys; print(os.environ['LC_ALL']); sys.stderr.write('e'); sys.exit(3)",
            ],
            30,
        )
        self.assertEqual((rc, out.strip(), err), (3, "C", "e"))

    def test_missing_tool(self) -> None:
        e = self.assertRaises(ToolNotFound, run_sync, ["no-such-tool-rolemesh"], 1)
        self.assertEqual(str(e), "no-such-tool-rolemesh: not found on PATH")

    def test_timeout(self) -> None:
        def runner(*args, **kwargs):
            raise subprocess.TimeoutExpired(args[0], kwargs["timeout"])

        e = self.assertRaises(ToolTimeout, run_sync, ["nvidia-smi"], 2.5, which=which, runner=runner)
        self.assertEqual(str(e), "nvidia-smi: no answer within 2.5s; killed")

    def test_cannot_execute(self) -> None:
        def runner(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        e = self.assertRaises(ToolError, run_sync, ["nvidia-smi"], 1, which=which, runner=runner)
        self.assertEqual(str(e), "nvidia-smi: could not run: Permission denied")

    def test_empty_argv(self) -> None:
        self.assertRaises(ToolError, run_sync, [], 1)

    def test_helpers(self) -> None:
        self.assertEqual(first_line("\n  \n  hello  \nworld"), "hello")
        self.assertEqual(len(first_line("x" * 500)), 200)
        self.assertEqual(tool_environment({"A": "1"}), {"A": "1", "LC_ALL": "C", "LANG": "C"})
