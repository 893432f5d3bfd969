"""The edge where backends run vendor tools, and the helpers their parsers share.

Discovery runs once at start-up, before the reactor serves anything, so it may
block: :func:`run_sync`.  Metrics are sampled while the agent serves, so they
never block the reactor thread: :func:`run_async` spawns the tool with
``reactor.spawnProcess`` and kills it when it overstays its timeout.  Neither
uses a shell.  A tool that is not on PATH, that hangs or that cannot start is a
:class:`ToolError` whose ``str()`` is one line, never a traceback.

Parsers are pure (text in, records out) and raise :class:`ParseError` on
output they cannot understand, such as a tool that prints an error and exits 0.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import attr
from twisted.internet import error as internet_error
from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from rolemesh.backends import BackendUnavailable
from rolemesh.base.devices import DeviceMetrics, DeviceRef
from rolemesh.base.interfaces import IBackendReactor
from rolemesh.event_loop.reactor import UsesReactor

#: What a tool run gives back: exit status, standard output, standard error.
Result = Tuple[int, str, str]

#: The default time a vendor tool gets before it is killed.
DEFAULT_TIMEOUT_S = 10.0

#: PCI vendor ids the agent knows by name (sysfs, vulkaninfo and friends).
PCI_VENDORS = {
    0x10DE: "NVIDIA",
    0x1002: "AMD",
    0x8086: "Intel",
    0x106B: "Apple",
    0x13B5: "ARM",
    0x5143: "Qualcomm",
    0x10005: "Mesa",
}

MIB = 1024 * 1024


class ToolError(Exception):
    """A vendor tool could not be run, failed or did not finish; ``str()`` is one line."""


class ToolNotFound(ToolError):
    """The tool is not on PATH."""


class ToolTimeout(ToolError):
    """The tool did not finish within its timeout and was killed."""


class ParseError(ValueError):
    """A tool's output was not what its documented format promises; ``str()`` is one line."""


def first_line(text: str, limit: int = 200) -> str:
    """The first non-blank line of ``text``, shortened, for one-line error messages."""
    for line in text.splitlines():
        line = line.strip()
        if line:
            return line if len(line) <= limit else line[: limit - 3] + "..."
    return ""


