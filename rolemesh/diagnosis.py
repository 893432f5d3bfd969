"""Why a llama-server child died, in one line a person can act on.

Pure functions: the supervisor hands over how the child ended and the lines
it printed during this attempt; these turn them into a short message (for
the 503 body, the log, inventory and the dispatcher) and a stable code.
"""

from __future__ import annotations

import re
import signal
from typing import Optional, Sequence

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
    signal.SIGKILL: "killed — often the kernel's out-of-memory killer (see dmesg)",
}

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
        return _SIGNAL_MEANINGS.get(self.signal) if self.signal else None  # type: ignore[call-overload]

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
