"""One spawn of a device's child, and what the supervisor keeps about it.

A :class:`ChildAttempt` is made for every spawn (a first load, a switch's
target, a retry on another port): the :class:`~rolemesh.children.process.ChildProcess`,
its pid file, the cgroup's OOM-kill count when it started, the
:class:`~rolemesh.children.probes.LoadWatch` while it loads, when it was
started and became ready, and how the stop under way should end.  It is its
child's :class:`~rolemesh.children.process.ChildSink`: it keeps the child's
lines in the device's :class:`~rolemesh.children.process.OutputRing`, logs
those worth logging, hurries or feeds the load watch, and hands the child's
end to the supervisor (``on_end``), which decides what it means.  The
supervisor decides; the attempt only holds and does the mechanics of one
child, so its state is dropped in one piece when the next spawn begins.
Its log lines keep the supervisor's namespace.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from rolemesh.base.interfaces import IAgentReactor
from rolemesh.children import chat_templates, diagnosis
from rolemesh.children.pidfiles import PidFiles
from rolemesh.children.probes import LoadWatch
from rolemesh.children.process import ChildProcess, Launcher, OutputRing, announces_ready, exit_of, to_log
from rolemesh.children.state import DeviceState
from rolemesh.config.file import ModelConfig, NodeConfig

__all__ = ["ChildAttempt", "EndHandler", "OOMCounter", "start_command"]

log = Logger(namespace="rolemesh.supervisor")

#: Finds the reader of a child's cgroup OOM-kill count from its pid.
OOMCounter = Callable[[Optional[int]], Callable[[], Optional[int]]]
#: Told of the end of an attempt's child: ``(attempt, child, reason)``;
#: ``child`` is None for a stop of a child that was never spawned.
EndHandler = Callable[["ChildAttempt", Optional[ChildProcess], Failure], None]


def start_command(launcher: Launcher, model: ModelConfig, port: int, safe_mode: bool, output: OutputRing,
                  device: str) -> Tuple[List[str], Dict[str, str], List[str]]:
    """The command of a spawn of ``model`` on ``port`` (llama-server's argv,
    its environment, the argv to exec), said in the device's output and the
    log, with the model's chat-template warning if it has one."""
    argv, env, wrapped = launcher.command(model, port, safe_mode)
    output.append(f"[rolemesh] starting {model.model_id} on {device}: {' '.join(argv)}")
    output.new_attempt()
    log.info("starting llama-server for {model} on {device} (port {port})",
             model=model.model_id, device=device, port=port)
    template = chat_templates.describe_model(model)
    if template["warning"]:
        log.warn("{model}: {warning}", model=model.model_id, warning=template["warning"], device=device)
    return argv, env, wrapped


class ChildAttempt:
    """One spawned child (or the attempt to spawn it) of ``model_id`` on device ``name``."""

    def __init__(self, name: str, model_id: Optional[str], output: OutputRing, on_end: EndHandler,
                 pidfiles: Optional[PidFiles] = None, started_at: float = 0.0) -> None:
        self.name = name
        self.model_id = model_id
        self._output = output
        self._on_end = on_end
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
        #: The child serves requests (the device is ready): its per-request
        #: lines are not logged.
        self.serving = False
        self._oom: Callable[[], Optional[int]] = lambda: None
        self._oom_before: Optional[int] = None

    def spawn(self, reactor: IAgentReactor, launcher: Launcher, wrapped: Sequence[str], env: Mapping[str, str],
              argv: List[str], oom_counter: OOMCounter) -> ChildProcess:
        """Start the child, this attempt its sink (raises if it cannot be);
        note its OOM-kill count and write its pid file."""
        child = ChildProcess(self, reactor, self.name, launcher.signal_group)
        launcher.spawn(reactor, child, wrapped, env)
        self.child = child
        self._oom = oom_counter(child.pid)
        self._oom_before = self._oom()
        if self._pidfiles is not None and child.pid is not None:
            self._pidfiles.write(self.name, child.pid, argv)
        return child

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
        self.serving = True
        self.ready_at = now
        return now - self.started_at

    def stopping(self, reason: Optional[DeviceState], healthy: bool) -> None:
        """A stop begins: it ends in ``reason`` (None: stopped)."""
        self.stop_watch()
        self.serving = False
        self.stop_reason = reason
        self.stop_healthy = healthy

    def stop(self, why: str, kill_now: bool, grace: float) -> bool:
        """Signal the child to stop: SIGKILL now, or SIGTERM (repeated) and
        SIGKILL after ``grace`` seconds.  False if there is no child to stop."""
        child = self.child
        if child is None:
            return False
        log.info("stopping llama-server on {device}: {why}", device=self.name, why=why)
        child.stop_holding()
        if kill_now:
            child.kill()
        else:
            child.terminate(grace)
        return True

    def ended(self, reason: Failure) -> diagnosis.Exit:
        """The child ended (or was never spawned): forget it, remove its pid
        file, and say how it ended -- for a signal, whether the kernel's OOM
        killer sent it."""
        self.stop_watch()
        self.child = None
        self.serving = False
        if self._pidfiles is not None:
            self._pidfiles.remove(self.name)
        exit = exit_of(reason)
        if exit.signal:
            exit = exit.with_oom_kills(self._oom_before, self._oom())
        return exit

    # -- the ChildSink of its child ---------------------------------------------

    def child_progressed(self, child: ChildProcess) -> None:
        if self.watching(child):
            self.watch.progressed()  # type: ignore[union-attr]

    def child_output(self, child: ChildProcess, fd: int, chunk: bytes) -> None:
        # Every line goes to the ring buffer (the logs endpoint, error tails),
        # as the read came: decoded when someone reads it.
        self._output.add_chunk(chunk)
        logged = to_log(chunk, serving=self.serving)
        if logged:
            for line in logged:
                log.info("{device} {model}: {line}", device=self.name, model=self.model_id, line=line, stream=fd)
        if self.watching(child) and announces_ready(chunk):
            self.watch.poke()  # type: ignore[union-attr]

    def child_ended(self, child: ChildProcess, reason: Failure) -> None:
        self._on_end(self, child, reason)
