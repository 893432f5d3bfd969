"""Fuzzing the HTTP API in memory: hypothesis generates methods, paths,
headers and bodies; each request goes over a real twisted.web HTTP exchange
(``RequestTraversalAgent``) into the Klein app, a real Node on fake children,
and the real Proxy with a fake llama-server that answers 200.

Properties: an error is always JSON in OpenAI's shape; no 5xx but the
documented upstream ones; nothing is logged at error level; and afterwards
an ordinary request still succeeds with the device's books empty."""

from __future__ import annotations

import json
import string
from typing import Any, Dict, List, Optional, Tuple

from hypothesis import example, given, settings
from hypothesis import strategies as st
from treq import content
from treq.testing import RequestTraversalAgent
from twisted.logger import ILogObserver, LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http_headers import Headers
from zope.interface import implementer

from rolemesh.http.listener import GuardedSite
from rolemesh.http.proxy import BytesProducer
from tests.api.test_app import CHAT, KEY, ApiHarness
from tests.node.test_node import MODELS

#: The node's models: the API tests' three, and one with a LoRA adapter (the
#: agent rewrites the body of a request for "l:x": its ``lora`` field).
FUZZ_MODELS = MODELS + [{"model_id": "l", "lora_adapters": [{"id": "l:x", "path": "/models/x.gguf", "scale": 0.5}]}]

#: Statuses a 5xx may have: the documented upstream/load/drain ones.
ALLOWED_5XX = {502, 503, 504}
#: Rounds of "let children start/stop, advance the clock" before a request counts as hung.
SETTLE_ROUNDS = 60

KNOWN_ROUTES = [
    "/health",
    "/metrics",
    "/v1/models",
    "/v1/node/inventory",
    "/v1/node/registration",
    "/v1/node/devices/gpu:0/logs",
    "/v1/node/devices/gpu:0/logs?tail=5",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
]
NEAR_MISSES = [
    "/",
    "/v1",
    "/v1/",
    "/health/",
    "//health",
    "/HEALTH",
    "/v1/models/",
    "/v1/models/a",
    "/v1//models",
    "/V1/MODELS",
    "/v1/chat/completions/",
    "/v1/chat/completion",
    "/v1/chat/completions?stream=true",
    "/v1/embedding",
    "/v1/node/devices/gpu:0/logs/",
    "/v1/node/devices/gpu%3A0/logs",
    "/v1/node/devices//logs",
    "/v1/node/devices/gpu:9/logs",
    "/v1/node/devices/gpu:0/logs?tail=-1",
    "/v1/node/devices/gpu:0/logs?tail=abc",
    "/v1/node/devices/gpu:0/logs?tail=100000",
    "/v1/node/devices/gpu:0/logs?tail=%ff",
    "/v1/node/devices/gpu:0/logs?tail=1&tail=2",
    "/v1/node/devices/%ff/logs",
    "/%ff",
    "/v1/models%00",
    "/v1/node/devices/gpu:0%00/logs",
]
TRAVERSAL = [
    "/v1/node/devices/..%2F..%2Fetc/logs",
    "/v1/node/devices/..%2F..%2F..%2Fetc%2Fpasswd/logs",
    "/v1/node/devices/../../etc/passwd/logs",
    "/v1/node/devices/%2e%2e/logs",
    "/v1/node/devices/..%5C..%5Cwindows/logs",
    "/../../etc/passwd",
    "/%2e%2e/%2e%2e/etc/passwd",
    "/v1/node/devices/gpu:0/../../../etc/passwd",
]
URI_CHARS = string.ascii_letters + string.digits + "-._~:/?[]@!$&'()*+,;=%"

