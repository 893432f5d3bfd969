"""rolemesh.event_loop.twisted_compat against the installed Twisted: each internal the
agent relies on still behaves as the wrapper assumes.  A Twisted release that
changes one fails here, loudly, naming it."""

from __future__ import annotations

import os
import re
import socket
from typing import Any, List

from twisted.internet import defer, tcp
from twisted.internet.error import CannotListenError, ConnectionLost
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from twisted.trial.unittest import SkipTest, SynchronousTestCase
from twisted.web._newclient import HTTP11ClientProtocol
from twisted.web._newclient import Request as ClientRequest
from twisted.web.http_headers import Headers
from twisted.web.resource import Resource
from twisted.web.server import Request as ServerRequest
from twisted.web.test.requesthelper import DummyChannel

import rolemesh
from rolemesh.event_loop.twisted_compat import (
    NEVER_SENT,
    client_disconnected,
    never_sent,
    quiet_connection_pool,
    write_now,
    write_pending,
)
from rolemesh.http.listener import EndpointListener, GuardedSite, listening_service

PACKAGE = os.path.dirname(os.path.abspath(rolemesh.__file__))
#: Private Twisted names the agent once used outside the wrapper module.
PRIVATE = re.compile(r"\btwisted(\.\w+)*\._\w+|(?<!\w)(_handlingRequest|_disconnected|_waitingForPort"
                     r"|_raiseSynchronously|_StandardEndpointFactory)\b|pool\._factory")


def failure_of(d: "defer.Deferred[Any]") -> Failure:
    out: List[Any] = []
    d.addBoth(out.append)
    assert out and isinstance(out[0], Failure), out
    return out[0]


class NeverSentTests(SynchronousTestCase):
    """The failures HTTP11ClientProtocol reports for a request that the
    server cannot have acted on are the ones never_sent() knows."""

    def request(self) -> ClientRequest:
        return ClientRequest(b"POST", b"/v1/chat/completions", Headers({b"host": [b"child"]}), None)

    def test_a_second_request_on_a_busy_connection_is_not_sent(self) -> None:
        protocol = HTTP11ClientProtocol()
        protocol.makeConnection(StringTransport())
        protocol.request(self.request())
        failure = failure_of(protocol.request(self.request()))
        self.assertTrue(never_sent(failure), failure)

    def test_a_connection_lost_before_any_answer(self) -> None:
        protocol = HTTP11ClientProtocol()
        protocol.makeConnection(StringTransport())
        d = protocol.request(self.request())
        protocol.connectionLost(Failure(ConnectionLost()))
        failure = failure_of(d)
        self.assertTrue(never_sent(failure), failure)

    def test_a_connection_lost_mid_answer_is_not_never_sent(self) -> None:
        protocol = HTTP11ClientProtocol()
        protocol.makeConnection(StringTransport())
        d = protocol.request(self.request())
        protocol.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        response: List[Any] = []
        d.addBoth(response.append)
        self.assertEqual(response[0].code, 200)
        self.assertFalse(never_sent(Failure(ConnectionLost())))

    def test_the_classes_are_exceptions(self) -> None:
        for cls in NEVER_SENT:
            self.assertTrue(issubclass(cls, Exception), cls)


class ClientDisconnectedTests(SynchronousTestCase):
    def test_a_request_whose_client_left(self) -> None:
        request = ServerRequest(DummyChannel())
        self.assertFalse(client_disconnected(request))
        request.connectionLost(Failure(ConnectionLost()))
        self.assertTrue(client_disconnected(request), "Request no longer records a lost client in _disconnected")

    def test_a_finished_request_is_not_disconnected(self) -> None:
        request = ServerRequest(DummyChannel())
        request.finish()
        self.assertFalse(client_disconnected(request))


class QuietPoolTests(SynchronousTestCase):
    def test_connections_are_built_by_a_quiet_factory(self) -> None:
        factories: List[Any] = []

        class Endpoint:
            def connect(self, factory: Any) -> "defer.Deferred[Any]":
                factories.append(factory)
                return defer.Deferred()

        pool = quiet_connection_pool(MemoryReactorClock(), persistent=True)
        pool.getConnection(("http", b"127.0.0.1", 8080), Endpoint())
        self.assertEqual(len(factories), 1, "HTTPConnectionPool no longer connects through endpoint.connect")
        self.assertFalse(factories[0].noisy, "HTTPConnectionPool no longer builds connections from _factory")


