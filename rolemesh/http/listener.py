"""The listening side of the API: a twisted.web Site with limits.

Every connection is a :class:`~rolemesh.http.fast_channel.FastChannel`: one
strict parser (llhttp) for every request, an absolute deadline for
receiving each whole request (twisted.web's idle timeout restarts on every
byte, so a client that drips its request -- slow loris -- would hold a
connection, and once queued a device slot, for ever), the head decided
before the body is read, and a cap on open client connections
(:class:`GuardedSite`).  Time spent answering (a long stream) is not
limited here.  :func:`listening_service` puts the site on TCP
``listen_host:listen_port`` or on any Twisted endpoint (``listen``), behind
TLS when the config has a certificate, with only public Twisted API
(:class:`EndpointListener`).
"""

from __future__ import annotations

import io
import json
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union, cast

from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, DeferredList, maybeDeferred
from twisted.internet.endpoints import TCP4ServerEndpoint, serverFromString
from twisted.internet.interfaces import (
    IAddress,
    IListeningPort,
    IOpenSSLServerConnectionCreator,
    IProtocolFactory,
    IReactorTime,
    IStreamServerEndpoint,
)
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.protocols.tls import BufferingTLSTransport, TLSMemoryBIOFactory
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.resource import IResource
from twisted.web.server import Request, Site

from rolemesh.base.errors import ApiError
from rolemesh.base.interfaces import HeadPolicy, IAgentReactor, ProxiedRequest
from rolemesh.event_loop.reactor import resolve_reactor
from rolemesh.http.bridge import BridgeChannel
from rolemesh.http.fast_channel import FastChannel, FastRoute, HttpDate

log = Logger(namespace="rolemesh.listener")

if TYPE_CHECKING:
    from rolemesh.http.fast_channel import FastRequest


class LimitedRequest(Request):
    """A request that keeps at most ``site.max_body_bytes`` of its body.

    A body declared or found to be larger is not stored at all (neither in
    memory nor in a temporary file); ``body_too_large`` tells the route to
    answer 413.
    """

    body_too_large = False
    _body_bytes = 0

    def _limit(self) -> Optional[int]:
        return getattr(getattr(self.channel, "site", None), "max_body_bytes", None)

    def _discard(self) -> None:
        self.body_too_large = True
        self.content = io.BytesIO()

    def gotLength(self, length: Optional[int]) -> None:
        limit = self._limit()
        if limit is not None and length is not None and length > limit:
            self._discard()
            return
        super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:
        if self.body_too_large:
            return
        self._body_bytes += len(data)
        limit = self._limit()
        if limit is not None and self._body_bytes > limit:
            self._discard()
            return
        super().handleContentChunk(data)


if TYPE_CHECKING:
    def _requests_the_api_relays_to(klein: LimitedRequest, fast: FastRequest) -> List[ProxiedRequest]:
        """For the type checker only: both kinds of request the API relays
        answers to (this site's, through Klein, and the fast channel's)
        satisfy :class:`~rolemesh.base.interfaces.ProxiedRequest`."""
        return [klein, fast]


