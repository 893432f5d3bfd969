"""The bounds on reading and dropping a refused request's body (a lingering close).

A request refused from its head (401, 404, 413: no key, no route, a body
over the limit) is answered at once, before its body is read.  Closing
then, with the body still arriving, makes the kernel reset the connection,
and a client that sends its whole body before it reads (Python's
``http.client`` and ``urllib``, many others) gets ``ConnectionResetError``
or ``BrokenPipeError`` instead of the answer.  So, as nginx does
(``lingering_close``), the connection goes on reading what the client
sends and drops it, never keeping a byte, until the request's body ends
(then it closes at once) or a bound is reached: :data:`TOTAL_S` in all,
:data:`IDLE_S` without a byte, :func:`max_bytes` read.  A lingering
connection still counts against ``max_connections``.
"""

from __future__ import annotations

from typing import Callable, Optional

from twisted.internet.interfaces import IDelayedCall, IReactorTime

#: Longest a refused request's body is read and dropped (nginx's lingering_time).
TOTAL_S = 30.0
#: Longest wait for the next byte of it (nginx's lingering_timeout).
IDLE_S = 5.0
#: Most bytes read and dropped, unless twice the body limit is more.
MAX_BYTES = 64 << 20


def max_bytes(body_limit: Optional[int]) -> int:
    """The byte bound: :data:`MAX_BYTES`, or twice ``max_request_body_bytes`` when
    that is larger (so a client just over a large limit still hears its 413)."""
    return max(MAX_BYTES, 2 * body_limit) if body_limit else MAX_BYTES


class Linger:
    """One connection's lingering: counts what is read, and calls ``over``
    once, when a time bound passes (:meth:`read` says when the byte bound
    does).  One timer, moved only when it fires."""

    def __init__(self, clock: IReactorTime, over: Callable[[], None], limit_bytes: int) -> None:
        self._clock = clock
        self._over = over
        self._limit_bytes = limit_bytes
        self.started = self.last = clock.seconds()
        self.dropped = 0
        self._call: Optional[IDelayedCall] = clock.callLater(IDLE_S, self._check)

    def read(self, size: int) -> bool:
        """``size`` more bytes were read (and dropped): whether that is past the byte bound."""
        self.last = self._clock.seconds()
        self.dropped += size
        return self.dropped > self._limit_bytes

    def _check(self) -> None:
        self._call = None
        end = min(self.started + TOTAL_S, self.last + IDLE_S)
        left = end - self._clock.seconds()
        if left > 0:
            self._call = self._clock.callLater(left, self._check)
            return
        self._over()

    def cancel(self) -> None:
        if self._call is not None:
            if self._call.active():
                self._call.cancel()
            self._call = None


__all__ = ["IDLE_S", "MAX_BYTES", "TOTAL_S", "Linger", "max_bytes"]