class PublicListenerTests(SynchronousTestCase):
    """EndpointListener replaces TCPServer._port and StreamServerEndpointService's
    private attributes with public API."""

    def site(self, reactor: Any) -> GuardedSite:
        return GuardedSite(Resource(), reactor=reactor)

    def test_port_is_public_and_cleared_on_stop(self) -> None:
        reactor = MemoryReactorClock()
        service = listening_service(self.site(reactor), hosts=["127.0.0.1"], port=8080, reactor=reactor)
        self.assertIsInstance(service, EndpointListener)
        service.startService()
        self.assertEqual((reactor.tcpServers[0][0], reactor.tcpServers[0][3]), (8080, "127.0.0.1"))
        self.assertEqual(service.port.getHost().port, 8080)
        service.stopService()
        self.assertIsNone(service.port)

    def test_several_addresses_share_one_port(self) -> None:
        reactor = MemoryReactorClock()
        service = listening_service(self.site(reactor), hosts=["127.0.0.1", "::1"], port=8080, reactor=reactor)
        service.privilegedStartService()
        service.startService()
        self.assertEqual([(s[0], s[3]) for s in reactor.tcpServers], [(8080, "127.0.0.1"), (8080, "::1")])
        self.assertEqual(service.port.getHost().port, 8080)
        self.successResultOf(service.stopService())
        self.assertEqual((service.port, service.listeners), (None, []))

    def test_an_address_that_cannot_be_had_closes_the_others(self) -> None:
        stopped: List[str] = []

        class Port:
            def __init__(self, interface: str) -> None:
                self.interface = interface

            def stopListening(self) -> None:  # noqa: N802 - Twisted's name
                stopped.append(self.interface)

        class SecondTaken(MemoryReactorClock):
            def listenTCP(self, port: int, factory: Any, backlog: int = 50, interface: str = "") -> Any:  # noqa: N802
                if interface == "::1":
                    raise CannotListenError(interface, port, OSError("address in use"))
                return Port(interface)

        reactor = SecondTaken()
        service = listening_service(self.site(reactor), hosts=["127.0.0.1", "::1"], port=8080, reactor=reactor)
        self.assertRaises(CannotListenError, service.privilegedStartService)
        self.assertEqual((service.port, stopped), (None, ["127.0.0.1"]))  # all or none

    def test_privileged_start_listens_once(self) -> None:
        reactor = MemoryReactorClock()
        service = listening_service(self.site(reactor), hosts=["::"], port=8080, reactor=reactor)
        service.privilegedStartService()
        service.startService()
        self.assertEqual(len(reactor.tcpServers), 1)
        self.assertEqual(reactor.tcpServers[0][3], "::")

    def test_a_port_that_cannot_be_had_fails_start_up(self) -> None:
        class Taken:
            def listen(self, factory: Any) -> "defer.Deferred[Any]":
                return defer.fail(CannotListenError("127.0.0.1", 8080, OSError("address in use")))

        service = EndpointListener(Taken(), self.site(MemoryReactorClock()))
        self.assertRaises(CannotListenError, service.privilegedStartService)
        self.assertIsNone(service.port)

    def test_a_later_failure_is_logged_and_a_stop_cancels_a_pending_listen(self) -> None:
        pending: List["defer.Deferred[Any]"] = []

        class Slow:
            def listen(self, factory: Any) -> "defer.Deferred[Any]":
                pending.append(defer.Deferred())
                return pending[-1]

        service = EndpointListener(Slow(), self.site(MemoryReactorClock()))
        service.startService()
        service.stopService()
        self.assertTrue(pending[0].called, "stop cancels the pending listen")
        self.flushLoggedErrors(defer.CancelledError)
        again = EndpointListener(Slow(), self.site(MemoryReactorClock()))
        again.startService()
        with capturedLogs() as events:
            pending[1].errback(CannotListenError("127.0.0.1", 1, OSError("denied")))
        self.assertTrue(any("cannot listen" in e.get("log_format", "") for e in events), events)
        self.assertEqual(len(self.flushLoggedErrors(CannotListenError)), 1)


class _FDSet:
    """The part of IReactorFDSet a tcp.Connection calls, recorded."""

    def __init__(self) -> None:
        self.writers: List[Any] = []
        self.calls: List[Any] = []

    def addWriter(self, fd: Any) -> None:  # noqa: N802 - Twisted's name
        self.writers.append(fd)

    def removeWriter(self, fd: Any) -> None:  # noqa: N802 - Twisted's name
        if fd in self.writers:
            self.writers.remove(fd)

    def callLater(self, delay: float, f: Any, *args: Any) -> None:  # noqa: N802 - Twisted's name
        self.calls.append((delay, f, args))

    def addReader(self, fd: Any) -> None:  # noqa: N802 - Twisted's name
        pass

    def removeReader(self, fd: Any) -> None:  # noqa: N802 - Twisted's name
        pass


