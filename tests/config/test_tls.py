"""TLS: certificate checks, the reloadable listener TLS, the dispatcher policy.

Certificates are generated here with ``cryptography`` (never committed
keys).  Handshakes run in memory: two ``TLSMemoryBIOProtocol``s joined by
``twisted.test.iosim``, so no socket and no global reactor is involved.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
from typing import Any, List, Optional, Sequence, Tuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, x25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from hypothesis import given
from hypothesis import strategies as st
from OpenSSL import SSL
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IOpenSSLContextFactory, IOpenSSLServerConnectionCreator
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import capturedLogs, formatEvent
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from twisted.test import iosim
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseNeverReceived
from twisted.web.iweb import IPolicyForHTTPS
from twisted.web.resource import Resource
from zope.interface import implementer
from zope.interface.verify import verifyObject

from rolemesh.base.errors import ConfigError
from rolemesh.config.file import validate
from rolemesh.config.tls import (
    ClientTLSFiles,
    ServerTLS,
    ServerTLSFiles,
    check_client_files,
    check_server_files,
    describe_tls_failure,
    dispatcher_tls_policy,
    escape_endpoint_value,
    key_matches,
    split_endpoint_description,
    validity_problem,
)
from rolemesh.fleet.dispatcher import UNREACHABLE, DispatcherClient, plaintext_off_loopback
from rolemesh.http.listener import GuardedSite, listening_service
from tests.fixtures import REPO

NOW = datetime.datetime(2026, 6, 1, 12, 0, tzinfo=datetime.timezone.utc)
DAY = datetime.timedelta(days=1)


def _pem_key(key: Any, password: Optional[bytes] = None) -> bytes:
    encryption: Any = (serialization.BestAvailableEncryption(password) if password
                       else serialization.NoEncryption())
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)


class Pki:
    """A throwaway CA, and certificates it signs, written as PEM files under ``directory``.

    ``now`` anchors validity (default: the real time, for real handshakes
    in integration tests).  Keys are EC P-256: quick to generate.
    """

    def __init__(self, directory: str, name: str = "RoleMesh Test CA",
                 now: Optional[datetime.datetime] = None) -> None:
        self.dir = directory
        os.makedirs(directory, exist_ok=True)
        self.now = now or datetime.datetime.now(datetime.timezone.utc)
        self.name = name
        self.ca_key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.ca_cert = (
            x509.CertificateBuilder()
            .subject_name(subject).issuer_name(subject)
            .public_key(self.ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self.now - DAY)
            .not_valid_after(self.now + 3650 * DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.ca_key.public_key()), critical=False)
            .sign(self.ca_key, hashes.SHA256())
        )
        self.ca_file = self.write(f"{self._slug()}-ca.pem", self.ca_cert.public_bytes(serialization.Encoding.PEM))

    def _slug(self) -> str:
        return self.name.lower().replace(" ", "-")

    def write(self, name: str, data: bytes, mode: int = 0o644) -> str:
        path = os.path.join(self.dir, name)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, mode)
        return path

    def issue(self, name: str, hosts: Sequence[str] = ("localhost", "127.0.0.1"), *, client: bool = False,
              not_before: Optional[datetime.datetime] = None, not_after: Optional[datetime.datetime] = None,
              password: Optional[bytes] = None) -> Tuple[str, str]:
        """A certificate for ``hosts`` (server) or ``name`` (client); returns (cert file, key file)."""
        key = ec.generate_private_key(ec.SECP256R1())
        names: List[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before or self.now - DAY)
            .not_valid_after(not_after or self.now + 90 * DAY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.ca_key.public_key()),
                           critical=False)
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.ca_key, hashes.SHA256())
        slug = f"{self._slug()}-{name}".replace(" ", "-")
        cert_file = self.write(f"{slug}.crt", cert.public_bytes(serialization.Encoding.PEM))
        key_file = self.write(f"{slug}.key", _pem_key(key, password), mode=0o600)
        return cert_file, key_file


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def certificate_of(path: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(read(path))


class Recorder(Protocol):
    """Application protocol on both ends: records what it got and how it ended."""

    def __init__(self) -> None:
        self.received = b""
        self.lost: Any = None

    def dataReceived(self, data: bytes) -> None:  # noqa: N802
        self.received += data

    def connectionLost(self, reason: Any = None) -> None:  # noqa: N802
        self.lost = reason


def handshake(server_creator: Any, client_creator: Any, clock: Clock,
              before_pump: Any = None) -> Tuple[Any, Any, Recorder, Recorder]:
    """Run a TLS connection in memory; the client sends b"ping".

    Returns (server TLS protocol, client TLS protocol, server app, client app).
    ``before_pump`` runs after both ends exist but before any byte moves.
    """
    server_app, client_app = Recorder(), Recorder()
    server_factory = TLSMemoryBIOFactory(server_creator, False, Factory.forProtocol(lambda: server_app),
                                         clock=clock)
    client_factory = TLSMemoryBIOFactory(client_creator, True, Factory.forProtocol(lambda: client_app),
                                         clock=clock)
    server = server_factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 8443))
    client = client_factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 50000))
    server_transport = iosim.FakeTransport(server, isServer=True)
    client_transport = iosim.FakeTransport(client, isServer=False)
    pump = iosim.connect(server, server_transport, client, client_transport, greet=False, clock=clock)
    if before_pump is not None:
        before_pump()
    pump.flush()
    client_app.transport.write(b"ping")
    for _ in range(5):
        clock.advance(0)  # the TLS layer batches small writes until the next reactor turn
        pump.flush()
    return server, client, server_app, client_app


def peer_serial(tls_protocol: Any) -> int:
    cert = tls_protocol.getPeerCertificate()
    return cert.get_serial_number()


# --------------------------------------------------------------------------


class PureCheckTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.pki = Pki(self.mktemp(), now=NOW)

    def test_key_matches_only_its_certificate(self) -> None:
        cert_file, key_file = self.pki.issue("a")
        _, other_key_file = self.pki.issue("b")
        cert = certificate_of(cert_file)
        own = serialization.load_pem_private_key(read(key_file), None)
        other = serialization.load_pem_private_key(read(other_key_file), None)
        self.assertTrue(key_matches(cert, own))
        self.assertFalse(key_matches(cert, other))

    def test_validity_window(self) -> None:
        cert = certificate_of(self.pki.issue("a", not_before=NOW - DAY, not_after=NOW + DAY)[0])
        self.assertIsNone(validity_problem(cert, NOW))
        self.assertRegex(validity_problem(cert, NOW + 2 * DAY) or "", r"^expired on \d{4}-\d\d-\d\d")
        self.assertRegex(validity_problem(cert, NOW - 2 * DAY) or "", r"^not valid before ")

    @given(st.text(min_size=0, max_size=30), st.text(min_size=1, max_size=30))
    def test_endpoint_description_escape_round_trip(self, positional: str, value: str) -> None:
        text = f"unix:{escape_endpoint_value(positional)}:mode={escape_endpoint_value(value)}"
        self.assertEqual(split_endpoint_description(text), (["unix", positional], {"mode": value}))

    def test_ssl_description_with_escaped_ipv6_interface(self) -> None:
        self.assertEqual(
            split_endpoint_description(r"ssl:8443:privateKey=/k.pem:interface=\:\:1"),
            (["ssl", "8443"], {"privateKey": "/k.pem", "interface": "::1"}),
        )


class FileCheckTests(SynchronousTestCase):
    """What --check and start-up say about TLS files: one line, no key material."""

    def setUp(self) -> None:
        self.pki = Pki(self.mktemp(), now=NOW)
        self.cert, self.key = self.pki.issue("node")

    def error(self, files: Any, now: datetime.datetime = NOW) -> str:
        check = check_server_files if isinstance(files, ServerTLSFiles) else check_client_files
        with self.assertRaises(ConfigError) as caught:
            check(files, now)
        message = str(caught.exception)
        self.assertNotIn("\n", message)
        self.assertNotIn("PRIVATE KEY", message)
        key_body = read(self.key).decode().splitlines()[1]
        self.assertNotIn(key_body[:20], message)
        return message

    def test_good_files_are_summarised_without_key_material(self) -> None:
        lines = check_server_files(ServerTLSFiles(self.cert, self.key, self.pki.ca_file), NOW)
        self.assertEqual(len(lines), 2)
        self.assertIn("CN=node [localhost, 127.0.0.1], valid until", lines[0])
        self.assertIn("(90 days left)", lines[0])
        self.assertIn("signed by one of 1 CA certificate(s)", lines[1])
        self.assertNotIn("PRIVATE", "".join(lines))

    def test_missing_file(self) -> None:
        message = self.error(ServerTLSFiles(self.cert + ".nope", self.key))
        self.assertEqual(message, f'tls_cert_file: file not found: "{self.cert}.nope"')

    def test_unreadable_key(self) -> None:
        if os.geteuid() == 0:
            self.skipTest("root reads any file")
        os.chmod(self.key, 0)
        self.assertEqual(self.error(ServerTLSFiles(self.cert, self.key)),
                         f'tls_key_file: cannot read "{self.key}": Permission denied')

    def test_key_of_another_certificate(self) -> None:
        _, other_key = self.pki.issue("other")
        self.assertEqual(self.error(ServerTLSFiles(self.cert, other_key)),
                         f'tls_key_file: the key in "{other_key}" does not belong to the certificate in '
                         f'"{self.cert}"')

    def test_expired_certificate(self) -> None:
        cert, key = self.pki.issue("old", not_before=NOW - 100 * DAY, not_after=NOW - DAY)
        self.assertRegex(self.error(ServerTLSFiles(cert, key)),
                         r'^tls_cert_file: the certificate in ".*old.crt" expired on \d{4}-')

    def test_key_file_given_as_certificate_and_vice_versa(self) -> None:
        self.assertIn("no PEM certificate", self.error(ServerTLSFiles(self.key, self.key)))
        self.assertIn("no PEM private key", self.error(ServerTLSFiles(self.cert, self.cert)))

    def test_encrypted_key(self) -> None:
        cert, key = self.pki.issue("locked", password=b"hunter2")
        self.assertIn("is encrypted; the agent needs an unencrypted key", self.error(ServerTLSFiles(cert, key)))

    def test_key_kind_tls_cannot_use(self) -> None:
        key = os.path.join(self.mktemp() + ".key")
        with open(key, "wb") as f:
            f.write(x25519.X25519PrivateKey.generate().private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        self.assertEqual(self.error(ServerTLSFiles(self.cert, key)),
                         f'tls_key_file: "{key}" holds a key of kind X25519, which TLS cannot use here; '
                         "use an RSA, EC or Ed25519 key")

    def test_bad_client_ca_file(self) -> None:
        self.assertIn("tls_client_ca_file: no PEM certificate",
                      self.error(ServerTLSFiles(self.cert, self.key, self.key)))

    def test_dispatcher_files(self) -> None:
        cert, key = self.pki.issue("agent", client=True)
        lines = check_client_files(ClientTLSFiles(self.pki.ca_file, cert, key), NOW)
        self.assertIn("dispatcher verified against 1 CA certificate(s)", lines[0])
        self.assertIn("dispatcher client certificate: CN=agent", lines[1])
        self.assertEqual(check_client_files(ClientTLSFiles(), NOW),
                         ["dispatcher verified against the system trust store"])
        _, wrong = self.pki.issue("stranger", client=True)
        self.assertIn("dispatcher_client_key_file: the key in",
                      self.error(ClientTLSFiles(None, cert, wrong)))


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


@implementer(IOpenSSLContextFactory)
class MaxVersionClient:
    """An old-style client context factory that speaks at most ``version``."""

    def __init__(self, ca_file: str, version: int) -> None:
        self.ca_file, self.version = ca_file, version

    def getContext(self) -> SSL.Context:  # noqa: N802 - Twisted's name
        ctx = SSL.Context(SSL.TLS_METHOD)
        ctx.set_cipher_list(b"DEFAULT:@SECLEVEL=0")  # let this OpenSSL offer TLS 1.1 at all
        ctx.set_min_proto_version(SSL.TLS1_VERSION)
        ctx.set_max_proto_version(self.version)
        ctx.load_verify_locations(self.ca_file)
        return ctx


class ServerTLSTests(SynchronousTestCase):
    """The listener's TLS: TLS 1.2+, client certificates, reload.

    OpenSSL checks validity against the real clock, so these certificates
    are anchored at the real time; the agent's own checks get ``self.now``.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.now = utc_now()
        self.pki = Pki(self.mktemp(), now=self.now)
        self.cert, self.key = self.pki.issue("node")

    def server(self, **kw: Any) -> ServerTLS:
        return ServerTLS(ServerTLSFiles(self.cert, self.key, **kw), now=lambda: self.now)

    def client(self, cert: Optional[Tuple[str, str]] = None, ca: Optional[str] = None) -> Any:
        policy = dispatcher_tls_policy(ClientTLSFiles(ca or self.pki.ca_file, *(cert or (None, None))), self.now)
        return policy.creatorForNetloc(b"localhost", 8443)

    def test_provides_the_interface(self) -> None:
        verifyObject(IOpenSSLServerConnectionCreator, self.server())
        verifyObject(IPolicyForHTTPS, dispatcher_tls_policy(ClientTLSFiles(), NOW))

    def test_handshake_and_data(self) -> None:
        _, client, server_app, _ = handshake(self.server(), self.client(), self.clock)
        self.assertEqual(server_app.received, b"ping")
        self.assertEqual(peer_serial(client), certificate_of(self.cert).serial_number)

    def test_tls_1_1_is_refused(self) -> None:
        tls = self.server()
        excluded = SSL.OP_NO_SSLv3 | SSL.OP_NO_TLSv1 | SSL.OP_NO_TLSv1_1
        self.assertEqual(tls._loaded.options._options & excluded, excluded)  # whatever OpenSSL's own floor
        _, _, server_app, _ = handshake(tls, MaxVersionClient(self.pki.ca_file, SSL.TLS1_2_VERSION), self.clock)
        self.assertEqual(server_app.received, b"ping")
        _, _, server_app, client_app = handshake(tls, MaxVersionClient(self.pki.ca_file, SSL.TLS1_1_VERSION),
                                                 self.clock)
        self.assertEqual(server_app.received, b"")
        self.assertIsNotNone(client_app.lost)

    def test_reload_serves_new_connections_with_the_new_certificate_and_keeps_old_ones(self) -> None:
        tls = self.server()
        old_serial = certificate_of(self.cert).serial_number
        rotated_cert, rotated_key = self.pki.issue("node", not_after=self.now + 180 * DAY)  # same paths
        self.assertEqual((rotated_cert, rotated_key), (self.cert, self.key))
        new_serial = certificate_of(self.cert).serial_number
        self.assertNotEqual(old_serial, new_serial)

        # A connection accepted before the reload finishes its handshake after
        # it, and still has the certificate it began with.
        in_flight = handshake(tls, self.client(), self.clock, before_pump=tls.reload)
        self.assertEqual(in_flight[2].received, b"ping")
        self.assertEqual(peer_serial(in_flight[1]), old_serial)

        _, client, server_app, _ = handshake(tls, self.client(), self.clock)
        self.assertEqual(server_app.received, b"ping")
        self.assertEqual(peer_serial(client), new_serial)
        self.assertIn("valid until", tls.describe())

    def test_failed_reload_keeps_the_old_certificate(self) -> None:
        tls = self.server()
        serial = certificate_of(self.cert).serial_number
        _, stranger_key = self.pki.issue("stranger")
        with open(self.key, "wb") as f:
            f.write(read(stranger_key))  # a half-finished rotation: the new key, the old certificate
        with self.assertRaises(ConfigError) as caught:
            tls.reload()
        self.assertIn("does not belong to the certificate", str(caught.exception))
        _, client, server_app, _ = handshake(tls, self.client(), self.clock)
        self.assertEqual(server_app.received, b"ping")
        self.assertEqual(peer_serial(client), serial)

    def test_reload_with_new_paths(self) -> None:
        tls = self.server()
        cert, key = self.pki.issue("renamed")
        tls.reload(ServerTLSFiles(cert, key))
        self.assertEqual(tls.files.cert_file, cert)
        _, client, _, _ = handshake(tls, self.client(), self.clock)
        self.assertEqual(peer_serial(client), certificate_of(cert).serial_number)

    def test_reload_refuses_an_expired_certificate(self) -> None:
        tls = self.server()
        self.now += 91 * DAY
        self.assertRaises(ConfigError, tls.reload)

    def test_mutual_tls(self) -> None:
        tls = self.server(client_ca_file=self.pki.ca_file)
        good = self.pki.issue("dispatcher", client=True)
        stranger_pki = Pki(self.mktemp(), name="Other CA", now=self.now)
        wrong = stranger_pki.issue("intruder", client=True)

        _, _, server_app, _ = handshake(tls, self.client(cert=good), self.clock)
        self.assertEqual(server_app.received, b"ping")
        for cert in (None, wrong):
            _, _, server_app, client_app = handshake(tls, self.client(cert=cert), self.clock)
            self.assertEqual(server_app.received, b"", cert)
            self.assertIsNotNone(client_app.lost, cert)


class DispatcherPolicyTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.pki = Pki(self.mktemp())
        self.server = ServerTLS(ServerTLSFiles(*self.pki.issue("dispatcher", hosts=("dispatcher.test",))))

    def connect(self, ca: Optional[str], host: bytes = b"dispatcher.test") -> Tuple[Recorder, Recorder]:
        creator = dispatcher_tls_policy(ClientTLSFiles(ca)).creatorForNetloc(host, 443)
        _, _, server_app, client_app = handshake(self.server, creator, self.clock)
        return server_app, client_app

    def test_verified_with_the_configured_ca(self) -> None:
        server_app, _ = self.connect(self.pki.ca_file)
        self.assertEqual(server_app.received, b"ping")

    def test_unknown_ca_is_refused_and_explained(self) -> None:
        other = Pki(self.mktemp(), name="Other CA")
        server_app, client_app = self.connect(other.ca_file)
        self.assertEqual(server_app.received, b"")
        reason = describe_tls_failure(client_app.lost.value)
        self.assertEqual(
            reason,
            "TLS: the dispatcher's certificate could not be verified (certificate verify failed); "
            "set dispatcher_ca_file to the CA that signed it",
        )

    def test_wrong_host_name_is_refused_and_explained(self) -> None:
        server_app, client_app = self.connect(self.pki.ca_file, host=b"elsewhere.test")
        self.assertEqual(server_app.received, b"")
        reason = describe_tls_failure(client_app.lost.value) or ""
        self.assertTrue(reason.startswith("TLS: the dispatcher's certificate does not name the host"), reason)

    def test_other_errors_are_not_tls(self) -> None:
        self.assertIsNone(describe_tls_failure(ValueError("x")))
        self.assertIsNone(describe_tls_failure(None))


