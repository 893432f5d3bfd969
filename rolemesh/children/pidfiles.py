"""One agent per state folder; pid files of its children, and the sweep
that kills the ones a dead agent left.

:class:`StateDirLock`: an agent holds an advisory lock (``flock``) on
``<state_dir>/agent.lock`` for its lifetime, with its pid and start time in
the file.  A second agent on the same folder -- the default ``state_dir`` is
the same for every agent a user starts -- refuses to start with one line
naming the folder and the owner's pid, instead of sweeping (killing) the
first agent's children as its own leftovers.  The kernel drops the lock when
the owner dies, however it dies.

:class:`PidFiles`: ``PR_SET_PDEATHSIG`` (see :mod:`rolemesh.children.wrapper`)
already kills children of a dead agent on Linux; the pid files are the
second line of defence (other platforms, or a child that was re-parented
before the signal was armed).  Each records the child (pid, start time,
argv) and its owning agent (pid and start time, so a reused pid is not taken
for a live owner); at start-up the agent kills only children whose owner is
gone, after checking that the pid still runs the same command, so a recycled
pid is never hit, and says whose they were.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
from typing import Any, Callable, List, Optional, Sequence

import attr
from twisted.logger import Logger

from rolemesh.base.errors import ConfigError

log = Logger(namespace="rolemesh.pidfiles")

#: The lock file's name inside ``state_dir``.
LOCK_NAME = "agent.lock"


def _cmdline(pid: int) -> Optional[List[str]]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]


def parse_start_time(stat: str) -> Optional[int]:
    """The start time (clock ticks after boot, field 22) in a
    ``/proc/PID/stat`` line; the command name may hold spaces and ``)``."""
    try:
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def start_time(pid: int) -> Optional[int]:
    """When ``pid`` started (clock ticks after boot), None where it does not
    run (or /proc cannot say)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return parse_start_time(f.read())
    except OSError:
        return None


@attr.s(auto_attribs=True, frozen=True)
class Process:
    """A process as a pid and its start time: a pid alone may be reused."""

    pid: int
    start: Optional[int] = None

    @classmethod
    def me(cls, started: Callable[[int], Optional[int]] = start_time) -> "Process":
        return cls(os.getpid(), started(os.getpid()))

    @classmethod
    def from_json(cls, record: Any) -> Optional["Process"]:
        """A ``{"pid": N, "start": T}`` record, else None."""
        try:
            pid = int(record["pid"])
            start = record.get("start")
            return cls(pid, None if start is None else int(start)) if pid > 0 else None
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def to_json(self) -> dict:
        return {"pid": self.pid, "start": self.start}

    def alive(self, started: Callable[[int], Optional[int]] = start_time) -> bool:
        """This very process still runs: its pid exists and, where the start
        time is known, started when recorded."""
        now = started(self.pid)
        return now is not None and (self.start is None or now == self.start)


