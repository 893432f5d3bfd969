"""The listener's own cost per request, in process: one source tree's
``FastChannel`` fed the chat completion ``bench/capacity.py`` sends, with a
route that answers at once; and the two parsers the listener could use
(llhttp through ``httptools``, pure-Python ``h11``) on the same bytes.

    python bench/listener_micro.py [TREE] [--requests 50000]

TREE is a directory holding ``rolemesh/`` (default: this checkout; an older
one from ``git archive <commit> | tar -x -C DIR``). Figures are microseconds
per request, three repeats; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BODY = (b'{"model": "tiny", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 1, '
        b'"temperature": 0, "stream": false}')
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8090\r\nAccept-Encoding: identity\r\n"
           b"Content-Length: %d\r\nContent-Type: application/json\r\nAuthorization: Bearer k\r\n\r\n" % len(BODY)
           ) + BODY


def channel_cost(n: int) -> float:
    from twisted.internet.defer import succeed
    from twisted.internet.task import Clock
    from twisted.internet.testing import StringTransport
    from twisted.web.resource import Resource

    import rolemesh.http.listener as listener

    def route(request):  # type: ignore[no-untyped-def]
        request.getHeader(b"authorization")
        return succeed(b'{"ok": 1}')

    class Allow:
        def refuse_head(self, method, path, headers):  # type: ignore[no-untyped-def]
            return None

    takes_policy = "head_policy" in inspect.signature(listener.GuardedSite.__init__).parameters  # older trees: no
    kw = {"head_policy": Allow()} if takes_policy else {}
    site = listener.GuardedSite(Resource(), reactor=Clock(), max_body_bytes=1 << 23,
                                fast_routes={(b"POST", b"/v1/chat/completions"): route}, **kw)
    channel = site.buildProtocol(None)
    transport = StringTransport()
    channel.makeConnection(transport)
    start = time.perf_counter()
    for i in range(n):
        channel.dataReceived(REQUEST)
        if i % 1000 == 0:
            transport.clear()
    return (time.perf_counter() - start) / n


def httptools_cost(n: int) -> float:
    import httptools

    class Sink:
        def on_url(self, url: bytes) -> None: ...
        def on_header(self, name: bytes, value: bytes) -> None: ...
        def on_body(self, body: bytes) -> None: ...
        def on_message_complete(self) -> None: ...

    parser = httptools.HttpRequestParser(Sink())
    start = time.perf_counter()
    for _ in range(n):
        parser.feed_data(REQUEST)
    return (time.perf_counter() - start) / n


def h11_cost(n: int) -> float:
    import h11

    conn = h11.Connection(h11.SERVER)
    start = time.perf_counter()
    for _ in range(n):
        conn.receive_data(REQUEST)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA or isinstance(event, h11.EndOfMessage):
                break
        conn.send(h11.Response(status_code=200, headers=[("Content-Length", "2")]))
        conn.send(h11.Data(data=b"ok"))
        conn.send(h11.EndOfMessage())
        conn.start_next_cycle()
    return (time.perf_counter() - start) / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree", nargs="?", default=ROOT)
    parser.add_argument("--requests", type=int, default=50000)
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.tree))
    import rolemesh

    print(f"tree: {os.path.dirname(os.path.abspath(rolemesh.__file__))}")
    for name, cost, n in (("fast channel", channel_cost, args.requests), ("httptools parse", httptools_cost,
                                                                         args.requests),
                          ("h11 parse + framing", h11_cost, args.requests // 5)):
        try:
            figures = [cost(n) * 1e6 for _ in range(3)]
        except ImportError as e:
            print(f"{name:20}  skipped ({e})")
            continue
        print(f"{name:20}  " + "  ".join(f"{f:6.2f}" for f in figures) + "  us per request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