class DispatcherClientTLSTests(SynchronousTestCase):
    """The client's log says why TLS failed, once; http:// off loopback warns."""

    def client(self, base: str, http: Any) -> DispatcherClient:
        client = DispatcherClient(base, "tok", lambda: {"node_id": "n"}, lambda: {"node_id": "n"}, 5.0,
                                  reactor=Clock(), http=http)
        self.addCleanup(lambda: client.running and client.stopService())
        return client

    def test_verification_failure_is_one_log_line_and_retried(self) -> None:
        from twisted.python.failure import Failure

        error = SSL.Error([("SSL routines", "", "certificate verify failed")])

        class FailingHTTP:
            calls = 0

            def post(self, *a: Any, **kw: Any) -> Any:
                from twisted.internet.defer import fail

                self.calls += 1
                return fail(ResponseNeverReceived([Failure(error)]))

        http = FailingHTTP()
        client = self.client("https://dispatcher.test", http)
        with capturedLogs() as events:
            client.startService()
            for _ in range(3):
                client._reactor.advance(5)
        lines = [formatEvent(e) for e in events]
        self.assertGreaterEqual(http.calls, 3)
        self.assertEqual(client.state, UNREACHABLE)
        tls_lines = [line for line in lines if "TLS" in line]
        self.assertEqual(len(tls_lines), 1, lines)
        self.assertIn("dispatcher's certificate could not be verified (certificate verify failed)", tls_lines[0])
        self.assertIn("local serving continues", tls_lines[0])

    def test_plain_http_to_another_host_warns(self) -> None:
        self.assertTrue(plaintext_off_loopback("http://dispatcher.example:9000"))
        self.assertTrue(plaintext_off_loopback("http://user:pw@10.0.0.2/x"))
        for url in ("https://dispatcher.example", "http://127.0.0.1:9000", "http://localhost/",
                    "http://[::1]:9000", "http://user@localhost:1"):
            self.assertFalse(plaintext_off_loopback(url), url)

        class NeverAnswers:
            def post(self, *a: Any, **kw: Any) -> Any:
                from twisted.internet.defer import Deferred

                return Deferred()

        for base, warned in (("http://dispatcher.example:9000", True), ("http://127.0.0.1:9000", False)):
            with capturedLogs() as events:
                client = self.client(base, NeverAnswers())
                client.startService()
                client.stopService()
            lines = [formatEvent(e) for e in events if "plain http://" in formatEvent(e)]
            self.assertEqual(len(lines), 1 if warned else 0, lines)


class ListenerTLSTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.pki = Pki(self.mktemp(), now=NOW)
        self.tls = ServerTLS(ServerTLSFiles(*self.pki.issue("node")), now=lambda: NOW)

    def test_connection_cap_still_refuses_under_tls(self) -> None:
        reactor = MemoryReactorClock()
        site = GuardedSite(Resource(), reactor=reactor, max_connections=1)
        service = listening_service(site, hosts=["127.0.0.1"], port=8443, tls=self.tls, reactor=reactor)
        service.startService()
        self.addCleanup(service.stopService)
        factory = reactor.tcpServers[0][1]
        self.assertEqual(reactor.tcpServers[0][0], 8443)
        first = factory.buildProtocol(IPv4Address("TCP", "10.0.0.1", 1))
        self.assertIsNotNone(first)
        first.makeConnection(iosim.FakeTransport(first, isServer=True))
        self.assertIsNone(factory.buildProtocol(IPv4Address("TCP", "10.0.0.1", 2)))

    def test_plain_http_on_the_tls_port_gets_a_clear_400(self) -> None:
        from twisted.internet.testing import StringTransport

        class TCPStringTransport(StringTransport):
            def setTcpNoDelay(self, enabled: bool) -> None:  # noqa: N802 - Twisted's name
                pass

        reactor = MemoryReactorClock()
        site = GuardedSite(Resource(), reactor=reactor)
        service = listening_service(site, hosts=["127.0.0.1"], port=8443, tls=self.tls, reactor=reactor)
        service.startService()
        self.addCleanup(service.stopService)
        factory = reactor.tcpServers[0][1]
        protocol = factory.buildProtocol(IPv4Address("TCP", "10.0.0.1", 1))
        transport = TCPStringTransport()
        protocol.makeConnection(transport)
        protocol.dataReceived(b"GET /v1/models HTTP/1.1\r\nHost: node\r\n")
        protocol.dataReceived(b"\r\n")
        head, _, body = transport.value().partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 400 Bad Request\r\n"), head)
        self.assertIn(b"Connection: close", head)
        self.assertEqual(json.loads(body), {"error": {"message": "this port speaks HTTPS: use an https:// URL",
                                                      "type": "invalid_request_error", "code": "https_required"}})
        self.assertTrue(transport.disconnecting)
        protocol.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(site.open_connections, 0)

    def test_endpoint_description(self) -> None:
        reactor = MemoryReactorClock()
        site = GuardedSite(Resource(), reactor=reactor)
        service = listening_service(site, hosts=["ignored"], port=1, endpoint=r"tcp6:9443:interface=\:\:1",
                                    tls=self.tls, reactor=reactor)
        service.startService()
        self.addCleanup(service.stopService)
        port, factory, _, interface = reactor.tcpServers[0]
        self.assertEqual((port, interface), (9443, "::1"))
        self.assertIsInstance(factory, TLSMemoryBIOFactory)
        self.assertIsNotNone(service._port)


