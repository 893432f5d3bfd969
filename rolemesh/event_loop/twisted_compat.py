"""Every Twisted internal the agent relies on, in one place.

Twisted has no public API for these facts; each wrapper says why it is
needed.  ``tests/event_loop/test_twisted_compat.py`` checks each against the installed
Twisted, so a release that renames one fails those tests loudly instead of
the agent quietly doing the wrong thing.  Everything else in the agent uses
public Twisted API only (``tox -e oldest,newest`` runs the tests on both
ends of the supported range).
"""

from __future__ import annotations

import errno
import hashlib
import inspect
import textwrap
from typing import Optional

from twisted.internet import tcp
from twisted.internet.interfaces import IReactorTime, ITransport
from twisted.python import log as legacy_log
from twisted.python.failure import Failure
from twisted.web._newclient import RequestNotSent  # not in twisted.web.client.__all__
from twisted.web.client import HTTPConnectionPool, RequestTransmissionFailed, ResponseNeverReceived

from rolemesh.base.interfaces import ProxiedRequest

#: Failures of an HTTP request that llama-server cannot have acted on: the
#: request was not sent, or not completely, or the connection closed before
#: any byte of an answer (the three Twisted's own retrying client checks).
NEVER_SENT = (RequestNotSent, RequestTransmissionFailed, ResponseNeverReceived)


def never_sent(failure: Failure) -> bool:
    """True when the request failed before the server could act on it."""
    return bool(failure.check(*NEVER_SENT))


def client_disconnected(request: ProxiedRequest) -> bool:
    """True once the client of a ``twisted.web`` (or fast channel) request has gone.

    ``Request`` records a lost connection only in ``_disconnected``;
    ``notifyFinish()`` cannot tell afterwards (a Deferred asked for after
    the loss never fires).
    """
    own = getattr(request, "disconnected", None)  # the fast channel's requests say it publicly
    if own is not None:
        return bool(own)
    return bool(getattr(request, "_disconnected", False))


def quiet_connection_pool(reactor: IReactorTime, persistent: bool) -> HTTPConnectionPool:
    """A connection pool whose connections do not log "Starting factory" /
    "Stopping factory": the pool builds one client factory per connection
    from its private ``_factory`` class, which logs by default."""
    pool = HTTPConnectionPool(reactor, persistent=persistent)
    factory = getattr(pool, "_factory", None)
    if isinstance(factory, type):
        quiet = type("QuietHTTP11ClientFactory", (factory,), {"noisy": False})
        pool._factory = quiet  # type: ignore[assignment]  # a subclass of it, which the checker cannot see
    return pool


_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR, errno.ENOBUFS)


def write_now(transport: ITransport, data: bytes) -> None:
    """``transport.write(data)``, sent at once when nothing waits ahead of it.

    Twisted's TCP transport queues every write and sends it on the next
    reactor iteration, once ``epoll`` says the socket is writable: for each
    answer a wake-up and two ``epoll_ctl`` calls (measured in
    ``bench/capacity.py``: about a fifth of the agent's CPU per request).
    On a plain, connected TCP transport with an empty buffer (``dataBuffer``,
    ``_tempDataBuffer``: FileDescriptor's private queue) that is not being
    closed or aborted (``_aborting``: an aborted connection must drop what
    is written after the abort, as Twisted's own write does), the bytes go to
    ``send`` now; whatever the kernel does not take, and every other
    transport (TLS, tests' fakes), goes through ``transport.write`` as usual,
    so ordering, producers and errors stay Twisted's.
    """
    if (type(transport) in _PLAIN_TCP and transport.connected and not transport.disconnecting  # type: ignore[attr-defined]
            and not transport.TLS and not transport._writeDisconnected and not transport._aborting  # type: ignore[attr-defined]
            and not transport.dataBuffer and not transport._tempDataBuffer):  # type: ignore[attr-defined]
        try:
            sent = transport.socket.send(data)  # type: ignore[attr-defined]
        except OSError as e:
            if e.errno not in _AGAIN:
                transport.write(data)  # Twisted meets the error on its own send and closes
                return
            sent = 0
        if sent == len(data):
            return
        data = data[sent:]
    transport.write(data)


#: The transports :func:`write_now` writes to directly: TCP connections, accepted and made.
_PLAIN_TCP = frozenset({tcp.Server, tcp.Client})


def write_pending(transport: ITransport) -> bool:
    """True while bytes written to ``transport`` still wait in Twisted's own
    buffer (``dataBuffer`` past ``offset``, ``_tempDataBuffer``: what
    :func:`write_now` checks), not yet handed to the kernel.  A kept-alive
    client connection whose request is not all out must not carry the next
    request: the server would read it as the rest of this one.  A transport
    without that buffer has nothing pending."""
    data = getattr(transport, "dataBuffer", b"")
    return len(data) > getattr(transport, "offset", 0) or bool(getattr(transport, "_tempDataBuffer", None))


try:
    from twisted.internet.epollreactor import EPollReactor as _EPollReactor
except ImportError:  # no epoll (not Linux)
    _EPollReactor = None  # type: ignore[assignment,misc]

if _EPollReactor is not None:

    class AgentEPollReactor(_EPollReactor):  # type: ignore[misc,valid-type]
        """``EPollReactor`` whose dispatch skips the per-event legacy log
        context (see :mod:`rolemesh.event_loop`): Twisted's ``doPoll`` with
        ``_doReadOrWrite`` called directly instead of through
        ``log.callWithLogger`` (checked against the installed Twisted's by
        ``tests/event_loop/test_twisted_compat.py``)."""

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
                    legacy_log.err(None, f"dispatching an event of {selectable!r}")

        doIteration = doPoll

else:
    AgentEPollReactor = None  # type: ignore[assignment,misc]

#: SHA-256 of ``EPollReactor.doPoll``'s source (dedented) in the Twisted
#: releases :class:`AgentEPollReactor` was compared with: 24.3.0 to 26.10.0
#: (the same text in all of them).  Add a release's digest only after
#: reading its doPoll against the copy above.
CHECKED_DOPOLL = frozenset({"312b649eff9e5e235b9126c3e8c8a2d5178bc277bd5b0fe9e10637d84f5f7092"})


def epoll_copy_differs() -> Optional[str]:
    """Why :class:`AgentEPollReactor` must not run on the installed Twisted
    (its ``doPoll`` is not one the copy was compared with), or None."""
    if _EPollReactor is None:
        return "this platform has no epoll"
    try:
        source = inspect.getsource(_EPollReactor.doPoll)
    except (OSError, TypeError):
        return "the installed Twisted's EPollReactor.doPoll has no source to compare with"
    if hashlib.sha256(textwrap.dedent(source).encode("utf-8")).hexdigest() not in CHECKED_DOPOLL:
        return "the installed Twisted's EPollReactor.doPoll is not the one rolemesh's copy was checked against"
    return None
