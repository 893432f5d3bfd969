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
epoll does not exist (``AgentEPollReactor`` is None), Twisted's default
reactor is used.  The class is a copy of one method of Twisted's, so it
runs only on a Twisted whose ``EPollReactor.doPoll`` is the one it was
compared with (:func:`~rolemesh.twisted_compat.epoll_copy_differs`); on any
other, the agent runs Twisted's own epoll reactor and says so in one log
line.  The class lives in :mod:`rolemesh.twisted_compat`, with the other
uses of Twisted's internals.
"""

from __future__ import annotations

import sys

from twisted.logger import Logger

from rolemesh.twisted_compat import AgentEPollReactor, epoll_copy_differs

log = Logger()


def install() -> bool:
    """Install :class:`AgentEPollReactor` as the global reactor; False (and
    nothing done) when a reactor is installed already or epoll is missing;
    False with Twisted's own epoll reactor installed (and a warning logged)
    when the installed Twisted's loop is not the one the copy was checked
    against."""
    if AgentEPollReactor is None or "twisted.internet.reactor" in sys.modules:
        return False
    from twisted.internet.main import installReactor

    differs = epoll_copy_differs()
    if differs is not None:
        from twisted.internet.epollreactor import EPollReactor

        log.warn("{why}: running Twisted's own epoll reactor instead of the agent's", why=differs)
        installReactor(EPollReactor())
        return False
    installReactor(AgentEPollReactor())
    return True


__all__ = ["AgentEPollReactor", "install"]