methods = st.one_of(
    st.sampled_from(["GET", "POST", "POST", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]),
    st.from_regex(r"[A-Z][A-Z_-]{0,11}", fullmatch=True),
)
percent = st.tuples(st.sampled_from("0123456789abcdefABCDEFgz%"), st.sampled_from("0123456789abcdefABCDEFgz")).map(
    lambda pair: "%" + pair[0] + pair[1]
)
garbage_path = st.lists(st.one_of(st.text(URI_CHARS, min_size=1, max_size=12), percent), max_size=8).map(
    lambda parts: "/" + "".join(parts)
)
paths = st.one_of(
    st.sampled_from(KNOWN_ROUTES),
    st.sampled_from(KNOWN_ROUTES),
    st.sampled_from(NEAR_MISSES),
    st.sampled_from(TRAVERSAL),
    garbage_path,
    st.tuples(st.sampled_from(KNOWN_ROUTES), garbage_path).map(lambda pair: pair[0] + pair[1]),
)

#: Header bytes a client can send.  Not 0x85: twisted.web's own Content-Type
#: parsing raises on it (NEL is a line break to the email package) before
#: the request reaches any resource -- a Twisted issue, not the app's.
header_text = st.binary(max_size=40).map(lambda raw: bytes(b for b in raw if b >= 0x20 and b not in (0x7F, 0x85)))
RIGHT_KEY = b"Bearer " + KEY.encode()
authorization = st.one_of(
    st.just(RIGHT_KEY),
    st.just(RIGHT_KEY),
    st.just(RIGHT_KEY),
    st.just(RIGHT_KEY),
    st.none(),
    st.sampled_from([
        b"bearer " + KEY.encode(),
        b"Bearer " + KEY.encode() + b" ",
        b"Bearer  " + KEY.encode(),
        b"Bearer " + KEY[:-1].encode(),
        b"Bearer " + KEY.encode() + b"\xff",
        b"Basic " + KEY.encode(),
        KEY.encode(),
        b"Bearer",
        b"Bearer ",
        b"",
        b"Bearer \xc3\xa9",
    ]),
    st.one_of(header_text.map(lambda value: b"Bearer " + value), header_text),
)
extra_headers = st.dictionaries(
    st.one_of(
        st.sampled_from([b"x-request-id", b"content-type", b"accept", b"accept-encoding", b"user-agent", b"host",
                         b"x-forwarded-for", b"openai-organization", b"cookie", b"expect"]),
        st.from_regex(rb"[A-Za-z][A-Za-z0-9-]{0,15}", fullmatch=True).filter(
            lambda name: name.lower() not in {b"content-length", b"transfer-encoding", b"connection", b"host",
                                              b"authorization", b"upgrade", b"te", b"trailer", b"keep-alive",
                                              b"expect"}
        ),
    ),
    header_text,
    max_size=4,
)

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=8), children, max_size=4),
    ),
    max_leaves=12,
)
model_names = st.one_of(
    st.sampled_from(["a", "alpha", "b", "e", "emb", "chat", "summarize", "embed", "l:x", "nope", "", "A", "a ",
                     "../a", "/models/a.gguf", "a\x00", "\u00e9", "\ud800", "x" * 256, "x" * 257, "x" * 5000]),
    st.text(max_size=30),
    json_values,
)
objects = st.builds(
    lambda model, fields, keep_model: ({"model": model, **fields} if keep_model else fields),
    model_names,
    st.dictionaries(
        st.sampled_from(["messages", "prompt", "input", "stream", "max_tokens", "temperature", "n", "x"]),
        json_values,
        max_size=4,
    ),
    st.booleans(),
)


def encode_json(value: Any) -> bytes:
    return json.dumps(value).encode("utf-8", "surrogatepass")


bodies = st.one_of(
    st.none(),
    st.binary(max_size=200),
    json_values.map(encode_json),
    objects.map(encode_json),
    objects.map(encode_json),
    objects.map(encode_json),
    objects.map(lambda value: encode_json(value) + b"garbage"),
    st.integers(min_value=1, max_value=3000).map(lambda depth: b"[" * depth + b"]" * depth),
    st.integers(min_value=1, max_value=3000).map(lambda depth: b'{"model": "a", "x": ' + b"[" * depth),
    st.just(b'{"model": "a", "pad": "' + b"x" * 5000 + b'"}'),
    st.just('{"model": "a"}'.encode("utf-16")),
)


