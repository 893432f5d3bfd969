"""One llama-server child as a process: how it is started, its output, its end.

The mechanism under :class:`~rolemesh.children.supervisor.DeviceSupervisor`:

* :class:`Launcher` builds a child's command line and environment (pinning,
  port, the exec wrapper) and spawns it;
* :class:`ChildProcess` is the ProcessProtocol of one spawned child: it splits
  the output into lines (while the child serves, reading its pipes in
  batches: see OUTPUT_HOLD_S), signals the child's process group (SIGTERM
  repeated until the grace is over, then SIGKILL) and reports to its
  :class:`ChildSink` -- the supervisor, which decides what any of it means;
* :class:`OutputRing` keeps the device's last lines (the logs endpoint, error
  tails) and knows which of them belong to the current start attempt.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import socket
import sys
from typing import Callable, Deque, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

import attr
from twisted.internet.interfaces import IDelayedCall, IProcessTransport, IReactorProcess, IReactorTime
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from rolemesh.backends.groups import pin_child
from rolemesh.base.devices import DeviceRef
from rolemesh.base.interfaces import IDeviceBackend
from rolemesh.children import diagnosis
from rolemesh.children.llama_args import build_argv
from rolemesh.config.file import ModelConfig
from rolemesh.config.vertex_ai import child_environment

log = Logger(namespace="rolemesh.child_process")

#: Lines of child output kept per device, for errors and the logs endpoint.
LOG_LINES = 1000
#: Lines of one start attempt kept for its failure message.
ATTEMPT_LINES = 200
#: A line longer than this without a newline is kept in pieces (bounded memory).
RUNAWAY_LINE = 8192
#: While stopping, SIGTERM is repeated this often until the grace is over.
TERM_REPEAT_S = 0.25
#: While the child serves, its pipes rest up to this long once they are
#: drained, so the lines llama-server prints for many requests arrive in one
#: read: one reactor wake-up instead of three or four per request (issue 16).
OUTPUT_HOLD_S = 0.1
#: The shortest rest (a child printing very fast).
MIN_HOLD_S = 0.005
#: What one rest should let pile up: a quarter of Linux's default 64 KiB
#: pipe, so a child that prints fast never blocks on a full pipe (each rest
#: is sized from the last one's batch: :func:`next_hold`).
BATCH_BYTES = 16 * 1024
#: A read this big filled Twisted's read buffer (``fdesc.readFromFD`` reads
#: 8 KiB at most): more is waiting, so reading goes on at once.
LARGE_READ = 8192
#: Output that means the child is about to answer; it triggers a probe at once.
_READY_HINTS = (b"listening on http", b"model loaded", b"all slots are idle")
#: llama-server's error lines (``0.00.005.256 E srv ...``) and crashes.  Its
#: warnings are mostly per-request noise (prompt-cache notes); they stay in
#: the ring buffer that the logs endpoint serves.
_IMPORTANT = re.compile(rb"^\s*[\d.]+ E |error|failed|assert|abort", re.IGNORECASE)

CHILD_EXEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wrapper.py")


def announces_ready(text: bytes) -> bool:
    """A line (or a read of lines) says the child is about to answer (probe
    now, don't wait)."""
    return any(hint in text for hint in _READY_HINTS)


#: What every match of _IMPORTANT contains, lower-cased: the prefilter of a
#: whole read (it can say yes when no line matches, never no when one does;
#: six times faster than the regex over the read).
_IMPORTANT_PARTS = (b" e ", b"error", b"failed", b"assert", b"abort")


def to_log(chunk: bytes, serving: bool) -> List[str]:
    """The lines of one read (``chunk``: joined by newlines) that go to the
    log (see :func:`worth_logging`), decoded; from a serving child, the read
    is looked at once, and split only if it may hold an error line."""
    if serving:
        low = chunk.lower()
        if not any(part in low for part in _IMPORTANT_PARTS):
            return []
    return [line.decode("utf-8", "replace") for line in chunk.split(b"\n") if worth_logging(line, serving)]


def worth_logging(line: bytes, serving: bool) -> bool:
    """Every line of a start and a stop goes to the log, but from a serving
    child only errors: llama-server prints ~9 lines per request, and logging
    each costs more CPU than relaying the request."""
    return not serving or bool(_IMPORTANT.search(line))


def next_hold(hold: float, batch: int) -> float:
    """The next rest of a serving child's pipes, from the last one (``hold``
    seconds, after which ``batch`` bytes were read): as long as the child
    takes to print about BATCH_BYTES, within [MIN_HOLD_S, OUTPUT_HOLD_S]."""
    if batch <= 0:
        return OUTPUT_HOLD_S
    return min(OUTPUT_HOLD_S, max(MIN_HOLD_S, hold * BATCH_BYTES / batch))


def exit_of(reason: Failure) -> diagnosis.Exit:
    """How a child ended, from ``processEnded``'s reason."""
    return diagnosis.Exit(getattr(reason.value, "signal", None), getattr(reason.value, "exitCode", None))


def pick_free_port(host: str = "127.0.0.1") -> int:
    """Ask the kernel for a free TCP port (the child binds it a moment later;
    a collision in between is detected from the child's output and retried)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def wrap_argv(argv: List[str], parent_pid: int, cpus: Tuple[int, ...] = ()) -> List[str]:
    """Prefix ``argv`` with the exec wrapper (new process group, parent-death
    signal, core pinning)."""
    wrapper = [sys.executable, "-S", "-E", CHILD_EXEC, "--parent", str(parent_pid)]
    if cpus:
        wrapper += ["--cpus", ",".join(str(c) for c in cpus)]
    return wrapper + ["--"] + list(argv)


class OutputRing:
    """The device's last ``size`` output lines, across children; the lines
    since :meth:`new_attempt` (at most ``attempt_size``) are the current
    start attempt's, for its failure message.

    A read of a child's output is kept as it came, one chunk of lines
    (:meth:`add_chunk`), and decoded and split only when someone asks for
    lines: a serving llama-server prints ~10 lines per request that nearly
    nobody reads, and splitting and decoding each read cost 6% of the
    agent's CPU per request (docs/performance.md)."""

    def __init__(self, size: int = LOG_LINES, attempt_size: int = ATTEMPT_LINES) -> None:
        self._size = size
        self._attempt_size = attempt_size
        #: Oldest first: a line (str), or a chunk of lines (bytes joined by
        #: newlines), with its count of lines.
        self._entries: Deque[Tuple[object, int]] = collections.deque()
        self._held = 0
        self._appended = 0
        self._attempt_from = 0

    def append(self, text: str) -> None:
        self._add(text, text.count("\n") + 1)

    def add_chunk(self, chunk: bytes) -> None:
        """The complete lines of one read, joined by newlines (UTF-8, or
        anything: decoded with replacement when read)."""
        self._add(chunk, chunk.count(b"\n") + 1)

    def _add(self, entry: object, count: int) -> None:
        entries = self._entries
        entries.append((entry, count))
        self._held += count
        self._appended += count
        while self._held - entries[0][1] >= self._size:  # the oldest entry is no longer needed
            self._held -= entries.popleft()[1]

    @property
    def lines(self) -> List[str]:
        """The last ``size`` lines, oldest first."""
        return self.tail(self._size)

    def new_attempt(self) -> None:
        """Lines from now on belong to a new start attempt."""
        self._attempt_from = self._appended

    def tail(self, count: int) -> List[str]:
        """The last ``count`` lines (at most ``size``), oldest first."""
        count = min(count, self._size, self._held)
        if count <= 0:
            return []
        out: List[str] = []
        taken = 0
        for entry, lines in reversed(self._entries):  # only the newest entries that hold them
            out.append(entry if isinstance(entry, str) else entry.decode("utf-8", "replace"))  # type: ignore[attr-defined]
            taken += lines
            if taken >= count:
                break
        return "\n".join(reversed(out)).split("\n")[-count:]

    def attempt(self) -> List[str]:
        """The current start attempt's lines (its last ``attempt_size``)."""
        return self.tail(min(self._appended - self._attempt_from, self._attempt_size))


class ChildSink(Protocol):
    """What a :class:`ChildProcess` reports to (the supervisor)."""

    def child_progressed(self, child: "ChildProcess") -> None:
        """The child printed something (even half a line)."""

    def child_output(self, child: "ChildProcess", fd: int, chunk: bytes) -> None:
        """The complete lines of one read of the child's stdout (1) or stderr
        (2), joined by newlines, without the last one (one call per read: a
        serving child prints ~10 lines per request)."""

    def child_ended(self, child: "ChildProcess", reason: Failure) -> None:
        """The child has exited and its pipes are closed."""


class ChildProcess(ProcessProtocol):
    """One spawned child: drains its output line by line, signals it, and
    reports its end.  Its timers never outlive it."""

    transport: Optional[IProcessTransport]

    def __init__(self, sink: ChildSink, clock: IReactorTime, name: str,
                 signal_group: Callable[[int, int], None] = os.killpg) -> None:
        self._sink = sink
        self._clock = clock
        self._name = name
        self._signal_group = signal_group
        self._partial: Dict[int, bytes] = {1: b"", 2: b""}
        self._kill_timer: Optional[IDelayedCall] = None
        #: Resumes reading after a hold (see OUTPUT_HOLD_S); None when reading.
        self._resume: Optional[IDelayedCall] = None
        #: The length of the next hold, and the bytes read since the last one
        #: ended (None: no hold since the pipes were last drained).
        self._hold_s = OUTPUT_HOLD_S
        self._batch: Optional[int] = None
        #: The child serves requests: its output is read in batches.
        self.serving = False
        self._term_deadline = 0.0
        self._grace = 0.0
        self.pid: Optional[int] = None
        self.ended = False
        #: The agent asked it to stop (SIGTERM or SIGKILL): how it then ends,
        #: whatever its exit status, is the end that was asked for.
        self.asked_to_stop = False

    # -- output and end ----------------------------------------------------------

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        self._sink.child_progressed(self)
        buffered = self._partial.get(childFD, b"") + data
        end = buffered.rfind(b"\n")
        chunk: Optional[bytes] = buffered[:end] if end >= 0 else None
        rest = buffered[end + 1:]
        if len(rest) > RUNAWAY_LINE:  # a runaway line: keep it, bounded
            chunk = rest if chunk is None else chunk + b"\n" + rest
            rest = b""
        self._partial[childFD] = rest
        if chunk is not None:
            if b"\r" in chunk:
                chunk = b"\n".join(line.rstrip(b"\r") for line in chunk.split(b"\n"))
            self._sink.child_output(self, childFD, chunk)
        if self.serving and not self.ended:
            self._batched(len(data))

    def _batched(self, size: int) -> None:
        """A serving child's read: once its pipes are drained (a read short of
        LARGE_READ), rest them, for as long as the last batch says."""
        if self._batch is not None:
            self._batch += size
        if size >= LARGE_READ:
            return
        if self._batch is not None:
            self._hold_s = next_hold(self._hold_s, self._batch)
            self._batch = None
        self._hold()

    def _hold(self) -> None:
        """Stop reading the pipes for the hold (OUTPUT_HOLD_S at most: the end
        of the child -- processEnded waits for its pipes to close -- is seen
        at most that much later)."""
        if self._resume is not None:
            return
        pause = getattr(self.transport, "pauseProducing", None)
        if pause is None:  # a transport without flow control: read as it comes
            return
        pause()
        self._resume = self._clock.callLater(self._hold_s, self._read_again)

    def _read_again(self) -> None:
        self._resume = None
        self._batch = 0
        if self.transport is not None and not self.ended:
            self.transport.resumeProducing()  # type: ignore[attr-defined]

    def stop_holding(self) -> None:
        """Read as output comes from now on (the child is being stopped, so
        its last words and its end are not held back)."""
        self.serving = False
        if self._resume is not None and self._resume.active():
            self._resume.cancel()
            self._read_again()
        self._resume = None

    def processEnded(self, reason: Failure) -> None:
        self.ended = True
        self.serving = False
        self._cancel_kill_timer()
        if self._resume is not None and self._resume.active():
            self._resume.cancel()
        self._resume = None
        for fd, rest in self._partial.items():
            if rest:
                self._sink.child_output(self, fd, rest)
        self._sink.child_ended(self, reason)

    # -- stopping ---------------------------------------------------------------------

    def signal(self, sig: int) -> None:
        """Signal the child's process group (the exec wrapper made it a leader)."""
        if self.pid is None or self.ended:
            return
        try:
            self._signal_group(self.pid, sig)
        except ProcessLookupError:
            pass
        except OSError as e:
            log.warn("cannot signal llama-server pid {pid}: {error}", pid=self.pid, error=e.strerror)

    def kill(self) -> None:
        self.asked_to_stop = True
        self.signal(signal.SIGKILL)

    def terminate(self, grace: float) -> None:
        """SIGTERM, repeated every TERM_REPEAT_S until ``grace`` is over, then
        SIGKILL: a child that has just become ready sometimes misses the first."""
        self.asked_to_stop = True
        self.signal(signal.SIGTERM)
        self._term_deadline = self._clock.seconds() + grace
        self._grace = grace
        self._kill_timer = self._clock.callLater(min(TERM_REPEAT_S, grace), self._terminate_again)

    def _terminate_again(self) -> None:
        self._kill_timer = None
        remaining = self._term_deadline - self._clock.seconds()
        if remaining <= 1e-9:
            log.warn("llama-server on {device} ignored SIGTERM for {grace:g}s; sending SIGKILL",
                     device=self._name, grace=self._grace)
            self.kill()
            return
        self.signal(signal.SIGTERM)
        self._kill_timer = self._clock.callLater(min(TERM_REPEAT_S, remaining), self._terminate_again)

    def _cancel_kill_timer(self) -> None:
        if self._kill_timer is not None and self._kill_timer.active():
            self._kill_timer.cancel()
        self._kill_timer = None


@attr.s(auto_attribs=True, frozen=True)
class Launcher:
    """How one device's children are started: the binary, the devices they
    are pinned to, the port, the environment and the exec wrapper."""

    binary: str
    backend: IDeviceBackend
    members: Tuple[DeviceRef, ...]
    pick_port: Callable[[], int] = pick_free_port
    environ: Optional[Mapping[str, str]] = None
    wrap: Callable[[List[str], int, Tuple[int, ...]], List[str]] = wrap_argv
    signal_group: Callable[[int, int], None] = os.killpg

    def command(self, model: ModelConfig, port: int, safe_mode: bool) -> Tuple[List[str], Dict[str, str], List[str]]:
        """llama-server's argv, its environment, and the argv to exec (wrapped)."""
        base = os.environ if self.environ is None else self.environ
        defaults, env, cpus = pin_child(self.backend, self.members, base)
        env = child_environment(env, port)  # its own /predict (rolemesh.config.vertex_ai), never our AIP_* port
        argv = build_argv(self.binary, model, port, device_defaults=defaults)
        if safe_mode:
            argv.append("--" + diagnosis.SAFE_FLAG)
        return argv, env, self.wrap(argv, os.getpid(), cpus)

    def spawn(self, reactor: IReactorProcess, child: ChildProcess, wrapped: Sequence[str],
              env: Mapping[str, str]) -> IProcessTransport:
        """Start the child; its pid is known when this returns."""
        transport = reactor.spawnProcess(child, wrapped[0], list(wrapped), env=env)
        child.pid = transport.pid
        return transport