class ConfigTLSTests(SynchronousTestCase):
    """The TLS keys' shapes (files are checked when the listener is built)."""

    def error(self, data: dict) -> str:
        with self.assertRaises(ConfigError) as caught:
            validate(data, check_files=False)
        return str(caught.exception)

    def test_ssl_description_becomes_tcp_plus_tls(self) -> None:
        config = validate({"listen": "ssl:8443:privateKey=/k.pem:certKey=/c.pem:interface=0.0.0.0"},
                          check_files=False)
        self.assertEqual(config.listen, "tcp:8443:interface=0.0.0.0")
        self.assertEqual(config.tls, ServerTLSFiles("/c.pem", "/k.pem"))
        self.assertEqual((config.listen_host, config.listen_port), ("0.0.0.0", 8443))
        self.assertTrue(config.advertise_url.startswith("https://"))
        self.assertTrue(config.exposed_without_key)

    def test_simple_form(self) -> None:
        config = validate({"listen_port": 8443, "tls_cert_file": "/both.pem", "tls_client_ca_file": "/ca.pem"},
                          check_files=False)
        self.assertIsNone(config.listen)
        self.assertEqual(config.tls, ServerTLSFiles("/both.pem", "/both.pem", "/ca.pem"))
        self.assertEqual(config.advertise_url, "https://127.0.0.1:8443")

    def test_mistakes(self) -> None:
        self.assertEqual(self.error({"tls_client_ca_file": "/ca.pem"}),
                         "tls_client_ca_file: needs tls_cert_file (mutual TLS is on top of TLS)")
        self.assertEqual(self.error({"tls_key_file": "/k.pem"}),
                         "tls_key_file: set tls_cert_file too (the certificate the key belongs to)")
        self.assertIn("names its own certificate",
                      self.error({"listen": "ssl:1:privateKey=/k", "tls_cert_file": "/c"}))
        self.assertIn("ssl option sslmethod is not supported",
                      self.error({"listen": "ssl:1:privateKey=/k:sslmethod=TLSv1_METHOD"}))
        self.assertEqual(self.error({"listen": "ssl:8443"}),
                         "listen: an ssl: description needs privateKey=<PEM key file>")
        self.assertEqual(self.error({"listen": "tcp:http"}), 'listen: expected a port number 0-65535, got "http"')
        self.assertIn("is not a usable endpoint description",
                      self.error({"listen": "tcp:80:nosuch=1"}))
        self.assertEqual(
            self.error({"dispatcher_base_url": "http://d:9000", "dispatcher_ca_file": "/ca.pem"}),
            'dispatcher_ca_file: only used with an https:// dispatcher_base_url, got "http://d:9000"')
        self.assertEqual(self.error({"dispatcher_client_key_file": "/k"}),
                         "dispatcher_client_key_file: set dispatcher_client_cert_file too")


