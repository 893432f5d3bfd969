"""The event loop, in one place: which reactor a part runs on, the reactor
the agent installs, and every Twisted internal the agent relies on.

- :mod:`rolemesh.event_loop.reactor`: the injected reactor, with a lazy
  fall-back to the global one (``resolve_reactor``, ``UsesReactor``); the
  one place library code looks the global reactor up;
- :mod:`rolemesh.event_loop.twisted_compat`: the wrappers of Twisted's
  internals, each checked by ``tests/event_loop/test_twisted_compat.py``, among them
  the agent's reactor class, ``AgentEPollReactor``;
- :func:`install`, here: installs that reactor.  ``rolemesh-node-agent``
  calls it; twistd's ``--reactor rolemesh-epoll`` names this package.

Importing the package (as every user of ``rolemesh.event_loop.reactor``
does) imports nothing more: :func:`install` loads ``twisted_compat`` (and
the logger) when called.

The agent's reactor is Twisted's epoll reactor without the legacy log
context it sets up around every read and write.  Twisted's reactors run
each ready socket's ``doRead``/``doWrite`` through
``twisted.python.log.callWithLogger``: the connection's ``logPrefix()``, two
copies of the context dictionary and a push and pop on the context stack,
so that a ``log.msg`` called meanwhile gets the connection as its
``system``.  The agent logs with ``twisted.logger``, whose events never
read that context; for a proxy that wakes up twice per request it cost 6%
of the agent's CPU per request (``bench/capacity.py``, A/B in
docs/performance.md).  ``AgentEPollReactor`` polls and dispatches the
same way without it.  What changes: a legacy event logged *during* a read
or write (Twisted's own ``log.err`` of a protocol that raised, say) shows
``-`` as its system instead of the connection's prefix; the error itself,
and the dropped connection, are as before.

``rolemesh-node-agent`` installs it (:func:`install`) unless a reactor is
installed already; under twistd it is ``--reactor rolemesh-epoll``.  Where
epoll does not exist (``AgentEPollReactor`` is None), Twisted's default
reactor is used.  The class is a copy of one method of Twisted's, so it
runs only on a Twisted whose ``EPollReactor.doPoll`` is the one it was
compared with (:func:`~rolemesh.event_loop.twisted_compat.epoll_copy_differs`);
on any other, the agent runs Twisted's own epoll reactor and says so in one
log line.
"""

from __future__ import annotations

import sys


def install() -> bool:
    """Install ``AgentEPollReactor`` as the global reactor; False (and
    nothing done) when a reactor is installed already or epoll is missing;
    False with Twisted's own epoll reactor installed (and a warning logged)
    when the installed Twisted's loop is not the one the copy was checked
    against."""
    from rolemesh.event_loop.twisted_compat import AgentEPollReactor, epoll_copy_differs

    if AgentEPollReactor is None or "twisted.internet.reactor" in sys.modules:
        return False
    from twisted.internet.main import installReactor

    differs = epoll_copy_differs()
    if differs is not None:
        from twisted.internet.epollreactor import EPollReactor
        from twisted.logger import Logger

        Logger(namespace=__name__).warn("{why}: running Twisted's own epoll reactor instead of the agent's",
                                        why=differs)
        installReactor(EPollReactor())
        return False
    installReactor(AgentEPollReactor())
    return True


__all__ = ["install"]