class StateDirLock:
    """The advisory lock an agent holds on its ``state_dir`` while it runs.

    :meth:`acquire` raises :class:`~rolemesh.base.errors.ConfigError` (one line,
    exit status 2) while another live agent holds it.  A folder that cannot
    be created or written is logged and tolerated, as by :class:`PidFiles`
    (then nothing is swept either).  The descriptor is not inherited by the
    children (Python opens files close-on-exec).
    """

    def __init__(self, state_dir: str, fd: Optional[int]) -> None:
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, LOCK_NAME)
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    @classmethod
    def acquire(
        cls,
        state_dir: str,
        me: Optional[Process] = None,
        flock: Callable[[int, int], None] = fcntl.flock,
    ) -> "StateDirLock":
        path = os.path.join(state_dir, LOCK_NAME)
        try:
            os.makedirs(state_dir, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            log.warn("state directory {directory} cannot hold the agent's lock ({error}); another agent on "
                     "the same state_dir would not be detected", directory=state_dir, error=e.strerror)
            return cls(state_dir, None)
        try:
            flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            owner = _read_owner(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(in_use_message(state_dir, owner)) from None
            log.warn("cannot lock {path} ({error}); another agent on the same state_dir would not be detected",
                     path=path, error=e.strerror)
            return cls(state_dir, None)
        lock = cls(state_dir, fd)
        lock.record(me)
        return lock

    def record(self, me: Optional[Process] = None) -> None:
        """Write the owner (this process) into the lock file: again once
        running, as ``twistd`` without ``-n`` forks after the service is built."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, json.dumps((me or Process.me()).to_json()).encode("ascii"), 0)
        except OSError:
            pass  # the lock is what counts; the pid in it is for the message

    def release(self) -> None:
        """Let the folder go (the kernel also does when the process ends)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def _read_owner(fd: int) -> Optional[Process]:
    try:
        return Process.from_json(json.loads(os.pread(fd, 4096, 0) or b"null"))
    except (OSError, ValueError):
        return None


def in_use_message(state_dir: str, owner: Optional[Process]) -> str:
    """The one line a second agent on the same folder exits with."""
    pid = f"pid {owner.pid}" if owner is not None else "pid unknown"
    return (f"state_dir: {state_dir} is in use by another rolemesh-node-agent ({pid}); "
            "give this agent a state_dir of its own")


class PidFiles:
    """One JSON file per device under ``<state_dir>/children``.

    A state directory that cannot be written is logged once and tolerated:
    losing the second line of defence must not stop the agent from serving.
    """

    def __init__(
        self,
        state_dir: str,
        cmdline: Callable[[int], Optional[List[str]]] = _cmdline,
        kill: Callable[[int, int], None] = os.killpg,
        started: Callable[[int], Optional[int]] = start_time,
        owner: Optional[Process] = None,
    ) -> None:
        self.directory = os.path.join(state_dir, "children")
        self._cmdline = cmdline
        self._kill = kill
        self._started = started
        #: The agent the children written here belong to: this process.
        self.owner = owner if owner is not None else Process.me(started)
        self.writable = True
        self._warned = False

    def _path(self, device: str) -> str:
        return os.path.join(self.directory, device.replace(":", "-") + ".json")

    def _warn(self, error: OSError) -> None:
        self.writable = False
        if not self._warned:
            self._warned = True
            log.warn(
                "state directory {directory} is not writable ({error}); children are still "
                "tied to the agent by PR_SET_PDEATHSIG, but stale ones cannot be swept at next start",
                directory=self.directory,
                error=error.strerror,
            )

    def write(self, device: str, pid: int, argv: Sequence[str]) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            tmp = self._path(device) + ".tmp"
            record = {"pid": pid, "start": self._started(pid), "argv": list(argv), "owner": self.owner.to_json()}
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(record, f)
            os.replace(tmp, self._path(device))
        except OSError as e:
            self._warn(e)

    def remove(self, device: str) -> None:
        try:
            os.unlink(self._path(device))
        except FileNotFoundError:
            pass
        except OSError as e:
            self._warn(e)

    def sweep(self) -> List[int]:
        """Kill children whose agent is gone; return the pids killed.

        A child whose recorded owner still runs is left alone (and its file
        kept): it is another live agent's, whatever folder it wrote to."""
        killed: List[int] = []
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return killed
        except OSError as e:
            self._warn(e)
            return killed
        for name in names:
            path = os.path.join(self.directory, name)
            if not name.endswith(".json"):
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    record = json.load(f)
                child, argv = Process.from_json(record), list(record["argv"])
                owner = Process.from_json(record.get("owner"))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                child, argv, owner = None, [], None
            if owner is not None and owner.alive(self._started):
                log.info("left llama-server pid {pid} alone: its agent, pid {owner}, still runs",
                         pid=child.pid if child else None, owner=owner.pid)
                continue
            if child is not None and argv and self._same_process(child, argv):
                whose = (f"agent pid {owner.pid}, which no longer runs" if owner is not None
                         else "an earlier run (owner not recorded)")
                try:
                    self._kill(child.pid, signal.SIGKILL)
                    killed.append(child.pid)
                    log.warn("killed stale llama-server pid {pid} left by {whose}", pid=child.pid, whose=whose)
                except ProcessLookupError:
                    pass
                except OSError as e:
                    log.warn("cannot kill stale child pid {pid}: {error}", pid=child.pid, error=e.strerror)
            try:
                os.unlink(path)
            except OSError:
                pass
        return killed

    def _same_process(self, child: Process, argv: Sequence[str]) -> bool:
        """The pid still runs the recorded command (and started when recorded)."""
        running = self._cmdline(child.pid)
        if not running or running[: len(argv)] != list(argv):
            return False
        return child.start is None or self._started(child.pid) == child.start
