"""Pid files of running children, and the sweep that kills stale ones.

``PR_SET_PDEATHSIG`` (see :mod:`rolemesh.child_exec`) already kills children
of a dead agent on Linux; the pid files are the second line of defence (other
platforms, or a child that was re-parented before the signal was armed): at
start-up the agent kills any process a previous run left behind, after
checking that the pid still runs the same command, so a recycled pid is
never hit.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Callable, List, Optional, Sequence

from twisted.logger import Logger

log = Logger()


def _cmdline(pid: int) -> Optional[List[str]]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]


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
    ) -> None:
        self.directory = os.path.join(state_dir, "children")
        self._cmdline = cmdline
        self._kill = kill
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
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"pid": pid, "argv": list(argv)}, f)
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
        """Kill children left by an earlier run; return the pids killed."""
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
                pid, argv = int(record["pid"]), list(record["argv"])
            except (OSError, ValueError, KeyError, TypeError):
                pid, argv = 0, []
            running = self._cmdline(pid) if pid > 0 else None
            if running and argv and running[: len(argv)] == argv:
                try:
                    self._kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    log.warn("killed stale llama-server pid {pid} left by an earlier run", pid=pid)
                except ProcessLookupError:
                    pass
                except OSError as e:
                    log.warn("cannot kill stale child pid {pid}: {error}", pid=pid, error=e.strerror)
            try:
                os.unlink(path)
            except OSError:
                pass
        return killed
