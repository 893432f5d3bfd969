"""The reactor the agent runs on: Twisted's epoll reactor, without the legacy
log context it sets up around every read and write.

Twisted's reactors run each ready socket's ``doRead``/``doWrite`` through
``twisted.python.log.callWithLogger``: the connection's ``logPrefix()``, two
copies of the context dictionary and a push and pop on the context stack,
so that a ``log.msg`` called meanwhile gets the connection as its
``system``.  The agent logs with ``twisted.logger``, whose events never
read that context; for a proxy that wakes up twice per request it cost 6%
of the agent's CPU per request (``bench/capacity.py``, A/B in
docs/performance.md).  :class:`AgentEPollReactor` polls and dispatches the
same way without it.  What changes: a legacy event logged *during* a read
or write (Twisted's own ``log.err`` of a protocol that raised, say) shows
``-`` as its system instead of the connection's prefix; the error itself,
and the dropped connection, are as before.

``rolemesh-node-agent`` installs it (:func:`install`) unless a reactor is
installed already; under twistd it is ``--reactor rolemesh-epoll``.  Where
epoll does not exist, Twisted's default reactor is used.
"""

from __future__ import annotations

import errno
import sys
from typing import Optional

from twisted.python import log

try:
    from twisted.internet.epollreactor import EPollReactor
except ImportError:  # no epoll (not Linux): the default reactor it is
    EPollReactor = None  # type: ignore[assignment,misc]


if EPollReactor is not None:

    class AgentEPollReactor(EPollReactor):  # type: ignore[misc,valid-type]
        """``EPollReactor`` whose dispatch skips the per-event log context."""

        def doPoll(self, timeout: Optional[float]) -> None:  # noqa: N802 - Twisted's name
            if timeout is None:
                timeout = -1  # wait indefinitely
            try:
                events = self._poller.poll(timeout, len(self._selectables))
            except OSError as err:
                if err.errno == errno.EINTR:
                    return
                raise  # a programming error (see epoll_wait(2)): loudly, as Twisted does
            dispatch = self._doReadOrWrite
            for fd, event in events:
                selectable = self._selectables.get(fd)
                if selectable is None:
                    continue
                try:
                    dispatch(selectable, fd, event)  # which catches and logs what doRead/doWrite raise
                except Exception:  # what callWithLogger would have caught: logged, the loop goes on
                    log.err(None, f"dispatching an event of {selectable!r}")

        doIteration = doPoll


def install() -> bool:
    """Install :class:`AgentEPollReactor` as the global reactor; False (and
    nothing done) when a reactor is installed already or epoll is missing."""
    if EPollReactor is None or "twisted.internet.reactor" in sys.modules:
        return False
    from twisted.internet.main import installReactor

    installReactor(AgentEPollReactor())
    return True


__all__ = ["install"] + (["AgentEPollReactor"] if EPollReactor is not None else [])