class GuardedSite(Site):
    r"""A Site whose connections are :class:`FastChannel`\ s: strict parsing,
    a per-request read deadline, a body size limit decided from the head,
    and a connection cap."""

    #: The twisted.web channel behind each FastChannel, for what it does not serve itself.
    protocol = BridgeChannel  # type: ignore[assignment]

    def __init__(
        self,
        resource: IResource,
        *,
        reactor: Optional[IReactorTime] = None,
        idle_timeout: float = 60.0,
        request_read_timeout: Optional[float] = 30.0,
        max_connections: int = 1024,
        max_body_bytes: Optional[int] = None,
        fast_routes: Optional[Dict[Tuple[bytes, bytes], FastRoute]] = None,
        head_policy: Optional[HeadPolicy] = None,
    ) -> None:
        super().__init__(resource, requestFactory=LimitedRequest, timeout=idle_timeout, reactor=reactor)
        #: ``(method, path)`` -> route: the requests a
        #: :class:`~rolemesh.http.fast_channel.FastChannel` answers itself (the
        #: proxied routes and a few GETs); empty: every request goes through
        #: twisted.web (after the same checks).
        self.fast_routes = fast_routes or {}
        #: Decides the key and the route from the head (None: no such checks).
        self.head_policy = head_policy
        self.http_date = HttpDate(self.reactor)
        self.max_body_bytes = max_body_bytes
        self.request_read_timeout = request_read_timeout
        self.max_connections = max_connections
        self.open_connections = 0
        self._refusing = False
        self.displayTracebacks = False
        self.noisy = False

    def log(self, request: http.Request) -> None:
        """No Apache-style access line: the API logs each proxied request with
        structured fields (request id, model, device, status, duration)."""

    # A FastChannel, not an HTTPChannel, and None to refuse (IProtocolFactory's word).
    def buildProtocol(self, addr: Optional[IAddress]) -> Optional[Protocol]:  # type: ignore[override]
        if self.open_connections >= self.max_connections:
            if not self._refusing:
                log.warn("refusing client connections: {count} already open (max_connections)",
                         count=self.open_connections)
            self._refusing = True
            return None
        self._refusing = False
        self.open_connections += 1
        return FastChannel(self, self.fast_routes, lambda: self._bridge(addr))

    def _bridge(self, addr: Optional[IAddress]) -> BridgeChannel:
        """twisted.web's channel behind a FastChannel: its deadlines are the FastChannel's."""
        channel = cast(BridgeChannel, super().buildProtocol(addr))
        channel.timeOut = None
        return channel