class CheckCommandTests(SynchronousTestCase):
    """``rolemesh-node-agent --check`` validates the TLS files: one line, exit 2."""

    def setUp(self) -> None:
        from tests.fixtures.llama import write_fake_llama_server_bin

        self.dir = os.path.abspath(self.mktemp())
        self.pki = Pki(os.path.join(self.dir, "pki"))
        self.cert, self.key = self.pki.issue("node")
        self.binary = write_fake_llama_server_bin(self.dir)

    def check(self, **top: Any) -> Tuple[int, str, str]:
        import io
        import sys

        import yaml

        from rolemesh import cli

        path = os.path.join(self.dir, "agent.yaml")
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump({"backend": "cpu", "llama_server_bin": self.binary,
                            "state_dir": os.path.join(self.dir, "state"), **top}, f)
        out, err = io.StringIO(), io.StringIO()
        self.patch(sys, "stdout", out)
        self.patch(sys, "stderr", err)
        code = cli.main(["--config", path, "--check"])
        return code, out.getvalue(), err.getvalue()

    def test_good_files_are_reported(self) -> None:
        code, out, err = self.check(tls_cert_file=self.cert, tls_key_file=self.key,
                                    tls_client_ca_file=self.pki.ca_file)
        self.assertEqual((code, err), (0, ""))
        self.assertIn("# tls: listener certificate: CN=node [localhost, 127.0.0.1]", out)
        self.assertIn("# tls: client certificates required", out)
        self.assertNotIn("PRIVATE KEY", out)

    def test_bad_files_are_one_line_and_exit_2(self) -> None:
        _, other_key = self.pki.issue("other")
        expired = self.pki.issue("old", not_before=self.pki.now - 30 * DAY, not_after=self.pki.now - DAY)
        cases = [
            ({"tls_cert_file": self.cert + ".missing", "tls_key_file": self.key}, "tls_cert_file: file not found"),
            ({"tls_cert_file": self.cert, "tls_key_file": other_key}, "tls_key_file: the key in"),
            ({"tls_cert_file": expired[0], "tls_key_file": expired[1]}, "tls_cert_file: the certificate in"),
            ({"listen": f"ssl:0:privateKey={escape_endpoint_value(self.cert)}"}, "tls_key_file: no PEM private key"),
            ({"dispatcher_base_url": "https://d.example", "dispatcher_ca_file": self.key},
             "dispatcher_ca_file: no PEM certificate"),
        ]
        for top, expected in cases:
            code, out, err = self.check(**top)
            self.assertEqual(code, 2, (top, out, err))
            self.assertEqual(out, "", top)  # nothing half-printed before the error
            self.assertTrue(err.startswith(f"rolemesh-node-agent: {expected}"), (top, err))
            self.assertEqual(err.count("\n"), 1, err)
            self.assertNotIn("PRIVATE KEY", err)


