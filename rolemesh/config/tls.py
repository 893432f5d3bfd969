"""TLS for both hops the agent owns: its listener and its dispatcher client.

Two kinds of code live here, kept apart:

- pure checks on already-parsed certificates (:func:`key_matches`,
  :func:`validity_problem`, :func:`describe_certificate`,
  :func:`split_endpoint_description`), which hypothesis and unit tests can
  hammer without files;
- the edges that read PEM files and build Twisted's TLS objects:
  :class:`ServerTLS` (the listener's connection creator, whose
  :meth:`ServerTLS.reload` swaps in re-read certificate files for new
  connections while connections in flight keep the context they started
  with) and :func:`dispatcher_tls_policy` (an ``IPolicyForHTTPS`` that
  verifies the dispatcher against the system store or a CA file and can
  present a client certificate).

Every problem a user can cause (a missing or unreadable file, a key that
does not belong to its certificate, an expired certificate, an encrypted
key) is a one-line :class:`~rolemesh.base.errors.ConfigError` naming the config
key.  Key material is never put into a message or a log line.
"""

from __future__ import annotations

import datetime
import re
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import attr
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtensionOID, NameOID
from OpenSSL import SSL, crypto
from twisted.internet import ssl
from twisted.internet.interfaces import (
    IOpenSSLClientConnectionCreator,
    IOpenSSLServerConnectionCreator,
)
from twisted.logger import Logger
from twisted.web.iweb import IPolicyForHTTPS
from zope.interface import implementer

from rolemesh.base.errors import ConfigError

if TYPE_CHECKING:
    from twisted.protocols.tls import TLSMemoryBIOProtocol

log = Logger(namespace="rolemesh.tls")

#: The oldest protocol either side of the agent speaks.
MINIMUM_TLS_VERSION = ssl.TLSVersion.TLSv1_2


@attr.s(auto_attribs=True, frozen=True)
class ServerTLSFiles:
    """Where the listener's certificate material lives (paths only)."""

    cert_file: str
    key_file: str
    #: With it, clients must present a certificate signed by one of these CAs.
    client_ca_file: Optional[str] = None


@attr.s(auto_attribs=True, frozen=True)
class ClientTLSFiles:
    """How the dispatcher client verifies, and identifies itself (paths only)."""

    #: None = the system's trust store.
    ca_file: Optional[str] = None
    cert_file: Optional[str] = None
    key_file: Optional[str] = None


class TLSConfig(Protocol):
    """What the reload hooks (:meth:`ServerTLS.reload_for`,
    :meth:`DispatcherTLSPolicy.reload_for`) read of the running config: a
    :class:`~rolemesh.config.file.NodeConfig`, whose module imports this one."""

    @property
    def tls(self) -> Optional[ServerTLSFiles]: ...

    @property
    def dispatcher_tls(self) -> Optional[ClientTLSFiles]: ...


@attr.s(auto_attribs=True, frozen=True)
class CertificateSummary:
    """What ``--check`` and the logs may say about a certificate (no key material)."""

    subject: str
    names: Tuple[str, ...]
    not_after: datetime.datetime
    chain_length: int

    def line(self, now: datetime.datetime) -> str:
        days = (self.not_after - now).total_seconds() / 86400
        names = ", ".join(self.names) if self.names else "no subjectAltName"
        chain = f", {self.chain_length - 1} intermediate(s)" if self.chain_length > 1 else ""
        return (f"{self.subject} [{names}]{chain}, valid until "
                f"{self.not_after.strftime('%Y-%m-%d %H:%M UTC')} ({days:.0f} days left)")


# --------------------------------------------------------------------------
# Pure checks


def _public_bytes(public_key: Any) -> bytes:
    return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def key_matches(certificate: x509.Certificate, private_key: Any) -> bool:
    """True when ``private_key`` is the key of ``certificate``."""
    return _public_bytes(certificate.public_key()) == _public_bytes(private_key.public_key())


def validity_problem(certificate: x509.Certificate, now: datetime.datetime) -> Optional[str]:
    """Why ``certificate`` cannot be used at ``now`` (UTC, aware), or None."""
    if now >= certificate.not_valid_after_utc:
        return f"expired on {certificate.not_valid_after_utc.strftime('%Y-%m-%d %H:%M UTC')}"
    if now < certificate.not_valid_before_utc:
        return f"not valid before {certificate.not_valid_before_utc.strftime('%Y-%m-%d %H:%M UTC')}"
    return None


