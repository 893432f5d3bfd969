"""A bare twisted.web relay: the floor any Python HTTP hop pays on this machine.

No routing, no JSON parsing, no scheduling, no logging: every request is sent
as it came (method, path, body, content type) to one upstream over a
persistent ``HTTPConnectionPool``, and the answer's status, headers and body
are streamed back as they arrive (the upstream transport is registered as the
downstream request's producer, like the agent's proxy does).  A request that
fails on a stale pooled connection before anything was sent is retried once,
as the agent does (llama-server closes its side after every streamed answer).

    python bench/bare_relay.py --port 9000 --upstream http://127.0.0.1:8080

Used by ``bench/proxy_overhead.py`` as the "floor" column.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from twisted.internet import defer
from twisted.internet.protocol import Protocol
from twisted.web import server
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer
from twisted.web.resource import Resource
from zope.interface import implementer

_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
                  b"content-length", b"server", b"date"})


@implementer(IBodyProducer)
class _Body:
    def __init__(self, data: bytes) -> None:
        self._data = data
        self.length = len(data)

    def startProducing(self, consumer: Any) -> "defer.Deferred[None]":
        consumer.write(self._data)
        return defer.succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


class _Copy(Protocol):
    def __init__(self, request: Any) -> None:
        self._request = request

    def connectionMade(self) -> None:
        self._request.registerProducer(self.transport, True)

    def dataReceived(self, data: bytes) -> None:
        self._request.write(data)

    def connectionLost(self, reason: Any) -> None:
        self._request.unregisterProducer()
        if not self._request.finished and not getattr(self._request, "_disconnected", False):
            self._request.finish()


class Relay(Resource):
    isLeaf = True

    def __init__(self, reactor: Any, upstream: str) -> None:
        super().__init__()
        self._upstream = upstream.rstrip("/").encode("ascii")
        pool = HTTPConnectionPool(reactor, persistent=True)
        pool.maxPersistentPerHost = 16
        pool.retryAutomatically = False
        self._agent = Agent(reactor, pool=pool)

    def render(self, request: Any) -> Any:
        body = request.content.read()
        content_type = request.requestHeaders.getRawHeaders(b"content-type", [b"application/json"])
        headers = Headers({b"content-type": content_type, b"accept": [b"*/*"]})
        url = self._upstream + request.uri
        producer = _Body(body) if body or request.method == b"POST" else None

        def send() -> "defer.Deferred[Any]":
            return self._agent.request(request.method, url, headers, producer)

        def retry(failure: Any) -> Any:
            from twisted.web._newclient import RequestNotSent, RequestTransmissionFailed, ResponseNeverReceived

            if failure.check(RequestNotSent, RequestTransmissionFailed, ResponseNeverReceived):
                return send()
            return failure

        def respond(response: Any) -> None:
            request.setResponseCode(response.code, response.phrase)
            for name, values in response.headers.getAllRawHeaders():
                if name.lower() not in _HOP:
                    request.responseHeaders.setRawHeaders(name, values)
            response.deliverBody(_Copy(request))

        def failed(failure: Any) -> None:
            if not request.finished and not getattr(request, "_disconnected", False):
                request.setResponseCode(502)
                request.write(b'{"error": "upstream failed"}')
                request.finish()

        d = send()
        d.addErrback(retry)
        d.addCallbacks(respond, failed)
        return server.NOT_DONE_YET


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--upstream", required=True, help="e.g. http://127.0.0.1:8080")
    args = parser.parse_args(argv)

    from twisted.internet import reactor

    site = server.Site(Relay(reactor, args.upstream))
    site.noisy = False
    site.log = lambda request: None  # no access log: this is the floor
    reactor.listenTCP(args.port, site, interface=args.host)
    sys.stdout.write(f"bare relay on http://{args.host}:{args.port} -> {args.upstream}\n")
    sys.stdout.flush()
    reactor.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