class WriteNowTests(SynchronousTestCase):
    """A TCP transport with nothing queued sends at once; otherwise Twisted queues."""

    def setUp(self) -> None:
        ours, self.peer = socket.socketpair()
        ours.setblocking(False)
        self.peer.settimeout(5)
        self.addCleanup(ours.close)
        self.addCleanup(self.peer.close)
        self.reactor = _FDSet()
        self.transport = tcp.Server(ours, Protocol(), ("127.0.0.1", 1), None, 1, self.reactor)
        self.transport.connected = True

    def test_sent_without_waiting_for_the_reactor(self) -> None:
        for name in ("dataBuffer", "_tempDataBuffer", "TLS", "_writeDisconnected", "socket"):
            self.assertTrue(hasattr(self.transport, name), name)  # what write_now reads
        self.assertFalse(self.transport._aborting)
        write_now(self.transport, b"hello")
        self.assertEqual(self.peer.recv(100), b"hello")
        self.assertEqual(self.reactor.writers, [])  # no wake-up needed

    def test_queued_behind_what_twisted_holds(self) -> None:
        self.transport.write(b"first ")  # Twisted's queue: sent on the next iteration
        self.assertEqual(self.reactor.writers, [self.transport])
        write_now(self.transport, b"second")
        self.assertEqual(self.transport._tempDataBuffer, [b"first ", b"second"])

    def test_what_the_kernel_does_not_take_is_queued(self) -> None:
        self.transport.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        big = b"x" * (8 << 20)
        write_now(self.transport, big)
        queued = b"".join(self.transport._tempDataBuffer)
        self.assertTrue(0 < len(queued) < len(big))
        self.assertEqual(self.reactor.writers, [self.transport])

    def test_write_pending_sees_what_twisted_still_holds(self) -> None:
        write_now(self.transport, b"sent at once")
        self.assertFalse(write_pending(self.transport))
        self.transport.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        write_now(self.transport, b"x" * (8 << 20))  # more than the kernel takes
        self.assertTrue(write_pending(self.transport))
        self.assertFalse(write_pending(StringTransport()), "no buffer of Twisted's: nothing pending")

    def test_other_transports_use_their_write(self) -> None:
        transport = StringTransport()
        write_now(transport, b"data")
        self.assertEqual(transport.value(), b"data")

    def test_an_aborted_transport_sends_nothing_more(self) -> None:
        self.transport.abortConnection()  # Twisted drops whatever is written after this
        write_now(self.transport, b"terminator")
        self.peer.setblocking(False)
        with self.assertRaises(BlockingIOError):
            self.peer.recv(100)
        self.reactor.calls[0][1](*self.reactor.calls[0][2])  # the abort's connectionLost

    def test_a_closing_transport_is_left_to_twisted(self) -> None:
        self.transport.disconnecting = True
        write_now(self.transport, b"late")
        self.peer.setblocking(False)
        with self.assertRaises(BlockingIOError):
            self.peer.recv(100)


