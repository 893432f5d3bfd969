"""HTTP clients the agent uses towards its children and the dispatcher.

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

from typing import Any, Optional

from twisted.internet.abstract import isIPAddress, isIPv6Address
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP6ClientEndpoint
from twisted.web.client import Agent, BrowserLikePolicyForHTTPS, HTTPConnectionPool, _StandardEndpointFactory
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import implementer


def quiet_pool(reactor: Any, persistent: bool) -> HTTPConnectionPool:
    """A connection pool whose connections do not log their life."""
    pool = HTTPConnectionPool(reactor, persistent=persistent)
    factory = getattr(pool, "_factory", None)
    if isinstance(factory, type):
        quiet: Any = type("QuietHTTP11ClientFactory", (factory,), {"noisy": False})
        pool._factory = quiet
    return pool


@implementer(IAgentEndpointFactory)
class LiteralAddressEndpoints:
    """Plain TCP endpoints for ``http://<ip literal>``; the standard ones
    (name resolution, TLS) for everything else."""

    def __init__(self, reactor: Any, connect_timeout: Optional[float] = None) -> None:
        self._reactor = reactor
        self._timeout = connect_timeout or 30
        self._standard = _StandardEndpointFactory(reactor, BrowserLikePolicyForHTTPS(), connect_timeout, None)

    def endpointForURI(self, uri: Any) -> Any:  # noqa: N802 - Twisted's name
        host = uri.host.decode("ascii", "replace")
        if uri.scheme == b"http":
            if isIPAddress(host):
                return TCP4ClientEndpoint(self._reactor, host, uri.port, timeout=self._timeout)
            if isIPv6Address(host):
                return TCP6ClientEndpoint(self._reactor, host, uri.port, timeout=self._timeout)
        return self._standard.endpointForURI(uri)


def quiet_agent(reactor: Any, persistent: bool, connect_timeout: Optional[float] = None,
                pool: Optional[HTTPConnectionPool] = None) -> Agent:
    """An Agent on a quiet pool (``pool`` if given) that does not resolve IP literals."""
    pool = pool or quiet_pool(reactor, persistent)
    return Agent.usingEndpointFactory(reactor, LiteralAddressEndpoints(reactor, connect_timeout), pool=pool)


def quiet_treq(reactor: Any, persistent: bool = False, connect_timeout: Optional[float] = None) -> Any:
    """A treq ``HTTPClient`` on a quiet Agent."""
    from treq.client import HTTPClient

    return HTTPClient(quiet_agent(reactor, persistent, connect_timeout))
