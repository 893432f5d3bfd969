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
import socket
import textwrap
from typing import Optional

from twisted.internet import tcp
from twisted.internet.interfaces import IProtocolFactory, IReactorTime, ITransport
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


class AgentPort(tcp.Port):
    """A listening TCP port whose accept loop is Twisted's ``Port.doRead``
    without what it builds per wake-up for its rare errors: a buffering
    ``Logger`` (two ``Logger.__get__``), a generator, and, before Twisted 26,
    two ``fcntl`` calls per socket for the close-on-exec flag that Python
    sockets are made with already.  For a client that opens a connection per
    request that is about 8% of the agent's CPU per connection (212 to 196 µs
    for a connection that sends nothing, on the 2-core development machine).

    Every accept that fails for a reason other than "none left" is handed to
    Twisted's own ``doRead``, which accepts again and meets the error as it
    always does (the reserved descriptor for ``EMFILE``, ``EPERM`` from
    netfilter, ...).  The rest is the copied loop: how many accepts per
    wake-up (``numberAccepts``), the IPv6 scope id, a refused connection
    (``buildProtocol`` returning None) closed, session numbers, and any error
    of the protocol logged, not raised into the reactor.  Checked against
    the installed Twisted's ``doRead`` by :func:`epoll_copy_differs`.
    """

    def doRead(self) -> None:  # noqa: N802 - Twisted's name
        try:
            limit = self.numberAccepts
            listener = self.socket
            build = self.factory.buildProtocol  # type: ignore[union-attr]  # None only before it listens
            accepted = 0
            while accepted < limit:
                try:
                    skt, addr = listener.accept()
                except BlockingIOError:
                    break
                except OSError:
                    tcp.Port.doRead(self)  # Twisted's own handling of the error, and its count
                    return
                accepted += 1
                if len(addr) == 4:  # IPv6: with the scope id
                    host = socket.getnameinfo(addr, socket.NI_NUMERICHOST | socket.NI_NUMERICSERV)
                    addr = (host[0], *addr[1:])
                protocol = build(self._buildAddr(addr))
                if protocol is None:
                    skt.close()
                    continue
                session = self.sessionno
                self.sessionno = session + 1
                protocol.makeConnection(self.transport(skt, protocol, addr, self, session, self.reactor))
            self.numberAccepts = limit + 20 if accepted == limit else max(1, accepted)
        except BaseException:
            legacy_log.deferr()


#: SHA-256 of ``tcp.Port.doRead``'s source (dedented) in the Twisted releases
#: :class:`AgentPort` was compared with: 24.3.0 (which also set close-on-exec)
#: and 26.10.0.  Add a release's digest only after reading its doRead against
#: the copy.
CHECKED_PORT_DOREAD = frozenset({
    "89bcd64b6a1fe1554d2ba6e5e7430d22134661447326e47a4f5ddbc77a14be40",
    "e8f68721622251007e895a59b7bdf816e283df87f7805f83bf9795b571050321",
})


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

        def listenTCP(self, port: int, factory: IProtocolFactory, backlog: int = 50,  # noqa: N802 - Twisted's name
                      interface: str = "") -> tcp.Port:
            """Twisted's ``listenTCP``, with :class:`AgentPort` for ``tcp.Port``."""
            listening = AgentPort(port, factory, backlog, interface, self)
            listening.startListening()
            return listening

else:
    AgentEPollReactor = None  # type: ignore[assignment,misc]

#: SHA-256 of ``EPollReactor.doPoll``'s source (dedented) in the Twisted
#: releases :class:`AgentEPollReactor` was compared with: 24.3.0 to 26.10.0
#: (the same text in all of them).  Add a release's digest only after
#: reading its doPoll against the copy above.
CHECKED_DOPOLL = frozenset({"312b649eff9e5e235b9126c3e8c8a2d5178bc277bd5b0fe9e10637d84f5f7092"})


def epoll_copy_differs() -> Optional[str]:
    """Why :class:`AgentEPollReactor` (and the :class:`AgentPort` it listens
    with) must not run on the installed Twisted (its ``EPollReactor.doPoll``
    or ``tcp.Port.doRead`` is not one the copies were compared with), or None."""
    if _EPollReactor is None:
        return "this platform has no epoll"
    for name, method, checked in (("EPollReactor.doPoll", _EPollReactor.doPoll, CHECKED_DOPOLL),
                                  ("tcp.Port.doRead", tcp.Port.doRead, CHECKED_PORT_DOREAD)):
        try:
            source = inspect.getsource(method)
        except (OSError, TypeError):
            return f"the installed Twisted's {name} has no source to compare with"
        if hashlib.sha256(textwrap.dedent(source).encode("utf-8")).hexdigest() not in checked:
            return f"the installed Twisted's {name} is not the one rolemesh's copy was checked against"
    return None
