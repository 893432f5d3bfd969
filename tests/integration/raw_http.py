"""Raw bytes to a listening socket, and the answers read back as they came.

For tests that must send what no HTTP client library would (bare LF, two
Hosts, 300 pipelined requests in one write) and see exactly what the
server did: how many answers, their statuses, whether it closed.
"""

from __future__ import annotations

import socket
import time
from typing import List, Optional, Tuple


class Answers:
    """What came back on one connection."""

    def __init__(self, statuses: List[int], closed: bool, raw: bytes) -> None:
        self.statuses = statuses
        self.closed = closed
        self.raw = raw

    def __repr__(self) -> str:
        return f"Answers(statuses={self.statuses[:20]}{'...' if len(self.statuses) > 20 else ''}, " \
               f"n={len(self.statuses)}, closed={self.closed}, raw={self.raw[:200]!r})"


def split_answers(data: bytes) -> Tuple[List[int], bytes]:
    """The statuses of the whole answers at the front of ``data`` (1xx
    interim answers included) and what is left (an incomplete one)."""
    statuses: List[int] = []
    while True:
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return statuses, data
        head = data[:end].split(b"\r\n")
        try:
            status = int(head[0].split(b" ")[1])
        except (IndexError, ValueError):
            return statuses, data
        fields = {}
        for line in head[1:]:
            name, _, value = line.partition(b":")
            fields[name.strip().lower()] = value.strip()
        rest = data[end + 4:]
        if status < 200 or status in (204, 304):
            length: Optional[int] = 0
        elif fields.get(b"transfer-encoding", b"").lower() == b"chunked":
            length = None
        elif b"content-length" in fields:
            length = int(fields[b"content-length"])
        else:  # to the close
            return statuses + [status], b""
        if length is not None:
            if len(rest) < length:
                return statuses, data
            data = rest[length:]
        else:
            position = 0
            while True:
                line_end = rest.find(b"\r\n", position)
                if line_end < 0:
                    return statuses, data
                size = int(rest[position:line_end].split(b";")[0], 16)
                if size == 0:
                    trailer_end = rest.find(b"\r\n\r\n", line_end)
                    if trailer_end < 0 and rest[line_end + 2:line_end + 4] != b"\r\n":
                        return statuses, data
                    position = line_end + 4 if rest[line_end + 2:line_end + 4] == b"\r\n" else trailer_end + 4
                    break
                if len(rest) < line_end + 2 + size + 2:
                    return statuses, data
                position = line_end + 2 + size + 2
            data = rest[position:]
        statuses.append(status)


def exchange(port: int, data: bytes, *, expect: Optional[int] = None, quiet: float = 0.3,
             limit: float = 15.0, pieces: int = 1, host: str = "127.0.0.1") -> Answers:
    """Send ``data`` (in ``pieces`` writes) and read until the server closes,
    ``expect`` final answers arrived, ``quiet`` seconds pass without a byte,
    or ``limit`` seconds in all."""
    sock = socket.create_connection((host, port), timeout=limit)
    received = b""
    closed = False
    try:
        step = max(1, -(-len(data) // pieces))
        for i in range(0, len(data), step):
            try:
                sock.sendall(data[i:i + step])
            except OSError:  # the server closed already: what it answered is still readable
                break
        deadline = time.monotonic() + limit
        while True:
            now = time.monotonic()
            if now >= deadline:
                break
            statuses, _ = split_answers(received)
            if expect is not None and len([s for s in statuses if s >= 200]) >= expect:
                break
            sock.settimeout(min(quiet, deadline - now))
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                break
            except OSError:  # reset: the server closed with unread input
                closed = True
                break
            if not chunk:
                closed = True
                break
            received += chunk
        if expect is not None and not closed:  # did it close right after? (a short look)
            sock.settimeout(0.2)
            try:
                chunk = sock.recv(65536)
                if not chunk:
                    closed = True
                received += chunk
            except socket.timeout:
                pass
            except OSError:
                closed = True
    finally:
        sock.close()
    statuses, _ = split_answers(received)
    return Answers(statuses, closed, received)


def final(answers: Answers) -> List[int]:
    """The final statuses (1xx left out)."""
    return [s for s in answers.statuses if s >= 200]


__all__ = ["Answers", "exchange", "final", "split_answers"]