def tool_environment(base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The environment a tool runs in: ours (or ``base``) with the C locale, so numbers parse."""
    env = dict(os.environ if base is None else base)
    env["LC_ALL"] = "C"
    env["LANG"] = "C"
    return env


def _resolve(argv: Sequence[str], which: Callable[[str], Optional[str]]) -> str:
    if not argv:
        raise ToolError("no command given")
    tool = argv[0]
    path = tool if os.sep in tool else which(tool)
    if not path:
        raise ToolNotFound(f"{tool}: not found on PATH")
    return path


def _decode(data: Any) -> str:
    if isinstance(data, bytes):
        return data.decode("utf-8", errors="replace")
    return data or ""


def run_sync(
    argv: Sequence[str],
    timeout: float = DEFAULT_TIMEOUT_S,
    *,
    which: Callable[[str], Optional[str]] = shutil.which,
    env: Optional[Mapping[str, str]] = None,
    runner: Callable[..., Any] = subprocess.run,
) -> Result:
    """Run a tool to completion (start-up discovery only: it blocks) and return (rc, out, err)."""
    path = _resolve(argv, which)
    try:
        done = runner(
            [path, *argv[1:]],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            timeout=timeout,
            env=tool_environment(env),
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ToolTimeout(f"{argv[0]}: no answer within {timeout:g}s; killed") from None
    except OSError as e:
        raise ToolError(f"{argv[0]}: could not run: {e.strerror or e}") from None
    return done.returncode, _decode(done.stdout), _decode(done.stderr)


class _Collector(ProcessProtocol):
    """Collects a child's output and fires one Deferred when it ends."""

    def __init__(self, tool: str, deferred: "Deferred[Result]") -> None:
        self.tool = tool
        self.deferred = deferred
        self.out: List[bytes] = []
        self.err: List[bytes] = []
        self.timer: Optional[IDelayedCall] = None
        self.timed_out: Optional[float] = None

    def connectionMade(self) -> None:
        if self.transport is not None:
            self.transport.closeStdin()

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        (self.out if childFD == 1 else self.err).append(data)

    def kill(self) -> None:
        if self.transport is None:
            return
        try:
            self.transport.signalProcess("KILL")
        except (internet_error.ProcessExitedAlready, AttributeError, OSError):
            pass

    def on_timeout(self, timeout: float) -> None:
        self.timer = None
        self.timed_out = timeout
        self.kill()

    def stop_timer(self) -> None:
        if self.timer is not None and self.timer.active():
            self.timer.cancel()
        self.timer = None

    def processEnded(self, reason: Failure) -> None:
        self.stop_timer()
        if self.deferred.called:  # cancelled by the caller
            return
        if self.timed_out is not None:
            self.deferred.errback(ToolTimeout(f"{self.tool}: no answer within {self.timed_out:g}s; killed"))
            return
        value = reason.value
        rc = getattr(value, "exitCode", 0)
        if rc is None:  # ended by a signal
            rc = -(getattr(value, "signal", None) or 1)
        self.deferred.callback((rc, _decode(b"".join(self.out)), _decode(b"".join(self.err))))


def run_async(
    reactor: IBackendReactor,
    argv: Sequence[str],
    timeout: float = DEFAULT_TIMEOUT_S,
    *,
    which: Callable[[str], Optional[str]] = shutil.which,
    env: Optional[Mapping[str, str]] = None,
) -> "Deferred[Result]":
    """Spawn a tool on ``reactor`` and fire with (rc, out, err); kill it after ``timeout``."""
    try:
        path = _resolve(argv, which)
    except ToolError as e:
        return fail(e)
    collector: _Collector

    def cancel(d: Deferred) -> None:
        collector.stop_timer()
        collector.kill()

    d: Deferred = Deferred(canceller=cancel)
    collector = _Collector(argv[0], d)
    try:
        reactor.spawnProcess(collector, path, [path, *argv[1:]], env=tool_environment(env))
    except OSError as e:
        return fail(ToolError(f"{argv[0]}: could not start: {e.strerror or e}"))
    collector.timer = reactor.callLater(timeout, collector.on_timeout, timeout)
    return d


def checked(tool: str, result: Result) -> str:
    """The standard output of a run that exited 0; otherwise a ToolError naming the tool."""
    rc, out, err = result
    if rc != 0:
        detail = first_line(err) or first_line(out) or "no output"
        raise ToolError(f"{tool} exited with status {rc}: {detail}")
    return out


# -- shared parsing helpers -------------------------------------------------------------------------

_NUMBER = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)")


def number(value: Any) -> Optional[float]:
    """A tool's figure as a float: ``"[N/A]"``, ``"N/A"``, ``""``, ``"[Not Supported]"`` -> None.

    A trailing unit (``"35.0 C"``) is ignored; ``{"value": v}`` mappings (amd-smi) are unwrapped;
    infinities and NaN are None.
    """
    if isinstance(value, Mapping):
        value = value.get("value")
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        result = float(value)
    else:
        match = _NUMBER.match(str(value))
        if not match:
            return None
        result = float(match.group(1))
    return result if math.isfinite(result) else None


def integer(value: Any, scale: float = 1) -> Optional[int]:
    """:func:`number` times ``scale``, rounded to an int (bytes from MiB and the like)."""
    n = number(value)
    return None if n is None else int(round(n * scale))


def load_json(text: str, tool: str) -> Any:
    """Parse a tool's JSON output, skipping warning lines printed before it."""
    start = min((i for i in (text.find("{"), text.find("[")) if i >= 0), default=-1)
    if start < 0:
        raise ParseError(f"{tool}: expected JSON, got: {first_line(text) or 'no output'}")
    try:
        value, _ = json.JSONDecoder().raw_decode(text[start:])
    except ValueError:
        raise ParseError(f"{tool}: expected JSON, got: {first_line(text) or 'no output'}") from None
    return value


