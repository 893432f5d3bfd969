"""A stand-in llama-server for relay benchmarks: paced SSE streams from one thread, little CPU of its own.

The test suite's fake (``tests/fixtures/fake_llama_server.py``) runs a thread
per connection and encodes every event with ``json.dumps``: at 256 paced
streams that costs a good part of one of the two cores the proxies measured
beside it need.  This stand-in speaks just what the agent's supervisor and a
relay benchmark need, from one ``selectors`` loop:

* a llama-server command line (``--host``, ``--port``, ``--alias``/``-a``;
  every other flag ignored, with or without a value), ``--list-devices``
  answered as a CPU-only build does, and llama-server's start-up log lines
  ("model loaded", "listening on http://HOST:PORT") on stderr;
* ``GET /health``, ``GET /v1/models`` (the readiness probe), ``GET /metrics``
  and ``GET /slots`` (the agent's telemetry sampler), ``POST
  /v1/completions`` (the inference probe) and ``POST /v1/chat/completions``,
  with and without ``"stream": true``; anything else is a 404 with
  ``Connection: close``, as llama-server answers errors;
* streams as llama-server sends them: chunked ``text/event-stream``, one
  ``chat.completion.chunk`` event per token (``max_tokens`` of them, after a
  first ``role`` event; the last one with ``timings``), ``data: [DONE]``, and
  the connection closed after every stream (llama-server advertises
  keep-alive and closes anyway); non-streaming answers keep the connection.

Pacing: one global tick every ``--pace`` seconds (default 0.02) sends the next
token event of every open stream at once, as llama-server's batched decoding
step gives every busy slot its token at the same moment.  Events are padded to
``--event-bytes`` bytes each (default 330, ``data: ...\\n\\n`` included, through
the ``system_fingerprint`` value), the size of llama-server's chunks for a
long model name; the tiny test model's are ~240.

Not threaded, not a server to trust: enough protocol for the agent to supervise
it and for a relay to carry it.  Its own flags (``--pace``, ``--event-bytes``)
come first on the command line::

    python bench/paced_child.py --pace 0.02 --event-bytes 330 --port 8080 --alias tiny --model M.gguf
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import time
import uuid
from typing import Dict, List, Optional, Tuple

START = time.monotonic()
WORDS = (" hello", " world", " this", " is", " a", " paced", " stand", "-in", " token", " stream")


def log(msg: str) -> None:
    us = int((time.monotonic() - START) * 1e6)
    stamp = f"{us // 60_000_000}.{us // 1_000_000 % 60:02d}.{us // 1000 % 1000:03d}.{us % 1000:03d}"
    sys.stderr.write(f"{stamp} I {msg}\n")
    sys.stderr.flush()


def parse_argv(argv: List[str]) -> Dict[str, str]:
    """The few flags used; every other one skipped (with its value, when it has one)."""
    names = {"--host": "host", "--port": "port", "--alias": "alias", "-a": "alias", "--model": "model",
             "-m": "model", "--parallel": "parallel", "-np": "parallel", "--pace": "pace",
             "--event-bytes": "event_bytes"}
    opts = {"host": "127.0.0.1", "port": "8080", "alias": "", "model": "model", "parallel": "1",
            "pace": "0.02", "event_bytes": "330"}
    i = 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        name, eq, value = arg.partition("=")
        if eq and name in names:
            opts[names[name]] = value
        elif arg in names and i < len(argv):
            opts[names[arg]], i = argv[i], i + 1
    return opts


OPTS = parse_argv(sys.argv[1:])
PACE = float(OPTS["pace"])
EVENT_BYTES = int(OPTS["event_bytes"])
MODEL = (OPTS["alias"] or OPTS["model"]).split(",")[0]
ALIASES = [a for a in OPTS["alias"].split(",") if a]
PARALLEL = max(1, int(OPTS["parallel"]))


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def sse_event(fields: dict, cid: str, created: int) -> bytes:
    """One ``data: {...}\\n\\n`` event in llama-server's key order, padded to EVENT_BYTES."""
    event = dict(fields, created=created, id=cid, model=MODEL, system_fingerprint="b6000-",
                 object="chat.completion.chunk")
    if "timings" in fields:  # llama-server puts timings last
        event["timings"] = event.pop("timings")
    line = b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
    pad = EVENT_BYTES - len(line)
    if pad > 0:
        event["system_fingerprint"] = "b6000-" + "0" * pad
        line = b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
    return line


def timings(n: int) -> dict:
    return {"cache_n": 0, "prompt_n": 12, "prompt_ms": 1.0, "prompt_per_token_ms": 0.083,
            "prompt_per_second": 12000.0, "predicted_n": n, "predicted_ms": PACE * 1e3 * n,
            "predicted_per_token_ms": PACE * 1e3, "predicted_per_second": 1.0 / PACE if PACE else 0.0}


