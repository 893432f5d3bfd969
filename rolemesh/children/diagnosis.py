"""Why a llama-server child died, in one line a person can act on.

Pure functions: the supervisor hands over how the child ended and the lines
it printed during this attempt; these turn them into a short message (for
the 503 body, the log, inventory and the dispatcher) and a stable code.

A SIGKILL (or SIGTERM, SIGINT, SIGHUP) the agent did not send came from
another process, or, for SIGKILL, from the kernel's out-of-memory killer:
the kernel says which in the cgroup's OOM-kill count (``oom_kill`` in
cgroup v2's ``memory.events``, v1's ``memory.oom_control``), which the
supervisor reads when the child starts and when it ends
(:func:`oom_counter`, the one reader of files here).  The message says the
OOM killer only when that count rose.
"""

from __future__ import annotations

import functools
import os
import re
import signal
from typing import Callable, List, Optional, Sequence

import attr

#: Longest load-failure message put into an error body.
MAX_MESSAGE_CHARS = 300

#: The flag that keeps llama.cpp off its repacked (AMX / AVX-512 tuned)
#: kernels; a child that dies of SIGILL while loading is retried once with it.
SAFE_FLAG = "no-repack"

_SIGNAL_MEANINGS = {
    signal.SIGILL: (
        "illegal instruction — this llama-server build uses CPU instructions this machine cannot run; "
        "install the portable build (scripts/install-llama-server.sh) or set server_args: {no-repack: true}"
    ),
    signal.SIGBUS: "bus error — the model file was changed or truncated while mapped, or its disk failed",
    signal.SIGSEGV: "segmentation fault — a corrupt or unsupported GGUF, or a llama-server bug",
    signal.SIGABRT: "aborted — llama-server hit an internal check (an unsupported model, or out of memory)",
}

#: Signals that only another process (or the kernel) sends a llama-server;
#: the agent's own stops are never diagnosed.
_FROM_OUTSIDE = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
OOM_KILLED = ("the kernel's out-of-memory killer: the cgroup's oom_kill count rose; give it more memory, "
              "or a smaller model or ctx_size")
FROM_ANOTHER_PROCESS = "a signal from another process, not the agent's"
NOT_OOM = "not the kernel's out-of-memory killer, whose oom_kill count in the cgroup did not rise"
OOM_UNKNOWN = "this host's cgroup does not count out-of-memory kills, so see dmesg if memory was short"

#: Codes by signal, for a dispatcher that acts without reading messages.
_SIGNAL_CODES = {signal.SIGILL: "illegal_instruction"}

#: Lines that say what went wrong, most telling first.
_DECISIVE = (
    re.compile(r"error loading model: (.*)", re.IGNORECASE),
    re.compile(r"\berror\b[^:]*: (.*)", re.IGNORECASE),
    re.compile(r"(failed to .*)", re.IGNORECASE),
)
#: llama-server's timestamp and level prefix: ``0.00.005.256 E ``.
_PREFIX = re.compile(r"^\s*[\d.]+ [A-Z] ")


@attr.s(auto_attribs=True, frozen=True)
class Exit:
    """How a child ended: killed by ``signal``, or exited with ``code``."""

    signal: Optional[int] = None
    code: Optional[int] = None
    #: Whether the cgroup's OOM-kill count rose while the child ran (None:
    #: this host's cgroup does not say).
    oom_killed: Optional[bool] = None

    @property
    def how(self) -> str:
        if self.signal:
            try:
                return f"killed by {signal.Signals(self.signal).name}"
            except ValueError:
                return f"killed by signal {self.signal}"
        return f"exited with status {self.code}"

    @property
    def meaning(self) -> Optional[str]:
        if not self.signal:
            return None
        if self.signal in _FROM_OUTSIDE:
            if self.signal != signal.SIGKILL:
                return FROM_ANOTHER_PROCESS
            if self.oom_killed:
                return OOM_KILLED
            return f"{FROM_ANOTHER_PROCESS}; {OOM_UNKNOWN if self.oom_killed is None else NOT_OOM}"
        return _SIGNAL_MEANINGS.get(self.signal)  # type: ignore[call-overload]

    def with_oom_kills(self, before: Optional[int], after: Optional[int]) -> "Exit":
        """This exit with what the cgroup's OOM-kill counts, read when the
        child started and when it ended, say."""
        if before is None or after is None:
            return attr.evolve(self, oom_killed=None)
        return attr.evolve(self, oom_killed=after > before)

    @property
    def is_sigill(self) -> bool:
        return self.signal == signal.SIGILL

    def error_code(self, default: str) -> str:
        return _SIGNAL_CODES.get(self.signal, default) if self.signal else default  # type: ignore[call-overload]


def decisive_line(lines: Sequence[str], path: str = "", model_id: str = "") -> Optional[str]:
    """The one printed line that best says why the load failed, with the
    model's file path shown as its id; None when nothing stands out."""
    cleaned = [_PREFIX.sub("", line).strip() for line in lines if not line.startswith("[rolemesh]")]
    for pattern in _DECISIVE:
        for line in cleaned:
            match = pattern.search(line)
            if match:
                text = match.group(1).strip() or line
                return text.replace(path, model_id) if path else text
    return None


def load_failure(model_id: str, device: str, exit: Exit, lines: Sequence[str], path: str = "") -> str:
    """The one-line, bounded message for a child that ended while loading."""
    message = f"llama-server for model {model_id!r} {exit.how} while loading on {device}"
    if exit.meaning:
        message += f" ({exit.meaning})"
    line = decisive_line(lines, path, model_id)
    if line:
        message += f": {line}"
    return shorten(message)


def shorten(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return message if len(message) <= limit else message[: limit - 1].rstrip() + "…"


# --------------------------------------------------------------------------
# What the kernel counts (the one I/O here)

CGROUP_ROOT = "/sys/fs/cgroup"


def oom_kill_files(cgroup_lines: Sequence[str], root: str = CGROUP_ROOT) -> List[str]:
    """Where a process's cgroup counts OOM kills, most specific first, from
    its ``/proc/PID/cgroup`` lines: v2 ``memory.events``, v1
    ``memory.oom_control`` (each holds an ``oom_kill N`` line)."""
    files: List[str] = []
    for line in cgroup_lines:
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        path = path.lstrip("/")
        if controllers == "":
            files += [os.path.join(root, path, "memory.events"), os.path.join(root, "memory.events")]
        elif "memory" in controllers.split(","):
            files += [os.path.join(root, "memory", path, "memory.oom_control"),
                      os.path.join(root, "memory", "memory.oom_control")]
    return [f.replace("//", "/") for f in files]


def parse_oom_kills(text: str) -> Optional[int]:
    """The ``oom_kill N`` count in a ``memory.events``/``memory.oom_control``."""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0] == "oom_kill" and fields[1].isdigit():
            return int(fields[1])
    return None


def oom_counter(pid: Optional[int], proc: str = "/proc", root: str = CGROUP_ROOT) -> Callable[[], Optional[int]]:
    """A reader of the OOM-kill count of ``pid``'s cgroup (the agent's own
    where the child's cannot be read), found now, while the child runs; it
    returns None where the host does not count them."""
    lines: List[str] = []
    for who in ([str(pid)] if pid else []) + ["self"]:
        try:
            with open(os.path.join(proc, who, "cgroup"), encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
            break
        except OSError:
            continue
    for path in oom_kill_files(lines, root):
        count = _read_count(path)
        if count is not None:
            return functools.partial(_read_count, path)
    return lambda: None


def _read_count(path: str) -> Optional[int]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_oom_kills(f.read())
    except OSError:
        return None