@attr.s(auto_attribs=True, frozen=True)
class Reading:
    """One device's figures as a tool reported them; ``None`` = the tool did not say."""

    index: int
    uuid: Optional[str] = None
    name: Optional[str] = None
    memory_total_bytes: Optional[int] = None
    memory_used_bytes: Optional[int] = None
    memory_free_bytes: Optional[int] = None
    utilization_pct: Optional[float] = None
    temperature_c: Optional[float] = None
    power_w: Optional[float] = None

    def ref(self, backend: str, vendor: str) -> DeviceRef:
        """This reading as the ``gpu:<index>`` device it describes."""
        return DeviceRef(backend=backend, index=self.index, name=f"gpu:{self.index}", uuid=self.uuid,
                         vendor=vendor, model=self.name, memory_total_bytes=self.memory_total_bytes)

    def metrics(self, device: DeviceRef, sampled_at: float) -> DeviceMetrics:
        """This reading as ``device``'s metrics; a missing used/free is derived from the total."""
        total = self.memory_total_bytes if self.memory_total_bytes is not None else device.memory_total_bytes
        used, free = self.memory_used_bytes, self.memory_free_bytes
        if total is not None and used is None and free is not None:
            used = max(0, total - free)
        if total is not None and free is None and used is not None:
            free = max(0, total - used)
        return DeviceMetrics(
            device=device.name,
            sampled_at=sampled_at,
            memory_total_bytes=total,
            memory_used_bytes=used,
            memory_free_bytes=free,
            utilization_pct=self.utilization_pct,
            temperature_c=self.temperature_c,
            power_w=self.power_w,
        )


def missing_metrics(device: DeviceRef, sampled_at: float, why: str) -> DeviceMetrics:
    """A stale record for a device the tool's answer left out (keep the last figures, show ``why``)."""
    return DeviceMetrics(
        device=device.name,
        sampled_at=sampled_at,
        memory_total_bytes=device.memory_total_bytes,
        stale=True,
        error=why,
    )


def match_readings(
    devices: Iterable[DeviceRef],
    readings: Sequence[Reading],
    sampled_at: float,
    tool: str,
    use_uuid: bool = True,
) -> List[DeviceMetrics]:
    """One metrics record per device, in order: matched by uuid when both have one, else by index."""
    by_uuid = {r.uuid: r for r in readings if r.uuid} if use_uuid else {}
    by_index = {r.index: r for r in readings}
    out = []
    for device in devices:
        reading = by_uuid.get(device.uuid) if device.uuid else None
        if reading is None:
            reading = by_index.get(device.index)
        if reading is None:
            out.append(missing_metrics(device, sampled_at, f"{device.name} missing from {tool} output"))
        else:
            out.append(reading.metrics(device, sampled_at))
    return out


class CommandBackend(UsesReactor[IBackendReactor]):
    """Shared plumbing for backends that ask vendor tools: runners, clock and error wording."""

    name = "?"

    def __init__(
        self,
        reactor: Optional[IBackendReactor] = None,
        *,
        run_sync: Callable[..., Result] = run_sync,
        run_async: Callable[..., "Deferred[Result]"] = run_async,
        which: Callable[[str], Optional[str]] = shutil.which,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self._reactor = reactor
        self._run_sync = run_sync
        self._run_async = run_async
        self._which = which
        self._timeout = timeout

    def _clock(self) -> float:
        return float(self.reactor.seconds())

    def _has(self, tool: str) -> bool:
        return bool(self._which(tool))

    def _unavailable(self, why: str) -> BackendUnavailable:
        return BackendUnavailable(f"{self.name}: {why}")

    def _discover_output(self, argv: Sequence[str]) -> str:
        """Run a tool at start-up; any failure becomes BackendUnavailable naming the tool."""
        try:
            return checked(argv[0], self._run_sync(argv, self._timeout))
        except ToolError as e:
            raise self._unavailable(str(e)) from None

    def _sample_output(self, argv: Sequence[str]) -> "Deferred[Any]":
        """Run a tool without blocking; fires with its stdout or fails with a ToolError."""
        d: Deferred[Any] = self._run_async(self.reactor, argv, self._timeout)
        return d.addCallback(lambda result: checked(argv[0], result))


__all__ = [
    "CommandBackend",
    "DEFAULT_TIMEOUT_S",
    "PCI_VENDORS",
    "ParseError",
    "Reading",
    "Result",
    "ToolError",
    "ToolNotFound",
    "ToolTimeout",
    "checked",
    "first_line",
    "integer",
    "load_json",
    "match_readings",
    "missing_metrics",
    "number",
    "run_async",
    "run_sync",
    "tool_environment",
]
