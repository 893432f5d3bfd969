"""The control-traffic HTTP clients (treq on ``Agent``): registration,
heartbeats and events to the dispatcher (names, HTTPS), and the readiness
and inference probes and telemetry scrapes of the children.  The requests
the proxy relays to the children go through
:mod:`rolemesh.http.child_client` instead.

One place builds them so that they all

- are quiet: Twisted's client factory logs "Starting factory" / "Stopping
  factory" for every connection, which at a probe every 50 ms or a heartbeat
  every few seconds drowns the real log;
- skip name resolution for IP literals: ``Agent`` resolves even
  ``127.0.0.1`` through ``getaddrinfo`` on the thread pool, and llama-server
  closes its connection after every streamed answer, so each streamed request
  would pay a thread round-trip before its first byte.
"""

from __future__ import annotations

from typing import Optional

from treq.client import HTTPClient
from twisted.internet.abstract import isIPAddress, isIPv6Address
from twisted.internet.endpoints import HostnameEndpoint, TCP4ClientEndpoint, TCP6ClientEndpoint, wrapClientTLS
from twisted.internet.interfaces import IReactorTime, IStreamClientEndpoint
from twisted.web.client import URI, Agent, BrowserLikePolicyForHTTPS, HTTPConnectionPool
from twisted.web.error import SchemeNotSupported
from twisted.web.iweb import IAgentEndpointFactory, IPolicyForHTTPS
from zope.interface import implementer

from rolemesh.base.interfaces import IHTTPClientReactor
from rolemesh.event_loop.twisted_compat import quiet_connection_pool


def quiet_pool(reactor: IReactorTime, persistent: bool) -> HTTPConnectionPool:
    """A connection pool whose connections do not log their life."""
    return quiet_connection_pool(reactor, persistent)


@implementer(IAgentEndpointFactory)
class LiteralAddressEndpoints:
    """Plain TCP endpoints for ``http://<ip literal>``; what ``Agent`` builds
    itself (name resolution, TLS) for everything else, from public parts.

    ``tls_policy`` verifies ``https://`` servers (default: treq's and
    ``Agent``'s, ``BrowserLikePolicyForHTTPS``)."""

    def __init__(self, reactor: IHTTPClientReactor, connect_timeout: Optional[float] = None,
                 tls_policy: Optional[IPolicyForHTTPS] = None) -> None:
        self._reactor = reactor
        self._timeout = connect_timeout or 30
        self._connect_timeout = connect_timeout
        self._tls_policy = tls_policy if tls_policy is not None else BrowserLikePolicyForHTTPS()

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:  # noqa: N802 - Twisted's name
        host = uri.host.decode("ascii", "replace")
        if uri.scheme == b"http":
            if isIPAddress(host):
                return TCP4ClientEndpoint(self._reactor, host, uri.port, timeout=self._timeout)
            if isIPv6Address(host):
                return TCP6ClientEndpoint(self._reactor, host, uri.port, timeout=self._timeout)
        endpoint = (HostnameEndpoint(self._reactor, host, uri.port) if self._connect_timeout is None
                    else HostnameEndpoint(self._reactor, host, uri.port, timeout=self._connect_timeout))
        if uri.scheme == b"http":
            return endpoint
        if uri.scheme == b"https":
            return wrapClientTLS(self._tls_policy.creatorForNetloc(uri.host, uri.port), endpoint)
        raise SchemeNotSupported(f"Unsupported scheme: {uri.scheme!r}")


def quiet_agent(reactor: IHTTPClientReactor, persistent: bool, connect_timeout: Optional[float] = None,
                pool: Optional[HTTPConnectionPool] = None, tls_policy: Optional[IPolicyForHTTPS] = None) -> Agent:
    """An Agent on a quiet pool (``pool`` if given) that does not resolve IP
    literals and verifies HTTPS with ``tls_policy`` (default: browser-like)."""
    pool = pool or quiet_pool(reactor, persistent)
    endpoints = LiteralAddressEndpoints(reactor, connect_timeout, tls_policy)
    return Agent.usingEndpointFactory(reactor, endpoints, pool=pool)


def quiet_treq(reactor: IHTTPClientReactor, persistent: bool = False, connect_timeout: Optional[float] = None,
               pool: Optional[HTTPConnectionPool] = None, tls_policy: Optional[IPolicyForHTTPS] = None) -> HTTPClient:
    """A treq ``HTTPClient`` on a quiet Agent (see :func:`quiet_agent`)."""
    return HTTPClient(quiet_agent(reactor, persistent, connect_timeout, pool, tls_policy))