class AgentReactorTests(SynchronousTestCase):
    """AgentEPollReactor copies EPollReactor.doPoll but for its dispatch:
    the installed Twisted's must still poll and dispatch as it did when the
    copy was made (the names and the one call the copy leaves out)."""

    def test_the_installed_epoll_reactor_still_dispatches_as_copied(self) -> None:
        import inspect

        from rolemesh.event_loop.twisted_compat import AgentEPollReactor

        if AgentEPollReactor is None:
            raise SkipTest("no epoll here")
        from twisted.internet.epollreactor import EPollReactor

        source = inspect.getsource(EPollReactor.doPoll)
        for piece in ("self._poller.poll(timeout, len(self._selectables))", "_drdw = self._doReadOrWrite",
                      "selectable = self._selectables[fd]",
                      "log.callWithLogger(selectable, _drdw, selectable, fd, event)"):
            self.assertIn(piece, source)
        self.assertIs(EPollReactor.doIteration, EPollReactor.doPoll)
        self.assertTrue(callable(getattr(EPollReactor, "_doReadOrWrite", None)))

    def test_the_installed_twisted_is_one_the_copy_was_checked_against(self) -> None:
        """Fails on a Twisted whose doPoll changed: read it against the copy,
        then add its digest to CHECKED_DOPOLL (until then the agent runs
        Twisted's own reactor there, tests/integration/test_event_loop.py)."""
        from rolemesh.event_loop.twisted_compat import AgentEPollReactor, epoll_copy_differs

        if AgentEPollReactor is None:
            raise SkipTest("no epoll here")
        self.assertIsNone(epoll_copy_differs())

    def test_another_dopoll_is_noticed(self) -> None:
        from rolemesh.event_loop import twisted_compat

        if twisted_compat.AgentEPollReactor is None:
            raise SkipTest("no epoll here")
        self.patch(twisted_compat, "CHECKED_DOPOLL", frozenset({"0" * 64}))
        self.assertIn("doPoll", twisted_compat.epoll_copy_differs() or "")

    def test_it_dispatches_what_the_poller_reports_and_survives_a_dispatch_error(self) -> None:
        from rolemesh.event_loop.twisted_compat import AgentEPollReactor

        if AgentEPollReactor is None:
            raise SkipTest("no epoll here")
        reactor = AgentEPollReactor()  # not installed: only its dispatch is driven here
        self.addCleanup(reactor._poller.close)
        seen: List[Any] = []

        class Poller:
            def poll(self, timeout: float, count: int) -> List[Any]:
                seen.append(("poll", timeout))
                return [(7, 1), (8, 1), (9, 1)]

        reactor._poller = Poller()  # type: ignore[assignment]
        reactor._selectables = {7: "first", 9: "third"}  # fd 8 went away meanwhile: skipped

        def dispatch(selectable: Any, fd: int, event: int) -> None:
            seen.append((selectable, fd))
            if selectable == "first":
                raise RuntimeError("a bug in a dispatch")

        reactor._doReadOrWrite = dispatch  # type: ignore[method-assign]
        reactor.doIteration(None)
        self.assertEqual(seen, [("poll", -1), ("first", 7), ("third", 9)])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1, "the error was logged")


class _Recorded(Protocol):
    def __init__(self, made: List["_Recorded"]) -> None:
        self.made = made

    def connectionMade(self) -> None:  # noqa: N802 - Twisted's name
        self.made.append(self)