def response(status: str, body: bytes, ctype: bytes = b"application/json; charset=utf-8",
             close: bool = False) -> bytes:
    head = (b"HTTP/1.1 " + status.encode() + b"\r\nServer: llama.cpp\r\nAccess-Control-Allow-Origin: \r\n"
            b"Content-Type: " + ctype + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n"
            + (b"Connection: close\r\n" if close else b"Keep-Alive: timeout=5, max=100\r\n") + b"\r\n")
    return head + body


STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nAccess-Control-Allow-Origin: \r\n"
               b"X-Accel-Buffering: no\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
               b"Keep-Alive: timeout=5, max=100\r\n\r\n")


class Conn:
    __slots__ = ("sock", "inbuf", "outbuf", "close_after", "stream")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbuf = b""
        self.outbuf = b""
        self.close_after = False
        self.stream: Optional[Stream] = None


class Stream:
    __slots__ = ("conn", "left", "sent", "cid", "created")

    def __init__(self, conn: Conn, tokens: int) -> None:
        self.conn, self.left, self.sent = conn, tokens, 0
        self.cid = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())


class Server:
    def __init__(self, host: str, port: int) -> None:
        self.sel = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, port))
        self.listener.listen(1024)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self.streams: List[Stream] = []
        self.next_tick: Optional[float] = None
        self.tokens_total = 0

    # -- I/O -------------------------------------------------------------------------------

    def send(self, conn: Conn, data: bytes) -> None:
        if conn.outbuf:
            conn.outbuf += data
            return
        try:
            n = conn.sock.send(data)
        except BlockingIOError:
            n = 0
        except OSError:
            self.drop(conn)
            return
        if n < len(data):
            conn.outbuf = data[n:]
            self.sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
        elif conn.close_after and conn.stream is None:
            self.drop(conn)

    def flush(self, conn: Conn) -> None:
        try:
            n = conn.sock.send(conn.outbuf)
        except BlockingIOError:
            return
        except OSError:
            self.drop(conn)
            return
        conn.outbuf = conn.outbuf[n:]
        if not conn.outbuf:
            if conn.close_after and conn.stream is None:
                self.drop(conn)
            else:
                self.sel.modify(conn.sock, selectors.EVENT_READ, conn)

    def drop(self, conn: Conn) -> None:
        if conn.stream is not None:
            conn.stream.left = -1  # the ticker forgets it
            conn.stream = None
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def readable(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.drop(conn)
            return
        conn.inbuf += data
        while conn.stream is None and not conn.close_after:
            request = self.parse(conn)
            if request is None:
                return
            self.handle(conn, *request)

    def parse(self, conn: Conn) -> Optional[Tuple[str, str, bytes]]:
        end = conn.inbuf.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = conn.inbuf[:end].decode("latin-1").split("\r\n")
        method, path = head[0].split(" ")[:2]
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        rest = conn.inbuf[end + 4:]
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while True:
                eol = rest.find(b"\r\n")
                if eol < 0:
                    return None
                size = int(rest[:eol].split(b";")[0] or b"0", 16)
                if size == 0:
                    if rest.find(b"\r\n\r\n", eol) < 0 and not rest[eol:].startswith(b"\r\n\r\n"):
                        return None
                    rest = rest[rest.find(b"\r\n\r\n", eol) + 4:]
                    break
                if len(rest) < eol + 2 + size + 2:
                    return None
                body += rest[eol + 2:eol + 2 + size]
                rest = rest[eol + 2 + size + 2:]
        else:
            length = int(headers.get("content-length") or 0)
            if len(rest) < length:
                return None
            body, rest = rest[:length], rest[length:]
        conn.inbuf = rest
        if headers.get("connection", "").lower() == "close":
            conn.close_after = True
        return method, path.split("?", 1)[0], body

    # -- routes ----------------------------------------------------------------------------

    def handle(self, conn: Conn, method: str, path: str, body: bytes) -> None:
        if path.startswith("/v1/"):
            path = path[3:]
        close = conn.close_after
        if method == "GET" and path == "/health":
            return self.send(conn, response("200 OK", b'{"status":"ok"}', close=close))
        if method == "GET" and path == "/models":
            models = {"object": "list", "data": [{"id": MODEL, "aliases": ALIASES, "tags": [], "object": "model",
                                                  "created": int(time.time()), "owned_by": "llamacpp",
                                                  "meta": {"n_ctx_train": 2048, "n_embd": 64}}]}
            return self.send(conn, response("200 OK", json.dumps(models).encode(), close=close))
        if method == "GET" and path == "/metrics":
            text = "".join(f"# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {value}\n" for name, kind, value in (
                ("prompt_tokens_total", "counter", 12), ("tokens_predicted_total", "counter", self.tokens_total),
                ("requests_processing", "gauge", len(self.streams)), ("requests_deferred", "gauge", 0)))
            return self.send(conn, response("200 OK", text.encode(), b"text/plain; version=0.0.4", close=close))
        if method == "GET" and path == "/slots":
            slots = [{"id": i, "n_ctx": 2048, "speculative": False, "is_processing": False} for i in range(PARALLEL)]
            return self.send(conn, response("200 OK", json.dumps(slots).encode(), close=close))
        if method == "POST" and path in ("/chat/completions", "/completions", "/completion"):
            try:
                request = json.loads(body or b"{}")
            except ValueError:
                request = None
            if not isinstance(request, dict):
                return self.send(conn, response("400 Bad Request", b'{"error":{"code":400}}', close=True))
            n = request.get("max_tokens", request.get("n_predict", 16))
            n = n if isinstance(n, int) and n >= 0 else 16
            if request.get("stream") and path == "/chat/completions":
                return self.start_stream(conn, n)
            return self.send(conn, response("200 OK", self.answer(path, n), close=close))
        conn.close_after = True
        return self.send(conn, response("404 Not Found", b'{"error":{"code":404,"message":"File Not Found"}}',
                                        close=True))

    def answer(self, path: str, n: int) -> bytes:
        text = "".join(WORDS[i % len(WORDS)] for i in range(n))
        cid = "chatcmpl-" + uuid.uuid4().hex
        self.tokens_total += n
        if path == "/chat/completions":
            choice = {"finish_reason": "length", "index": 0, "message": {"role": "assistant", "content": text}}
            kind = "chat.completion"
        else:
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": "length"}
            kind = "text_completion"
        return json.dumps({"choices": [choice], "created": int(time.time()), "model": MODEL,
                           "system_fingerprint": "b6000-", "object": kind,
                           "usage": {"completion_tokens": n, "prompt_tokens": 12, "total_tokens": n + 12},
                           "id": cid, "timings": timings(n)}, separators=(",", ":")).encode()

    # -- streams ---------------------------------------------------------------------------

    def start_stream(self, conn: Conn, n: int) -> None:
        stream = Stream(conn, n)
        conn.stream = stream
        conn.close_after = True  # llama-server closes after every stream
        first = sse_event({"choices": [{"finish_reason": None, "index": 0,
                                        "delta": {"role": "assistant", "content": None}}]}, stream.cid, stream.created)
        self.send(conn, STREAM_HEAD + chunk(first))
        if conn.stream is stream:
            self.streams.append(stream)
            if self.next_tick is None:
                self.next_tick = time.monotonic() + PACE

    def tick(self) -> None:
        alive = []
        for stream in self.streams:
            if stream.left < 0:
                continue
            conn = stream.conn
            if stream.left == 0:
                last = sse_event({"choices": [{"finish_reason": "length", "index": 0, "delta": {}}],
                                  "timings": timings(stream.sent)}, stream.cid, stream.created)
                conn.stream = None
                self.send(conn, chunk(last) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                continue
            word = WORDS[stream.sent % len(WORDS)]
            event = sse_event({"choices": [{"finish_reason": None, "index": 0, "delta": {"content": word}}]},
                              stream.cid, stream.created)
            stream.sent += 1
            stream.left -= 1
            self.tokens_total += 1
            self.send(conn, chunk(event))
            if stream.left >= 0 and conn.stream is stream:
                alive.append(stream)
        self.streams = alive

    def run(self) -> None:
        while True:
            timeout = None
            if self.next_tick is not None:
                timeout = max(0.0, self.next_tick - time.monotonic())
            for key, mask in self.sel.select(timeout):
                if key.data is None:
                    while True:
                        try:
                            sock, _ = self.listener.accept()
                        except (BlockingIOError, InterruptedError):
                            break
                        sock.setblocking(False)
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        conn = Conn(sock)
                        self.sel.register(sock, selectors.EVENT_READ, conn)
                    continue
                conn = key.data
                if mask & selectors.EVENT_WRITE and conn.outbuf:
                    self.flush(conn)
                if mask & selectors.EVENT_READ and conn.sock.fileno() >= 0:
                    self.readable(conn)
            if self.next_tick is not None and time.monotonic() >= self.next_tick:
                self.tick()
                self.next_tick = (self.next_tick + PACE) if self.streams else None
                if self.next_tick is not None and self.next_tick < time.monotonic():
                    self.next_tick = time.monotonic() + PACE  # fell behind: do not burst


def main() -> int:
    if "--list-devices" in sys.argv[1:]:
        print("Available devices:")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGINT, lambda *_: os._exit(0))
    host, port = OPTS["host"], int(OPTS["port"])
    log("srv  llama_server: initializing (bench/paced_child.py, a stand-in)")
    server = Server(host, port)
    log(f"srv    load_model: loading model '{OPTS['model']}'")
    log("srv  llama_server: model loaded")
    log(f"srv  llama_server: listening on http://{host}:{server.listener.getsockname()[1]}")
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