def describe_certificate(chain: Sequence[x509.Certificate]) -> CertificateSummary:
    """Subject, DNS/IP names and expiry of the first certificate of ``chain``."""
    leaf = chain[0]
    common = leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    subject = f"CN={common[0].value!s}" if common else leaf.subject.rfc4514_string() or "(empty subject)"
    names: List[str] = []
    try:
        san: Any = leaf.extensions.get_extension_for_oid(ExtensionOID.SUBJECT_ALTERNATIVE_NAME).value
    except x509.ExtensionNotFound:
        pass
    else:
        names.extend(str(n) for n in san.get_values_for_type(x509.DNSName))
        names.extend(str(n) for n in san.get_values_for_type(x509.IPAddress))
    return CertificateSummary(str(subject), tuple(names), leaf.not_valid_after_utc, len(chain))


def split_endpoint_description(text: str) -> Tuple[List[str], Dict[str, str]]:
    """Split a Twisted endpoint description into positional and keyword fields.

    Twisted's syntax: fields separated by ``:``, ``key=value`` for keyword
    fields, a backslash escapes the next character.  The first positional
    field is the endpoint type.
    """
    positional: List[str] = []
    keywords: Dict[str, str] = {}
    for field in _raw_fields(text):
        cut = _unescaped_index(field, "=")
        if cut > 0:
            keywords[_unescape(field[:cut])] = _unescape(field[cut + 1:])
        else:
            positional.append(_unescape(field))
    return positional, keywords


def _raw_fields(text: str) -> List[str]:
    """``text`` split on unescaped colons, escapes kept."""
    out: List[str] = []
    start = 0
    while True:
        cut = _unescaped_index(text, ":", start)
        if cut < 0:
            out.append(text[start:])
            return out
        out.append(text[start:cut])
        start = cut + 1


def _unescaped_index(text: str, char: str, start: int = 0) -> int:
    i = start
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == char:
            return i
        i += 1
    return -1


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text, flags=re.DOTALL)


def escape_endpoint_value(text: str) -> str:
    """``text`` escaped for use as one field of an endpoint description."""
    return text.replace("\\", "\\\\").replace(":", "\\:").replace("=", "\\=")


def describe_tls_failure(error: Optional[BaseException]) -> Optional[str]:
    """A one-line account of a failed TLS handshake, or None if ``error`` is not one."""
    if isinstance(error, SSL.Error):
        reasons = [r[2] for r in (error.args[0] if error.args and isinstance(error.args[0], list) else [])
                   if isinstance(r, tuple) and len(r) == 3 and r[2]]
        detail = "; ".join(dict.fromkeys(reasons)) or str(error) or "handshake failed"
        if "certificate verify failed" in detail:
            return (f"TLS: the dispatcher's certificate could not be verified ({detail}); "
                    "set dispatcher_ca_file to the CA that signed it")
        return f"TLS handshake failed: {detail}"
    try:
        from service_identity.exceptions import VerificationError
    except ImportError:  # pragma: no cover - service_identity is a dependency
        return None
    if isinstance(error, VerificationError):
        return ("TLS: the dispatcher's certificate does not name the host in dispatcher_base_url "
                f"({error})")
    return None


# --------------------------------------------------------------------------
# Reading files (the edge)


