"""The shared HTTP client builder: quiet connections, no resolution of IP literals."""

from __future__ import annotations

from twisted.internet.endpoints import HostnameEndpoint, TCP4ClientEndpoint, TCP6ClientEndpoint
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import URI, BrowserLikePolicyForHTTPS
from twisted.web.iweb import IAgentEndpointFactory, IPolicyForHTTPS
from zope.interface import implementer
from zope.interface.verify import verifyObject

from rolemesh.http.control_client import LiteralAddressEndpoints, quiet_pool


class EndpointTests(SynchronousTestCase):
    def setUp(self):
        self.factory = LiteralAddressEndpoints(MemoryReactorClock(), 2.0)

    def endpoint(self, url):
        return self.factory.endpointForURI(URI.fromBytes(url))

    def test_interface(self):
        verifyObject(IAgentEndpointFactory, self.factory)

    def test_ip_literals_are_plain_tcp(self):
        self.assertIsInstance(self.endpoint(b"http://127.0.0.1:8080/health"), TCP4ClientEndpoint)
        self.assertIsInstance(self.endpoint(b"http://[::1]:8080/health"), TCP6ClientEndpoint)

    def test_names_are_resolved(self):
        self.assertIsInstance(self.endpoint(b"http://dispatcher.example:9000/v1"), HostnameEndpoint)

    def test_https_keeps_tls(self):
        endpoint = self.endpoint(b"https://10.0.0.1:9443/v1")
        self.assertNotIsInstance(endpoint, TCP4ClientEndpoint)

    def test_https_uses_the_given_tls_policy(self):
        """The dispatcher's policy (its CA file, its client certificate)
        decides every https:// connection of a client built with it."""
        asked = []

        @implementer(IPolicyForHTTPS)
        class Policy:
            def creatorForNetloc(self, hostname, port):  # noqa: N802 - Twisted's name
                asked.append((hostname, port))
                return BrowserLikePolicyForHTTPS().creatorForNetloc(hostname, port)

        factory = LiteralAddressEndpoints(MemoryReactorClock(), 2.0, Policy())
        factory.endpointForURI(URI.fromBytes(b"https://dispatcher.example:9443/v1"))
        self.assertEqual(asked, [(b"dispatcher.example", 9443)])

    def test_pool_is_quiet(self):
        pool = quiet_pool(MemoryReactorClock(), persistent=True)
        self.assertFalse(pool._factory.noisy)
