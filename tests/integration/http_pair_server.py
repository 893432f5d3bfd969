"""Two listeners on one app, for the differential fuzzer: the agent's own
(:class:`~rolemesh.http.listener.GuardedSite`, with fast routes) and plain
twisted.web's ``Site``, the library it replaced.

Run as ``python tests/integration/http_pair_server.py``: prints
``{"ours": PORT, "twisted_web": PORT}`` once both listen, serves until
killed (or its stdin closes).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from twisted.internet import defer, reactor, stdio
from twisted.internet.protocol import Protocol
from twisted.web.resource import Resource
from twisted.web.server import Site

from rolemesh.http.listener import GuardedSite


def describe(method: bytes, path: bytes, body: bytes) -> bytes:
    return b"%s %s %d" % (method, path, len(body))


class App(Resource):
    isLeaf = True

    def render(self, request: Any) -> bytes:
        return describe(request.method, request.path, request.content.read())


def fast(request: Any) -> "defer.Deferred[bytes]":
    return defer.succeed(describe(request.method, request.path, request.content.read()))


class _StopOnEOF(Protocol):
    def connectionLost(self, reason: Any = None) -> None:  # noqa: N802 - Twisted's name
        if reactor.running:  # type: ignore[attr-defined]
            reactor.stop()  # type: ignore[attr-defined]


def main() -> None:
    ours = GuardedSite(App(), reactor=reactor, max_body_bytes=1 << 20, request_read_timeout=30,
                       fast_routes={(b"POST", b"/v1/chat/completions"): fast, (b"GET", b"/health"): fast})
    plain = Site(App())
    a = reactor.listenTCP(0, ours, interface="127.0.0.1")  # type: ignore[attr-defined]
    b = reactor.listenTCP(0, plain, interface="127.0.0.1")  # type: ignore[attr-defined]
    sys.stdout.write(json.dumps({"ours": a.getHost().port, "twisted_web": b.getHost().port}) + "\n")
    sys.stdout.flush()
    stdio.StandardIO(_StopOnEOF())
    reactor.run()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