def _read(key: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise ConfigError(f'{key}: file not found: "{path}"') from None
    except IsADirectoryError:
        raise ConfigError(f'{key}: is a directory, expected a PEM file: "{path}"') from None
    except OSError as e:
        raise ConfigError(f'{key}: cannot read "{path}": {e.strerror}') from None


def load_certificates(key: str, path: str) -> List[x509.Certificate]:
    """Every PEM certificate in ``path`` (leaf first, for a chain)."""
    data = _read(key, path)
    try:
        certificates = x509.load_pem_x509_certificates(data)
    except ValueError:
        certificates = []
    if not certificates:
        raise ConfigError(f'{key}: no PEM certificate in "{path}"')
    return certificates


def load_private_key(key: str, path: str) -> Any:
    """The PEM private key in ``path``; never echoes its content."""
    data = _read(key, path)
    if b"PRIVATE KEY-----" not in data:
        raise ConfigError(f'{key}: no PEM private key in "{path}"')
    try:
        private_key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise ConfigError(
            f'{key}: "{path}" is encrypted; the agent needs an unencrypted key '
            "(readable only by the agent's user)"
        ) from None
    except (ValueError, Exception):  # noqa: BLE001 - any parse failure is one line, no key material
        raise ConfigError(f'{key}: "{path}" does not hold a usable PEM private key') from None
    try:
        _openssl_key(private_key)  # X25519, X448, DH and newer kinds parse, but TLS here cannot sign with them
    except TypeError:
        raise ConfigError(
            f'{key}: "{path}" holds a key of kind {type(private_key).__name__.replace("PrivateKey", "")}, '
            "which TLS cannot use here; "
            "use an RSA, EC or Ed25519 key"
        ) from None
    return private_key


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def load_key_pair(cert_key: str, cert_file: str, key_key: str, key_file: str,
                  now: datetime.datetime) -> Tuple[List[x509.Certificate], Any]:
    """Certificate chain and key, checked: the key matches, the leaf is valid at ``now``."""
    chain = load_certificates(cert_key, cert_file)
    private_key = load_private_key(key_key, key_file)
    if not key_matches(chain[0], private_key):
        raise ConfigError(f'{key_key}: the key in "{key_file}" does not belong to the certificate in "{cert_file}"')
    problem = validity_problem(chain[0], now)
    if problem is not None:
        raise ConfigError(f'{cert_key}: the certificate in "{cert_file}" {problem}')
    return chain, private_key


def _openssl_x509(certificate: x509.Certificate) -> crypto.X509:
    return crypto.X509.from_cryptography(certificate)


def _openssl_key(private_key: Any) -> crypto.PKey:
    return crypto.PKey.from_cryptography_key(private_key)


def _trust_root(cas: Sequence[x509.Certificate]) -> Any:  # Twisted's IOpenSSLTrustRoot is private
    return ssl.trustRootFromCertificates([ssl.Certificate(_openssl_x509(c)) for c in cas])


# --------------------------------------------------------------------------
# The listener


@attr.s(auto_attribs=True, frozen=True)
class _Loaded:
    options: ssl.CertificateOptions
    summary: CertificateSummary
    client_cas: int


def _load_server(files: ServerTLSFiles, now: datetime.datetime) -> _Loaded:
    chain, private_key = load_key_pair("tls_cert_file", files.cert_file, "tls_key_file", files.key_file, now)
    kwargs: Dict[str, Any] = {}
    client_cas = 0
    if files.client_ca_file is not None:
        cas = load_certificates("tls_client_ca_file", files.client_ca_file)
        kwargs["trustRoot"] = _trust_root(cas)
        client_cas = len(cas)
    options = ssl.CertificateOptions(
        privateKey=_openssl_key(private_key),
        certificate=_openssl_x509(chain[0]),
        extraCertChain=[_openssl_x509(c) for c in chain[1:]],
        raiseMinimumTo=MINIMUM_TLS_VERSION,
        **kwargs,
    )
    try:
        options.getContext()  # builds the SSL context now, so a bad file fails here, not per connection
    except SSL.Error as e:
        raise ConfigError(f'tls_cert_file: OpenSSL cannot use "{files.cert_file}": {e}') from None
    return _Loaded(options, describe_certificate(chain), client_cas)


@implementer(IOpenSSLServerConnectionCreator)
class ServerTLS:
    """The listener's TLS: a connection creator whose certificate can be reloaded.

    Each new connection gets an ``SSL.Connection`` on the current context;
    :meth:`reload` builds a new context from the files and swaps it in, so
    connections already open (and their in-flight requests) keep the old
    one until they close, and new connections present the new certificate.
    ``now`` returns the current UTC time (injected for tests).
    """

    def __init__(self, files: ServerTLSFiles,
                 now: Callable[[], datetime.datetime] = _now) -> None:
        self._now = now
        self.files = files
        self._loaded = _load_server(files, now())

    @property
    def summary(self) -> CertificateSummary:
        return self._loaded.summary

    @property
    def verifies_clients(self) -> bool:
        return self.files.client_ca_file is not None

    def describe(self) -> str:
        """One line for the log: who we are and until when; mTLS or not."""
        text = self._loaded.summary.line(self._now())
        if self.files.client_ca_file is not None:
            text += f"; client certificates required (CA file {self.files.client_ca_file})"
        return text

    def reload(self, files: Optional[ServerTLSFiles] = None) -> CertificateSummary:
        """Re-read the certificate, key and client CA files; use them for new connections.

        ``files`` replaces the paths (e.g. from a reloaded config); without it
        the same paths are read again (a rotated certificate).  On any
        problem this raises :class:`ConfigError` (one line) and keeps
        serving with the previous certificate.  Connections already open are
        not touched.
        """
        files = files or self.files
        loaded = _load_server(files, self._now())
        self.files, self._loaded = files, loaded
        log.info("TLS certificate reloaded: {certificate}", certificate=self.describe())
        return loaded.summary

    def reload_for(self, config: TLSConfig) -> Optional[str]:
        """The config-reload hook (:meth:`rolemesh.node.reload.Reloader.add_self_reloading`).

        Re-reads the files ``config.tls`` names (the running paths: a change
        of path needs a restart, the reload reports it); never raises for bad
        files: the previous certificate stays and the one-line reason is
        logged and returned.
        """
        files = getattr(config, "tls", None) or self.files
        try:
            self.reload(files)
        except ConfigError as e:
            log.error("TLS certificate not reloaded, still serving the previous one: {error}", error=str(e))
            return f"kept the previous certificate: {e}"
        return f"certificate reloaded: {self.describe()}"

    def serverConnectionForTLS(self, tlsProtocol: TLSMemoryBIOProtocol) -> SSL.Connection:  # noqa: N802 - Twisted's name
        return SSL.Connection(self._loaded.options.getContext(), None)


def check_server_files(files: ServerTLSFiles, now: Optional[datetime.datetime] = None) -> List[str]:
    """What ``--check`` reports about the listener's TLS files; ConfigError if unusable."""
    loaded = _load_server(files, now or _now())
    lines = [f"listener certificate: {loaded.summary.line(now or _now())}"]
    if files.client_ca_file is not None:
        lines.append(f"client certificates required: signed by one of {loaded.client_cas} CA certificate(s) "
                     f"in {files.client_ca_file}")
    return lines


# --------------------------------------------------------------------------
# The dispatcher client


@implementer(IPolicyForHTTPS)
class DispatcherTLSPolicy:
    """``optionsForClientTLS`` for every HTTPS dispatcher connection.

    Like treq's default (``BrowserLikePolicyForHTTPS``: the host name is
    checked, the chain verified), plus a configurable trust root, an
    optional client certificate and TLS 1.2 at least.
    """

    def __init__(self, trust_root: Any = None, client_certificate: Optional[ssl.PrivateCertificate] = None,
                 files: Optional[ClientTLSFiles] = None,
                 now: Callable[[], datetime.datetime] = _now) -> None:
        self._trust_root = trust_root
        self._client_certificate = client_certificate
        #: Where the CA file and client certificate came from (for :meth:`reload`).
        self.files = files
        self._now = now

    def reload(self, files: Optional[ClientTLSFiles] = None) -> None:
        """Re-read the CA file and client certificate; later connections use
        them.  ConfigError (one line) leaves the previous ones in place."""
        files = files or self.files or ClientTLSFiles()
        fresh = dispatcher_tls_policy(files, self._now())
        self.files, self._trust_root, self._client_certificate = files, fresh._trust_root, fresh._client_certificate
        log.info("dispatcher TLS files reloaded")

    def reload_for(self, config: TLSConfig) -> Optional[str]:
        """The config-reload hook, like :meth:`ServerTLS.reload_for`."""
        try:
            self.reload(getattr(config, "dispatcher_tls", None) or self.files)
        except ConfigError as e:
            log.error("dispatcher TLS files not reloaded, still using the previous ones: {error}", error=str(e))
            return f"kept the previous dispatcher TLS files: {e}"
        return "dispatcher CA and client certificate reloaded"

    def creatorForNetloc(self, hostname: bytes, port: int) -> IOpenSSLClientConnectionCreator:  # noqa: N802 - Twisted's name
        return ssl.optionsForClientTLS(
            hostname.decode("ascii"),
            trustRoot=self._trust_root,
            clientCertificate=self._client_certificate,
            extraCertificateOptions={"raiseMinimumTo": MINIMUM_TLS_VERSION},
        )


def _client_material(files: ClientTLSFiles, now: datetime.datetime
                     ) -> Tuple[Optional[List[x509.Certificate]], Optional[Tuple[List[x509.Certificate], Any]]]:
    cas = load_certificates("dispatcher_ca_file", files.ca_file) if files.ca_file is not None else None
    pair = None
    if files.cert_file is not None:
        pair = load_key_pair("dispatcher_client_cert_file", files.cert_file,
                             "dispatcher_client_key_file", files.key_file or files.cert_file, now)
    return cas, pair


def dispatcher_tls_policy(files: ClientTLSFiles, now: Optional[datetime.datetime] = None) -> DispatcherTLSPolicy:
    """The policy for :class:`~rolemesh.fleet.dispatcher.DispatcherClient`; ConfigError on bad files."""
    cas, pair = _client_material(files, now or _now())
    trust = _trust_root(cas) if cas is not None else None  # None: optionsForClientTLS uses platformTrust()
    client = None
    if pair is not None:
        chain, private_key = pair
        client = ssl.PrivateCertificate.fromCertificateAndKeyPair(
            ssl.Certificate(_openssl_x509(chain[0])), ssl.KeyPair(_openssl_key(private_key)))
    return DispatcherTLSPolicy(trust, client, files)


def check_client_files(files: ClientTLSFiles, now: Optional[datetime.datetime] = None) -> List[str]:
    """What ``--check`` reports about the dispatcher client's TLS files."""
    when = now or _now()
    cas, pair = _client_material(files, when)
    lines = []
    if cas is not None:
        lines.append(f"dispatcher verified against {len(cas)} CA certificate(s) in {files.ca_file}")
    else:
        lines.append("dispatcher verified against the system trust store")
    if pair is not None:
        lines.append(f"dispatcher client certificate: {describe_certificate(pair[0]).line(when)}")
    return lines
