"""One spawn of a device's child, and what the supervisor keeps about it.

A :class:`ChildAttempt` is made for every spawn (a first load, a switch's
target, a retry on another port): the :class:`~rolemesh.child_process.ChildProcess`,
its pid file, the cgroup's OOM-kill count when it started, the
:class:`~rolemesh.child_probes.LoadWatch` while it loads, when it was
started and became ready, and how the stop under way should end.  The
supervisor decides; the attempt only holds and does the mechanics of one
child, so its state is dropped in one piece when the next spawn begins.
"""

from __future__ import annotations

from typing import Callable, List, Mapping, Optional, Sequence

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from rolemesh import diagnosis
from rolemesh.child_probes import LoadWatch
from rolemesh.child_process import ChildProcess, Launcher, exit_of
from rolemesh.config import NodeConfig
from rolemesh.device_state import DeviceState
from rolemesh.interfaces import IAgentReactor
from rolemesh.pidfiles import PidFiles

__all__ = ["ChildAttempt", "OOMCounter"]

#: Finds the reader of a child's cgroup OOM-kill count from its pid.
OOMCounter = Callable[[Optional[int]], Callable[[], Optional[int]]]


class ChildAttempt:
    """One spawned child (or the attempt to spawn it) on device ``name``."""

    def __init__(self, name: str, pidfiles: Optional[PidFiles] = None, started_at: float = 0.0) -> None:
        self.name = name
        self._pidfiles = pidfiles
        #: The child process once spawned; None before, and once it ended.
        self.child: Optional[ChildProcess] = None
        self.watch: Optional[LoadWatch] = None
        self.started_at = started_at
        self.ready_at: Optional[float] = None
        #: The state a stop under way ends in (None: stopped).
        self.stop_reason: Optional[DeviceState] = None
        #: The stop under way is of a child that served well (a switch, an
        #: unload, a reload), not one replaced for failing its probes.
        self.stop_healthy = True
        self._oom: Callable[[], Optional[int]] = lambda: None
        self._oom_before: Optional[int] = None

    def spawn(self, reactor: IAgentReactor, launcher: Launcher, child: ChildProcess, wrapped: Sequence[str],
              env: Mapping[str, str], argv: List[str], oom_counter: OOMCounter) -> None:
        """Start ``child`` (raises if it cannot be); note its OOM-kill count
        and write its pid file."""
        launcher.spawn(reactor, child, wrapped, env)
        self.child = child
        self._oom = oom_counter(child.pid)
        self._oom_before = self._oom()
        if self._pidfiles is not None and child.pid is not None:
            self._pidfiles.write(self.name, child.pid, argv)

    def watch_load(self, reactor: IAgentReactor, config: NodeConfig, probe: Callable[[], "Deferred[bool]"],
                   on_ready: Callable[[], None], on_timeout: Callable[[str], None]) -> None:
        """Watch the loading child until it is ready or too slow."""
        self.watch = LoadWatch(reactor, config, probe, on_ready, on_timeout)
        self.watch.start()

    def stop_watch(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        self.watch = None

    def watching(self, child: ChildProcess) -> bool:
        """Whether ``child`` is this attempt's and it is still being watched."""
        return child is self.child and self.watch is not None

    def ready(self, now: float) -> float:
        """The child is ready at ``now``: its output is read in batches from
        now on.  Returns its load time (spawn to ready)."""
        self.stop_watch()
        if self.child is not None:
            self.child.serving = True  # its per-request lines are read in batches
        self.ready_at = now
        return now - self.started_at

    def stopping(self, reason: Optional[DeviceState], healthy: bool) -> None:
        """A stop begins: it ends in ``reason`` (None: stopped)."""
        self.stop_watch()
        self.stop_reason = reason
        self.stop_healthy = healthy

    def ended(self, reason: Failure) -> diagnosis.Exit:
        """The child ended (or was never spawned): forget it, remove its pid
        file, and say how it ended -- for a signal, whether the kernel's OOM
        killer sent it."""
        self.stop_watch()
        self.child = None
        if self._pidfiles is not None:
            self._pidfiles.remove(self.name)
        exit = exit_of(reason)
        if exit.signal:
            exit = exit.with_oom_kills(self._oom_before, self._oom())
        return exit
