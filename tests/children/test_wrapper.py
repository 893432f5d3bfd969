"""rolemesh.children.wrapper as the supervisor runs it (``wrap_argv``), around a
tiny Python sleeper: a new session and process group, pinned to the cores
asked, killed by the kernel when its parent dies, and clear one-line errors."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from typing import List, Tuple

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from rolemesh.children.process import wrap_argv

#: Prints its pid once it runs (after the exec), then waits for a signal (a kill).
SLEEPER = [sys.executable, "-S", "-c", "import os, signal; print(os.getpid(), flush=True); signal.pause()"]
BOUND_S = 15.0


def read_line(stream, timeout: float = BOUND_S) -> str:
    """One line from ``stream`` within ``timeout`` (AssertionError if none)."""
    ready, _, _ = select.select([stream], [], [], timeout)
    if not ready:
        raise AssertionError(f"no line within {timeout}s")
    return stream.readline().decode().strip()


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, timeout: float = BOUND_S) -> None:
    """Wait for the process's exit itself (a pidfd turns readable when it
    ends), within ``timeout``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        readable, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    if not readable and alive(pid):
        raise AssertionError(f"pid {pid} still alive after {timeout}s")


class ChildExecTests(SynchronousTestCase):
    def setUp(self) -> None:
        if not sys.platform.startswith("linux"):
            raise SkipTest("child_exec's guarantees (PR_SET_PDEATHSIG, affinity) are Linux's")

    def start(self, parent: int, cpus: Tuple[int, ...] = ()) -> Tuple[subprocess.Popen, int]:
        process = subprocess.Popen(wrap_argv(SLEEPER, parent, cpus), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        self.addCleanup(self.reap, process)
        return process, int(read_line(process.stdout))

    def reap(self, process: subprocess.Popen) -> None:
        if process.poll() is None:
            process.kill()
        process.wait(BOUND_S)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()

    def test_exec_keeps_the_pid(self) -> None:
        process, pid = self.start(os.getpid())
        self.assertEqual(pid, process.pid, "the agent holds llama-server's own pid")

    def test_new_session_and_process_group(self) -> None:
        process, pid = self.start(os.getpid())
        self.assertEqual(os.getpgid(pid), pid)
        self.assertEqual(os.getsid(pid), pid)
        self.assertNotEqual(os.getpgid(pid), os.getpgid(0))

    def test_pinned_to_the_cores_asked(self) -> None:
        mine = sorted(os.sched_getaffinity(0))
        want = (mine[-1],)
        process, pid = self.start(os.getpid(), want)
        self.assertEqual(os.sched_getaffinity(pid), set(want))

    def test_not_pinned_without_cpus(self) -> None:
        process, pid = self.start(os.getpid())
        self.assertEqual(os.sched_getaffinity(pid), os.sched_getaffinity(0))

    def test_dies_when_its_parent_is_sigkilled(self) -> None:
        # An intermediate parent starts the wrapped sleeper, reports its pid, and waits.
        parent_code = (
            "import os, signal, subprocess, sys\n"
            "from rolemesh.children.supervisor import wrap_argv\n"
            f"argv = wrap_argv({SLEEPER!r}, os.getpid())\n"
            "child = subprocess.Popen(argv, stdout=subprocess.PIPE)\n"
            "print(child.stdout.readline().decode().strip(), flush=True)\n"
            "signal.pause()\n"
        )
        parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL)
        self.addCleanup(self.reap, parent)
        child = int(read_line(parent.stdout))
        self.addCleanup(lambda: alive(child) and os.kill(child, signal.SIGKILL))
        self.assertTrue(alive(child))
        parent.kill()
        parent.wait(BOUND_S)
        wait_gone(child)

    def test_gives_up_when_the_parent_is_already_gone(self) -> None:
        # --parent names a process that is not our parent: the agent died
        # between fork and prctl, so nobody would ever stop the child.
        done = subprocess.run(wrap_argv(SLEEPER, os.getpid() + 1_000_000), capture_output=True, timeout=BOUND_S)
        self.assertEqual(done.returncode, 1)
        self.assertEqual(done.stdout, b"", "the sleeper never ran")


class ChildExecErrorTests(SynchronousTestCase):
    def run_wrapper(self, argv: List[str]) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, timeout=BOUND_S, stdin=subprocess.DEVNULL)

    def test_missing_binary_is_one_line_and_127(self) -> None:
        done = self.run_wrapper(wrap_argv(["/nonexistent/llama-server", "--port", "1"], os.getpid()))
        self.assertEqual(done.returncode, 127)
        self.assertEqual(done.stderr.decode().strip().splitlines(),
                         ["child_exec: cannot execute /nonexistent/llama-server: No such file or directory"])

    def test_no_command(self) -> None:
        done = self.run_wrapper(wrap_argv([], os.getpid()))
        self.assertNotEqual(done.returncode, 0)
        self.assertEqual(done.stderr.decode().strip(), "child_exec: no command given")

    def test_unknown_option(self) -> None:
        argv = wrap_argv(SLEEPER, os.getpid())
        argv[argv.index("--parent")] = "--bogus"
        done = self.run_wrapper(argv)
        self.assertNotEqual(done.returncode, 0)
        self.assertEqual(done.stderr.decode().strip(), "child_exec: unknown option --bogus")