class AgentPortTests(SynchronousTestCase):
    """AgentPort's accept loop, on real sockets: connections wait in the
    listening socket's backlog, and each test calls ``doRead`` as the
    reactor would (the reactor is a real AgentEPollReactor, never run)."""

    def listen(self, build: Any = None, interface: str = "127.0.0.1") -> Any:
        from rolemesh.event_loop.twisted_compat import AgentEPollReactor, AgentPort

        if AgentEPollReactor is None:
            raise SkipTest("no epoll here")
        reactor = AgentEPollReactor()
        self.addCleanup(reactor._poller.close)
        self.made: List[_Recorded] = []
        factory = Factory()
        factory.noisy = False
        factory.buildProtocol = build or (lambda addr: _Recorded(self.made))  # type: ignore[method-assign]
        try:
            port = reactor.listenTCP(0, factory, interface=interface)
        except CannotListenError as e:
            raise SkipTest(f"cannot listen on {interface}: {e}")
        self.assertIsInstance(port, AgentPort)
        self.addCleanup(port.socket.close)
        return port

    def clients(self, port: Any, n: int) -> List[socket.socket]:
        host = port.getHost()
        out = []
        for _ in range(n):
            sock = socket.socket(socket.AF_INET6 if ":" in host.host else socket.AF_INET)
            sock.settimeout(5)
            sock.connect((host.host, host.port))  # done by the kernel: it waits in the backlog
            self.addCleanup(sock.close)
            out.append(sock)
        return out

    def close_accepted(self) -> None:
        for protocol in self.made:
            protocol.transport.socket.close()  # type: ignore[attr-defined]

    def test_it_accepts_every_waiting_connection_in_one_wake_up(self) -> None:
        port = self.listen()
        clients = self.clients(port, 3)
        port.doRead()
        self.addCleanup(self.close_accepted)
        self.assertEqual(len(self.made), 3)
        self.assertEqual([p.transport.sessionno for p in self.made], [0, 1, 2])  # type: ignore[attr-defined]
        self.assertTrue(all(type(p.transport) is tcp.Server for p in self.made))
        self.assertEqual(sorted(p.transport.getPeer().port for p in self.made),  # type: ignore[union-attr]
                         sorted(c.getsockname()[1] for c in clients))
        self.assertEqual(port.numberAccepts, 3, "as Twisted: no more accepts next time than this time")
        first = self.made[0].transport
        first.write(b"hello")  # type: ignore[union-attr]
        port.reactor.doIteration(0)  # a connection as any other: the reactor sends what it holds
        (peer,) = [c for c in clients if c.getsockname()[1] == first.getPeer().port]  # type: ignore[union-attr]
        self.assertEqual(peer.recv(10), b"hello")

    def test_the_accepts_per_wake_up_grow_when_the_limit_is_reached(self) -> None:
        port = self.listen()
        self.clients(port, 3)
        port.numberAccepts = 2
        port.doRead()
        self.addCleanup(self.close_accepted)
        self.assertEqual((len(self.made), port.numberAccepts), (2, 22))
        port.doRead()
        self.assertEqual((len(self.made), port.numberAccepts), (3, 1))
        port.doRead()  # none waiting
        self.assertEqual((len(self.made), port.numberAccepts), (3, 1))

    def test_a_refused_connection_is_closed(self) -> None:
        port = self.listen(build=lambda addr: None)
        (client,) = self.clients(port, 1)
        port.doRead()
        self.assertEqual(client.recv(10), b"", "closed at once")
        self.assertEqual(port.sessionno, 0)

    def test_an_error_of_a_protocol_is_logged_not_raised(self) -> None:
        def build(addr: Any) -> Protocol:
            raise RuntimeError("a bug in buildProtocol")

        port = self.listen(build=build)
        self.clients(port, 1)
        port.doRead()
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_an_accept_error_is_left_to_twisteds_own_loop(self) -> None:
        import errno

        port = self.listen()
        calls: List[Any] = []

        class Full:
            def accept(self) -> Any:
                raise OSError(errno.EMFILE, "Too many open files")

        real, port.socket = port.socket, Full()
        self.addCleanup(setattr, port, "socket", real)
        self.patch(tcp.Port, "doRead", lambda self: calls.append(self))
        port.doRead()
        self.assertEqual(calls, [port])
        self.assertEqual(self.made, [])

    def test_an_ipv6_peer_keeps_its_scope_id_form(self) -> None:
        port = self.listen(interface="::1")
        (client,) = self.clients(port, 1)
        port.doRead()
        self.addCleanup(self.close_accepted)
        peer = self.made[0].transport.getPeer()  # type: ignore[union-attr]
        self.assertEqual((type(peer).__name__, peer.host, peer.port), ("IPv6Address", "::1", client.getsockname()[1]))

    def test_the_installed_port_accepts_as_copied(self) -> None:
        """Fails on a Twisted whose Port.doRead changed: read it against
        AgentPort.doRead, then add its digest to CHECKED_PORT_DOREAD."""
        import hashlib
        import inspect
        import textwrap

        from rolemesh.event_loop import twisted_compat

        source = textwrap.dedent(inspect.getsource(tcp.Port.doRead))
        self.assertIn(hashlib.sha256(source.encode("utf-8")).hexdigest(), twisted_compat.CHECKED_PORT_DOREAD)
        for piece in ("self.factory.buildProtocol(self._buildAddr(addr))", "self.sessionno = s + 1",
                      "protocol.makeConnection(transport)", "self.numberAccepts += 20"):
            self.assertIn(piece, source)

    def test_another_port_doread_is_noticed(self) -> None:
        from rolemesh.event_loop import twisted_compat

        if twisted_compat.AgentEPollReactor is None:
            raise SkipTest("no epoll here")
        self.patch(twisted_compat, "CHECKED_PORT_DOREAD", frozenset({"0" * 64}))
        self.assertIn("tcp.Port.doRead", twisted_compat.epoll_copy_differs() or "")


class NoPrivateTwistedElsewhereTests(SynchronousTestCase):
    def test_only_the_wrapper_module_names_twisted_internals(self) -> None:
        found = []
        for directory, _, files in os.walk(PACKAGE):
            for name in files:
                path = os.path.join(directory, name)
                if not name.endswith(".py") or path == os.path.join(PACKAGE, "event_loop", "twisted_compat.py"):
                    continue
                with open(path, encoding="utf-8") as f:
                    for number, line in enumerate(f, 1):
                        if PRIVATE.search(line):
                            found.append(f"{os.path.relpath(path, PACKAGE)}:{number}: {line.strip()}")
        self.assertEqual(found, [], "use rolemesh.event_loop.twisted_compat for Twisted internals")