PROXIED = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
GET_ROUTES = [r for r in KNOWN_ROUTES if r not in PROXIED]
known_models = st.sampled_from(["a", "alpha", "b", "e", "emb", "chat", "summarize", "embed", "l", "l:x"])
good_objects = st.builds(
    lambda model, fields: {"model": model, **fields},
    known_models,
    st.dictionaries(st.sampled_from(["messages", "prompt", "input", "stream", "max_tokens", "x"]), json_values,
                    max_size=3),
)
#: Chat requests whose messages hold any JSON where strings belong (the
#: prefix hashes of a model on two devices read every message).
odd_chats = st.builds(
    lambda model, messages: {"model": model, "messages": messages},
    known_models,
    st.lists(st.one_of(st.dictionaries(st.sampled_from(["role", "content", "name"]), json_values, max_size=3),
                       json_values), max_size=4),
)
#: (method, path, body): mostly well-formed, so requests get past routing and auth.
requests = st.one_of(
    st.tuples(st.just("POST"), st.sampled_from(PROXIED), good_objects.map(encode_json)),
    st.tuples(st.just("POST"), st.just("/v1/chat/completions"), odd_chats.map(encode_json)),
    st.tuples(st.just("POST"), st.sampled_from(PROXIED), bodies),
    st.tuples(st.sampled_from(["GET", "HEAD"]), st.sampled_from(GET_ROUTES + NEAR_MISSES + TRAVERSAL), st.none()),
    st.tuples(methods, paths, bodies),
)


class Exchange:
    """One HTTP request over an in-memory connection to the app."""

    def __init__(self, harness: ApiHarness, fast: bool = False) -> None:
        self.harness = harness
        self.agent = RequestTraversalAgent(harness.api.resource())
        if fast:  # the listener's fast channel in front, as the agent serves
            self.agent._serverFactory = GuardedSite(  # type: ignore[attr-defined]
                harness.api.resource(), reactor=harness.reactor, idle_timeout=None, request_read_timeout=None,
                max_body_bytes=harness.config.max_request_body_bytes, fast_routes=harness.api.fast_routes())

    def settle(self, d: Any) -> List[Any]:
        """Flush, letting children start, stop and answer probes, until ``d`` fires."""
        results: List[Any] = []
        d.addBoth(results.append)
        node_h = self.harness.node_h
        for _ in range(SETTLE_ROUNDS):
            self.agent.flush()
            if results:
                return results
            for process in node_h.reactor.processes:
                if process.signals and not process.ended:
                    process.exit(0)
            node_h.reactor.advance(0.5)
        return results

    def send(self, method: bytes, uri: bytes, headers: Dict[bytes, bytes], body: Optional[bytes]) -> Tuple[Any, bytes]:
        d = self.agent.request(
            method,
            b"http://node.test" + uri,
            Headers({name: [value] for name, value in headers.items()}),
            BytesProducer(body) if body is not None else None,
        )
        results = self.settle(d)
        assert results, f"{method!r} {uri!r}: no response (hung)"
        response = results[0]
        if not hasattr(response, "code"):
            response.raiseException()
        bodies = self.settle(content(response))
        assert bodies and isinstance(bodies[0], bytes), f"{method!r} {uri!r}: body never ended: {bodies!r}"
        return response, bodies[0]


class FuzzApiTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.logged: List[Dict[str, Any]] = []

        @implementer(ILogObserver)
        def observe(event: Dict[str, Any]) -> None:
            if event.get("log_level") in (LogLevel.error, LogLevel.critical):
                self.logged.append(event)

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)

    def check_error_shape(self, method: bytes, status: int, headers: Headers, body: bytes) -> None:
        where = f"{method!r} -> {status}: {body[:300]!r}"
        self.assertEqual(headers.getRawHeaders(b"content-type"), [b"application/json"], where)
        if method == b"HEAD":
            self.assertEqual(body, b"", where)
            return
        data = json.loads(body)
        self.assertIsInstance(data, dict, where)
        self.assertEqual(set(data), {"error"}, where)
        error = data["error"]
        self.assertEqual(set(error), {"message", "type", "code"}, where)
        self.assertIsInstance(error["message"], str, where)
        self.assertIsInstance(error["type"], str, where)
        self.assertIsInstance(error["code"], (str, type(None)), where)
        self.assertNotIn("Traceback", error["message"], where)

    def ordinary_request_succeeds(self, exchange: Exchange) -> None:
        headers = {b"authorization": b"Bearer " + KEY.encode(), b"content-type": b"application/json"}
        response, body = exchange.send(b"POST", b"/v1/chat/completions", headers,
                                       json.dumps({"model": "a", **CHAT}).encode())
        self.assertEqual(response.code, 200, body)
        self.assertEqual(json.loads(body)["model"], "a")

    @settings(max_examples=400)
    @example(request=("POST", "/v1/chat/completions", b"[" * 3000), auth=RIGHT_KEY, headers={}, fast=True, devices=1)
    @example(request=("POST", "/v1/chat/completions", b"[" * 3000), auth=RIGHT_KEY, headers={}, fast=False, devices=1)
    @example(request=("GET", "/v1/node/devices/%ff/logs", None), auth=RIGHT_KEY, headers={}, fast=True, devices=1)
    @example(request=("GET", "/v1/models", None), auth=RIGHT_KEY, headers={b"host": b"\xff"}, fast=True, devices=1)
    @example(request=("POST", "/v1/chat/completions", b'{"model": "b", "stream": true}'),
             auth=RIGHT_KEY, headers={b"x-request-id": b"\xff\xfe"}, fast=True, devices=1)
    @example(request=("POST", "/v1/embeddings", b'{"model": "emb", "input": "x"}'),
             auth=RIGHT_KEY, headers={b"host": b"\xff"}, fast=True, devices=1)
    @example(request=("POST", "/v1/chat/completions", b'{"model": "a", "messages": [{"role": {"x": 1}}]}'),
             auth=RIGHT_KEY, headers={}, fast=True, devices=2)
    @given(request=requests, auth=authorization, headers=extra_headers, fast=st.booleans(),
           devices=st.sampled_from([1, 2]))
    def test_api_never_breaks(self, request: Tuple[str, str, Optional[bytes]], auth: Optional[bytes],
                              headers: Dict[bytes, bytes], fast: bool, devices: int) -> None:
        """One device, or two (a model on both: prefix affinity hashes the
        prompt); a model with a LoRA adapter among the models."""
        method, path, body = request
        harness = ApiHarness(keys=(KEY,), devices=devices, max_request_body_bytes=4096, models=FUZZ_MODELS)
        node_h = harness.node_h
        node_h.probe.ready = {"alpha", "b", "emb", "l"}  # every child answers its probe once started
        node_h.load("a")
        exchange = Exchange(harness, fast=fast)
        self.logged.clear()

        sent = dict(headers)
        if auth is not None:
            sent[b"authorization"] = auth
        response, answer = exchange.send(method.encode(), path.encode(), sent, body)

        status = response.code
        where = f"{method} {path!r} -> {status}: {answer[:300]!r}"
        self.assertTrue(200 <= status < 600, where)
        if status >= 500:
            self.assertIn(status, ALLOWED_5XX, where)
        if 300 <= status < 400:
            self.assertTrue(response.headers.getRawHeaders(b"location"), f"{where}: a redirect says where to")
        if status >= 400:
            self.check_error_shape(method.encode(), status, response.headers, answer)
        self.assertEqual(self.flushLoggedErrors(), [], where)
        self.assertEqual(self.logged, [], where)

        # The device is never wedged: books empty, and an ordinary request works.
        self.assertTrue(node_h.idle(), where)
        self.ordinary_request_succeeds(exchange)
        self.assertTrue(node_h.idle(), where)
        self.assertEqual(self.logged, [], where)
