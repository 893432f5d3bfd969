"""systemd's notify protocol (``Type=notify``), spoken over the datagram
socket directly: no library, no D-Bus.

systemd passes ``NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract
namespace) and, when the unit sets ``WatchdogSec=``, ``WATCHDOG_USEC`` (and
``WATCHDOG_PID``).  The agent sends:

- ``READY=1`` once it listens and preloading has begun, with a ``STATUS=``
  line a person reads in ``systemctl status``;
- ``STATUS=`` again whenever that line changes (devices, models loaded,
  draining, dispatcher);
- ``WATCHDOG=1`` every half ``WATCHDOG_USEC`` from a ``LoopingCall``: it
  only runs while the reactor turns, which is what the watchdog asks;
- ``STOPPING=1`` when the drain begins.

Without ``NOTIFY_SOCKET`` every call is a no-op.  A send that fails is
logged once and never stops the agent.
"""

from __future__ import annotations

import collections
import os
import socket
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from rolemesh.event_loop.reactor import UsesReactor

log = Logger()

#: Seconds between checks whether the STATUS= line changed.
STATUS_INTERVAL_S = 2.0
#: systemd truncates longer STATUS= lines in ``systemctl status`` anyway.
MAX_STATUS_CHARS = 400


def notify_address(environ: Mapping[str, str]) -> Optional[str]:
    """The socket address ``NOTIFY_SOCKET`` names, or None.

    ``@name`` is Linux's abstract namespace (a leading NUL byte); anything
    but an absolute path or ``@name`` is ignored, as sd_notify(3) does.
    """
    value = environ.get("NOTIFY_SOCKET", "")
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def watchdog_interval(environ: Mapping[str, str], pid: int) -> Optional[float]:
    """Seconds between ``WATCHDOG=1`` pings (half the timeout), or None.

    None when ``WATCHDOG_USEC`` is unset or invalid, or when
    ``WATCHDOG_PID`` names another process (the watchdog is not ours).
    """
    raw_pid = environ.get("WATCHDOG_PID")
    if raw_pid is not None and raw_pid.strip() != str(pid):
        return None
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    return usec / 2e6


def message(fields: Sequence[Tuple[str, str]]) -> bytes:
    """``KEY=value`` lines, one datagram; newlines in a value become spaces."""
    lines = []
    for key, value in fields:
        value = " ".join(str(value).split())
        lines.append(f"{key}={value}")
    return "\n".join(lines).encode("utf-8")


def status_line(
    devices: Sequence[Mapping[str, Any]],
    *,
    draining: bool = False,
    dispatcher: Optional[str] = None,
) -> str:
    """The line ``systemctl status`` shows, from ``Node.device_states()``.

    e.g. ``2 devices; gpu:0 ready: qwen (1 in flight); gpu:1 stopped;
    dispatcher registered``.
    """
    parts: List[str] = []
    if draining:
        parts.append("draining")
    parts.append(f"{len(devices)} device{'s' if len(devices) != 1 else ''}")
    for d in devices:
        text = f"{d.get('device')} {d.get('state')}"
        if d.get("model"):
            text += f": {d['model']}"
        busy = (d.get("in_flight") or 0) + (d.get("queued") or 0)
        if busy:
            text += f" ({d.get('in_flight') or 0} in flight, {d.get('queued') or 0} queued)"
        parts.append(text)
    if dispatcher is not None:
        parts.append(f"dispatcher {dispatcher}")
    line = "; ".join(parts)
    if len(line) > MAX_STATUS_CHARS:
        line = line[: MAX_STATUS_CHARS - 3] + "..."
    return line


def _datagram_socket(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    sock.setblocking(False)
    return sock


class SystemdNotifier(UsesReactor[IReactorTime]):
    """Sends the notify messages of a ``Type=notify`` service.

    ``status`` is called for the current STATUS= line (see
    :func:`status_line`); errors in it are logged and skipped.
    """

    def __init__(
        self,
        status: Callable[[], str],
        *,
        environ: Optional[Mapping[str, str]] = None,
        pid: Optional[int] = None,
        reactor: Optional[IReactorTime] = None,
        make_socket: Callable[[str], socket.socket] = _datagram_socket,
        status_interval: float = STATUS_INTERVAL_S,
    ) -> None:
        env = os.environ if environ is None else environ
        self.address = notify_address(env)
        self.watchdog_s = watchdog_interval(env, os.getpid() if pid is None else pid)
        self._status = status
        self._reactor = reactor
        self._make_socket = make_socket
        self._status_interval = status_interval
        self._socket: Optional[socket.socket] = None
        self._last_status: Optional[str] = None
        self._send_failed = False
        self._loops: Dict[str, LoopingCall] = {}
        #: The latest messages sent, newest last (for tests and the curious).
        self.sent: Deque[bytes] = collections.deque(maxlen=64)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    # -- the protocol's moments ---------------------------------------------

    def ready(self) -> None:
        """``READY=1`` with the first STATUS= line; start the watchdog and
        the status updates."""
        if not self.enabled:
            return
        status = self._current_status()
        fields = [("READY", "1")]
        if status is not None:
            self._last_status = status
            fields.append(("STATUS", status))
        self.send(fields)
        self._start("status", self._status_interval, self.update_status)
        if self.watchdog_s is not None:
            self._start("watchdog", self.watchdog_s, self.ping)

    def update_status(self) -> None:
        """Send STATUS= if the line changed since the last one."""
        status = self._current_status()
        if status is not None and status != self._last_status:
            self._last_status = status
            self.send([("STATUS", status)])

    def ping(self) -> None:
        """``WATCHDOG=1``: the reactor is turning."""
        self.send([("WATCHDOG", "1")])

    def stopping(self) -> None:
        """``STOPPING=1`` when the drain begins (the watchdog keeps pinging)."""
        if not self.enabled:
            return
        self._stop("status")
        self.send([("STOPPING", "1"), ("STATUS", "draining: finishing in-flight requests")])

    def close(self) -> None:
        """Stop the loops and close the socket (the last thing at shutdown)."""
        for name in list(self._loops):
            self._stop(name)
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    # -- plumbing -------------------------------------------------------------

    def _current_status(self) -> Optional[str]:
        try:
            return self._status()
        except Exception:
            log.failure("systemd: building the STATUS= line failed")
            return None

    def _start(self, name: str, interval: float, fn: Callable[[], None]) -> None:
        self._stop(name)

        def guarded() -> None:
            try:
                fn()
            except Exception:  # a periodic call never dies of its own error
                log.failure("systemd: {name} update failed", name=name)

        loop = LoopingCall(guarded)
        loop.clock = self.reactor
        self._loops[name] = loop
        loop.start(interval, now=False)

    def _stop(self, name: str) -> None:
        loop = self._loops.pop(name, None)
        if loop is not None and loop.running:
            loop.stop()

    def send(self, fields: Sequence[Tuple[str, str]]) -> bool:
        """Send one datagram; False (logged once) if it could not go."""
        if self.address is None:
            return False
        data = message(fields)
        try:
            if self._socket is None:
                self._socket = self._make_socket(self.address)
            self._socket.sendto(data, self.address)
        except OSError as e:
            if not self._send_failed:
                self._send_failed = True
                log.warn("systemd: cannot notify {address}: {error}",
                         address=self.address.replace("\0", "@"), error=e.strerror or str(e))
            return False
        if self._send_failed:
            self._send_failed = False
            log.info("systemd: notifications go through again")
        self.sent.append(data)
        return True
