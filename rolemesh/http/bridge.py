"""twisted.web behind the fast channel, for the requests it does not serve
itself (other routes, a query string, HTTP/1.0, ``fast_path: false``).

Apart from :mod:`rolemesh.http.fast_channel` because it is a different
contract: twisted.web's ``HTTPChannel`` is handed a canonical copy of each
such request (one ``Content-Length``, no transfer coding, no expectation),
never the client's own bytes, and writes to the client through a transport
that keeps the fast channel the client transport's one producer.
"""

from __future__ import annotations

from typing import Any, List, Optional, Protocol

from twisted.internet.interfaces import IAddress, ISSLTransport
from twisted.web.http import HTTPChannel
from zope.interface import alsoProvides

from rolemesh.http.request_reader import Incoming


class BridgeOwner(Protocol):
    """What the bridge asks of the fast channel in front of it (a protocol,
    so that this module needs not import that one)."""

    def close(self) -> None:
        """Close the client connection once what is written is sent."""

    def bridged_done(self) -> None:
        """twisted.web finished answering the request it was given."""

#: Headers the canonical copy for twisted.web leaves out (it gets one
#: Content-Length instead, and no expectation: those were dealt with here).
_FRAMING = frozenset({b"content-length", b"transfer-encoding", b"expect", b"upgrade"})


def canonical_copy(incoming: Incoming) -> bytes:
    """``incoming`` written again for twisted.web, canonically."""
    lines = [b"%s %s HTTP/%s\r\n" % (incoming.method, incoming.target, incoming.version.encode("ascii"))]
    for name, value in incoming.raw:
        if name.lower() not in _FRAMING:
            lines += (name, b": ", value, b"\r\n")
    if incoming.framed or incoming.body:
        lines.append(b"Content-Length: %d\r\n" % len(incoming.body))
    lines += (b"\r\n", incoming.body)
    return b"".join(lines)


class BridgeTransport:
    """What the twisted.web channel behind a :class:`~rolemesh.http.fast_channel.FastChannel` writes to:
    the client's transport, except that producers go to the fast channel
    (the transport's one producer) and reading is not its to pause (it
    provides no ``IPushProducer``, so ``HTTPChannel`` leaves it alone)."""

    def __init__(self, channel: BridgeOwner, transport: Any) -> None:
        self._channel = channel
        self._transport = transport
        if ISSLTransport.providedBy(transport):
            alsoProvides(self, ISSLTransport)

    def write(self, data: bytes) -> None:
        self._transport.write(data)

    def writeSequence(self, data: List[bytes]) -> None:  # noqa: N802 - ITransport's name
        self._transport.writeSequence(data)

    def loseConnection(self) -> None:  # noqa: N802 - ITransport's name
        self._channel.close()

    def abortConnection(self) -> None:  # noqa: N802 - ITCPTransport's name
        self._transport.abortConnection()

    def getPeer(self) -> IAddress:  # noqa: N802 - ITransport's name
        return self._transport.getPeer()  # type: ignore[no-any-return]

    def getHost(self) -> IAddress:  # noqa: N802 - ITransport's name
        return self._transport.getHost()  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        # The rest (a TLS peer certificate, connected, ...); never what
        # zope.interface asks (__providedBy__, __conform__): this is no
        # producer whatever the transport is.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._transport, name)


class BridgeChannel(HTTPChannel):
    """twisted.web's channel for the requests a :class:`~rolemesh.http.fast_channel.FastChannel` does not
    serve itself: it is fed one canonical request at a time and tells the
    fast channel when that request is answered."""

    owner: Optional[BridgeOwner] = None

    def requestDone(self, request: Any) -> None:  # noqa: N802 - HTTPChannel's name
        super().requestDone(request)
        if self.owner is not None:
            self.owner.bridged_done()