def plain_http_on_tls_port() -> bytes:
    """The whole answer to a client that spoke plain HTTP to the TLS port:
    a 400 in OpenAI's error shape, so ``curl http://`` says what is wrong
    instead of "empty reply"."""
    body = json.dumps(ApiError(
        400, "this port speaks HTTPS: use an https:// URL", code="https_required").body()).encode()
    return (b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


class _TLSConnection(BufferingTLSTransport):
    """A TLS server connection that answers a non-TLS first byte with
    :func:`plain_http_on_tls_port` (every TLS connection begins with a
    handshake record, byte 0x16) and closes."""

    _first = True
    _plain = False

    def dataReceived(self, data: bytes) -> None:  # noqa: N802 - Twisted's name
        if self._plain:
            return  # the rest of the plain request: already answered
        if self._first and data:
            self._first = False
            if data[:1] != b"\x16" and self.transport is not None:
                self._plain = True
                self.transport.write(plain_http_on_tls_port())
                self.transport.loseConnection()
                return
        super().dataReceived(data)


class _TLSSiteFactory(TLSMemoryBIOFactory):
    """TLS around a GuardedSite; a connection the site refuses (the cap) is
    refused here too instead of being wrapped around nothing."""

    protocol = _TLSConnection

    # None refuses the connection, as IProtocolFactory allows (WrappingFactory's annotation does not).
    def buildProtocol(self, addr: Optional[IAddress]) -> Optional[_TLSConnection]:  # type: ignore[override]  # noqa: N802
        inner = self.wrappedFactory.buildProtocol(addr)
        if inner is None:
            return None
        return self.protocol(self, inner)


class EndpointListener(Service):
    """Listens for ``factory`` on a server endpoint while running.

    Like ``TCPServer``, start-up fails at once (raises) when the endpoint
    cannot listen -- a taken port is an error, not a log line -- and unlike
    ``StreamServerEndpointService`` the listening port is public: ``port``
    (an ``IListeningPort``; None while not listening).
    """

    def __init__(self, endpoint: IStreamServerEndpoint, factory: IProtocolFactory) -> None:
        self.endpoint = endpoint
        self.factory = factory
        self.port: Optional[IListeningPort] = None
        self._pending: Optional[Deferred[IListeningPort]] = None

    @property
    def _port(self) -> Optional[IListeningPort]:
        """The name callers used before :attr:`port` was public."""
        return self.port

    def privilegedStartService(self) -> None:  # noqa: N802 - Twisted's name
        super().privilegedStartService()
        self._listen()

    def startService(self) -> None:  # noqa: N802 - Twisted's name
        super().startService()
        if self.port is None and self._pending is None:
            self._listen()

    def _listen(self) -> None:
        returned = False
        failed: List[Failure] = []

        def done(outcome: Union[IListeningPort, Failure]) -> None:
            self._pending = None
            if not isinstance(outcome, Failure):
                self.port = outcome
            elif not returned:
                failed.append(outcome)  # raised below, to whoever starts the service
            elif not outcome.check(CancelledError):
                log.failure("cannot listen on {endpoint}", outcome, endpoint=self.endpoint)

        self._pending = self.endpoint.listen(self.factory)
        self._pending.addBoth(done)
        returned = True
        if failed:
            failed[0].raiseException()

    def stopService(self) -> Optional[Deferred[None]]:  # noqa: N802 - Twisted's name
        super().stopService()
        if self._pending is not None:
            self._pending.cancel()
        port, self.port = self.port, None
        return port.stopListening() if port is not None else None


class AddressListeners(Service):
    """Listens on several TCP addresses with one port (llama-server's
    ``--host a,b``): all of them or none -- an address that cannot be had
    closes those already open and fails start-up.  With port 0 the first
    address picks the port and the others take the same one.  ``port`` is
    the first address's ``IListeningPort``, as :class:`EndpointListener`'s.
    """

    def __init__(self, reactor: IAgentReactor, hosts: Sequence[str], port: int, factory: IProtocolFactory) -> None:
        self._reactor, self._hosts, self._port, self.factory = reactor, tuple(hosts), port, factory
        self.listeners: List[EndpointListener] = []

    @property
    def port(self) -> Optional[IListeningPort]:
        return self.listeners[0].port if self.listeners else None

    def privilegedStartService(self) -> None:  # noqa: N802 - Twisted's name
        super().privilegedStartService()
        self._listen()

    def startService(self) -> None:  # noqa: N802 - Twisted's name
        super().startService()
        if not self.listeners:
            self._listen()

    def _listen(self) -> None:
        port = self._port
        try:
            for host in self._hosts:
                listener = EndpointListener(TCP4ServerEndpoint(self._reactor, port, interface=host), self.factory)
                listener.privilegedStartService()  # raises when the address cannot be had
                self.listeners.append(listener)
                if port == 0 and listener.port is not None:
                    port = cast(Any, listener.port.getHost()).port
        except BaseException:
            for opened in self.listeners:
                opened.stopService()
            self.listeners = []
            raise

    def stopService(self) -> Deferred[None]:  # noqa: N802 - Twisted's name
        super().stopService()
        listeners, self.listeners = self.listeners, []
        stopping = [maybeDeferred(listener.stopService) for listener in listeners]
        return DeferredList(stopping, consumeErrors=True).addCallback(lambda _: None)


def listening_service(site: Site, *, hosts: Sequence[str], port: int, endpoint: Optional[str] = None,
                      tls: Optional[IOpenSSLServerConnectionCreator] = None,
                      reactor: Optional[IAgentReactor] = None) -> Union[EndpointListener, AddressListeners]:
    """The service that listens for ``site``.

    ``endpoint`` is a Twisted server endpoint description (``tcp6:...``,
    ``unix:...``); without it the site listens on TCP ``port`` at each of
    ``hosts``.  ``tls`` is an ``IOpenSSLServerConnectionCreator``
    (:class:`rolemesh.config.tls.ServerTLS`) that wraps every connection in TLS,
    whatever the endpoint.
    """
    reactor = resolve_reactor(reactor)
    factory: IProtocolFactory = site if tls is None else _TLSSiteFactory(tls, False, site, clock=reactor)
    if endpoint is not None:
        return EndpointListener(serverFromString(reactor, endpoint), factory)
    if len(hosts) == 1:
        return EndpointListener(TCP4ServerEndpoint(reactor, port, interface=hosts[0]), factory)
    return AddressListeners(reactor, hosts, port, factory)