class ReloadHookTests(SynchronousTestCase):
    """``reload_for(config)``: what the config-reload path calls; never raises."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.pki = Pki(self.mktemp())
        self.cert, self.key = self.pki.issue("node")

    def config(self, **keys: Any) -> Any:
        return validate({"tls_cert_file": self.cert, "tls_key_file": self.key, **keys}, check_files=False)

    def test_listener_hook_rotates_and_reports(self) -> None:
        tls = ServerTLS(self.config().tls)
        self.pki.issue("node")  # rotated in place
        with capturedLogs() as events:
            note = tls.reload_for(self.config())
        self.assertTrue((note or "").startswith("certificate reloaded: CN=node"), note)
        self.assertEqual(len([e for e in events if "TLS certificate reloaded" in formatEvent(e)]), 1)
        creator = dispatcher_tls_policy(ClientTLSFiles(self.pki.ca_file)).creatorForNetloc(b"localhost", 1)
        _, client, _, _ = handshake(tls, creator, self.clock)
        self.assertEqual(peer_serial(client), certificate_of(self.cert).serial_number)

    def test_listener_hook_keeps_the_old_certificate_on_bad_files(self) -> None:
        tls = ServerTLS(self.config().tls)
        serial = certificate_of(self.cert).serial_number
        os.remove(self.key)
        with capturedLogs() as events:
            note = tls.reload_for(self.config())
        self.assertEqual(note, f'kept the previous certificate: tls_key_file: file not found: "{self.key}"')
        lines = [formatEvent(e) for e in events]
        self.assertEqual(len(lines), 1, lines)
        self.assertIn("still serving the previous one", lines[0])
        creator = dispatcher_tls_policy(ClientTLSFiles(self.pki.ca_file)).creatorForNetloc(b"localhost", 1)
        _, client, server_app, _ = handshake(tls, creator, self.clock)
        self.assertEqual((server_app.received, peer_serial(client)), (b"ping", serial))

    def test_dispatcher_hook_switches_the_trusted_ca(self) -> None:
        server = ServerTLS(ServerTLSFiles(self.cert, self.key))
        other = Pki(self.mktemp(), name="Other CA")
        config = validate({"dispatcher_base_url": "https://localhost:9", "dispatcher_ca_file": other.ca_file},
                          check_files=False)
        policy = dispatcher_tls_policy(config.dispatcher_tls)
        _, _, server_app, _ = handshake(server, policy.creatorForNetloc(b"localhost", 9), self.clock)
        self.assertEqual(server_app.received, b"")  # the other CA did not sign the node's certificate
        with open(other.ca_file, "wb") as f:
            f.write(read(self.pki.ca_file))  # the CA file now holds the right CA
        self.assertEqual(policy.reload_for(config), "dispatcher CA and client certificate reloaded")
        _, _, server_app, _ = handshake(server, policy.creatorForNetloc(b"localhost", 9), self.clock)
        self.assertEqual(server_app.received, b"ping")
        os.remove(other.ca_file)
        self.assertIn("kept the previous dispatcher TLS files: dispatcher_ca_file: file not found",
                      policy.reload_for(config) or "")
        _, _, server_app, _ = handshake(server, policy.creatorForNetloc(b"localhost", 9), self.clock)
        self.assertEqual(server_app.received, b"ping")


class DocsTests(SynchronousTestCase):
    """docs/security.md quotes the messages the code really produces."""

    def test_security_doc(self) -> None:
        root = REPO
        with open(os.path.join(root, "docs", "security.md"), encoding="utf-8") as f:
            doc = f.read()
        verify_failed = describe_tls_failure(SSL.Error([("SSL routines", "", "certificate verify failed")]))
        self.assertIn(f"dispatcher unreachable ({verify_failed}); retrying in the background", doc)
        self.assertIn("does not name the host in\ndispatcher_base_url", doc)
        for key in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "listen", "dispatcher_ca_file",
                    "dispatcher_client_cert_file", "dispatcher_client_key_file"):
            self.assertIn(f"`{key}`", doc)
        self.assertIn("# tls: listener certificate:", doc)
