"""The whole llama-server API through the node (issue 36), over fakes:
the routes of the table beyond chat, each API's error shape, keys as
``x-api-key``, requests that name no model (or one of their own), token
utilities that take no slot, the passthrough, and CORS.  Through Klein
and through the fast channel (``Fast*`` classes)."""

from __future__ import annotations

import json
from typing import Any, Dict, List

from twisted.trial.unittest import SynchronousTestCase

from rolemesh.api.answers import form_model
from rolemesh.api.app import ROUTES
from rolemesh.api.routes import GENERATE, TOKENS
from rolemesh.api.upstream import refusal
from rolemesh.base import errors
from rolemesh.base.errors import ConfigError
from rolemesh.config.file import NodeConfig
from rolemesh.http.listener import GuardedSite
from rolemesh.http.prompt_cache import anthropic_usage
from rolemesh.node.names import ModelNames
from rolemesh.scheduling.books import RUNNING
from rolemesh.scheduling.scheduler import Scheduler
from tests.api.test_app import CHAT, KEY, Answer, ApiHarness, ApiTestCase
from tests.fixtures.fakes import make_config
from tests.http.test_proxy import FakeResponse

MESSAGES = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def anthropic_error(test: SynchronousTestCase, answer: Answer, status: int, kind: str) -> Dict[str, Any]:
    """An Anthropic-shaped error of this status and type."""
    test.assertEqual(answer.code, status, answer.body)
    body = answer.json()
    test.assertEqual(set(body), {"type", "error"}, body)
    test.assertEqual(body["type"], "error")
    test.assertEqual(set(body["error"]), {"type", "message"})
    test.assertEqual(body["error"]["type"], kind)
    return body["error"]  # type: ignore[no-any-return]


class RouteTableTests(SynchronousTestCase):
    def test_every_route_llama_server_serves_is_declared_once(self) -> None:
        declared = {(r.method, r.path): r for r in ROUTES}
        for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/responses/input_tokens",
                     "/v1/chat/completions/input_tokens", "/v1/rerank", "/rerank", "/v1/reranking", "/infill",
                     "/tokenize", "/detokenize", "/apply-template", "/v1/audio/transcriptions", "/completion",
                     "/completions", "/chat/completions", "/embedding", "/embeddings", "/responses",
                     "/responses/input_tokens", "/chat/completions/input_tokens", "/audio/transcriptions"):
            self.assertIn(("POST", path), declared)
        self.assertIn(("GET", "/models"), declared)
        self.assertIn(("GET", "/upstream/<model>/<path:rest>"), declared)

    def test_token_utilities_take_no_slot_and_the_rest_generate(self) -> None:
        uses = {r.path: r.use for r in ROUTES if r.relayed is not None and not r.path.startswith("/upstream")
                and not r.handler.startswith("held.")}
        tokens = {"/v1/messages/count_tokens", "/v1/responses/input_tokens", "/v1/chat/completions/input_tokens",
                  "/responses/input_tokens", "/chat/completions/input_tokens", "/tokenize", "/detokenize",
                  "/apply-template"}
        self.assertEqual({p for p, use in uses.items() if use == TOKENS}, tokens)
        self.assertTrue(all(use == GENERATE for p, use in uses.items() if p not in tokens))

    def test_llama_servers_native_forms_keep_their_own_endpoint_names(self) -> None:
        names = {r.path: r.relayed for r in ROUTES if r.relayed is not None}
        # llama-server's /completions and /embeddings are its native ones, not OpenAI's.
        self.assertEqual((names["/completions"], names["/embeddings"]), ("completion", "embedding"))
        self.assertEqual((names["/chat/completions"], names["/responses"]), ("chat/completions", "responses"))


class ErrorShapeTests(SynchronousTestCase):
    def test_anthropic_paths(self) -> None:
        for path in (b"/v1/messages", b"/v1/messages?beta=true", b"/v1/messages/count_tokens"):
            self.assertTrue(errors.speaks_anthropic(path), path)
        for path in (b"/v1/messagesx", b"/v1/chat/completions", b"/messages", b""):
            self.assertFalse(errors.speaks_anthropic(path), path)

    def test_each_status_has_the_type_anthropics_sdk_maps_to_its_class(self) -> None:
        expected = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    502: "api_error", 503: "overloaded_error", 504: "timeout_error", 418: "invalid_request_error",
                    507: "api_error"}
        for status, kind in expected.items():
            body = errors.error_body(errors.ApiError(status, "m", "x", "c"), b"/v1/messages")
            self.assertEqual(body, {"type": "error", "error": {"type": kind, "message": "m"}})
            self.assertEqual(errors.error_body(errors.ApiError(status, "m", "x", "c"), b"/v1/chat/completions"),
                             {"error": {"message": "m", "type": "x", "code": "c"}})


class FormTests(SynchronousTestCase):
    BODY = (b'--XX\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\nContent-Type: audio/wav\r\n'
            b'\r\nRIFF\r\n--XX--\r\n--XX\r\n\r\n')

    def form(self, *parts: bytes) -> bytes:
        return b"".join(b"--XX\r\n" + p + b"\r\n" for p in parts) + b"--XX--\r\n"

    def test_the_model_field(self) -> None:
        body = self.form(b'Content-Disposition: form-data; name="file"; filename="model.wav"\r\n\r\n--X name="model"',
                         b'content-disposition: form-data; name="model"\r\n\r\n whisper-small ')
        self.assertEqual(form_model(b"multipart/form-data; boundary=XX", body, 1 << 20), "whisper-small")
        self.assertEqual(form_model(b'Multipart/Form-Data; boundary="XX"', body, 1 << 20), "whisper-small")

    def test_no_model_field(self) -> None:
        body = self.form(b'Content-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF')
        self.assertIsNone(form_model(b"multipart/form-data; boundary=XX", body, 1 << 20))

    def test_what_is_no_form_is_a_400(self) -> None:
        for content_type, body in ((b"application/json", b"{}"), (b"multipart/form-data", b""),
                                   (b"multipart/form-data; boundary=XX", b"--XX\r\nContent-Disposition: x")):
            with self.assertRaises(errors.ApiError) as raised:
                form_model(content_type, body, 1 << 20)
            self.assertEqual(raised.exception.status, 400)
        with self.assertRaises(errors.ApiError) as raised:
            form_model(b"multipart/form-data; boundary=XX", self.form(b"x" * 100), 10)
        self.assertEqual(raised.exception.status, 413)


class ModelNameTests(SynchronousTestCase):
    MODELS = [{"model_id": "a", "alias": "alpha", "roles": ["chat"]}, {"model_id": "b"}]

    def names(self, **top: Any) -> ModelNames:
        config = make_config(self.MODELS, **top)
        return ModelNames(lambda: config, lambda model_id: [])

    def test_no_name_goes_to_the_default_or_the_only_model(self) -> None:
        self.assertEqual(self.names(default_model="alpha").for_request(None)[0].model_id, "a")
        only = make_config([{"model_id": "solo"}])
        self.assertEqual(ModelNames(lambda: only, lambda m: []).for_request(None)[0].model_id, "solo")
        with self.assertRaises(errors.ApiError) as raised:
            self.names().for_request(None)
        self.assertEqual((raised.exception.status, raised.exception.code), (400, "missing_model"))
        self.assertIn("a, b", raised.exception.message)

    def test_an_unknown_name_is_a_404_listing_the_models_unless_it_goes_to_the_default(self) -> None:
        with self.assertRaises(errors.ApiError) as raised:
            self.names(default_model="b").for_request("claude-sonnet-4-5")
        self.assertEqual(raised.exception.status, 404)
        self.assertIn("models here: a, b", raised.exception.message)
        names = self.names(default_model="b", unknown_models="default")
        self.assertEqual(names.for_request("claude-sonnet-4-5"), (make_config(self.MODELS).model("b"), "b"))
        self.assertEqual(names.for_request("chat")[0].model_id, "a", "a role still resolves as a role")

    def test_the_config_refuses_defaults_that_name_nothing(self) -> None:
        with self.assertRaises(ConfigError) as raised:
            make_config(self.MODELS, default_model="nope")
        self.assertIn("default_model", str(raised.exception))
        with self.assertRaises(ConfigError) as raised:
            make_config(self.MODELS, unknown_models="default")
        self.assertIn("needs default_model", str(raised.exception))
        self.assertIsInstance(make_config(self.MODELS, default_model="chat"), NodeConfig)


class PinTests(SynchronousTestCase):
    """A pin takes no slot and holds off a switch until it is over."""

    def setUp(self) -> None:
        self.started: List[Any] = []
        self.s = Scheduler(["d"], 4, self.started.append)

    def test_a_pin_beside_a_full_slot_and_a_switch_that_waits_for_it(self) -> None:
        first = self.s.submit("m", parallel=1)
        self.s.model_loaded("d", "m")
        self.assertEqual(self.s.pin("m", ["d"]), "d", "the busy slot does not stop a pin")
        other = self.s.submit("other")
        self.s.finish(first)
        self.assertNotEqual(other.state, RUNNING, "no switch under the pin")
        self.s.unpin("d")
        self.assertEqual(other.state, RUNNING)
        self.assertIsNone(self.s.pin("m", ["d"]), "the lane no longer holds m")

    def test_no_pin_where_the_child_is_not_ready(self) -> None:
        self.s.model_loaded("d", "m")
        self.assertIsNone(self.s.pin("m", ["d"], ready=lambda lane: False))
        self.assertEqual(self.s.devices["d"].pinned, 0)


class UsageTests(SynchronousTestCase):
    def test_anthropic_usage(self) -> None:
        start = (b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
                 b'{"cache_read_input_tokens":21,"input_tokens":1,"output_tokens":0}}}\n\n')
        self.assertEqual(anthropic_usage(start), (21, 1))
        self.assertEqual(anthropic_usage(b'{"usage":{"input_tokens":7}}'), (0, 7))
        for data in (b"", b'{"usage": 3}', b'{"usage":{"output_tokens":1}}', b'{"usage":{"input_tokens":'):
            self.assertIsNone(anthropic_usage(data), data)


class UpstreamRefusalTests(SynchronousTestCase):
    def test_what_changes_a_child_is_refused(self) -> None:
        for method, path in ((b"POST", "/props"), (b"POST", "/slots/0?action=erase"), (b"POST", "/slots/1"),
                             (b"POST", "/lora-adapters"), (b"GET", "/tools"), (b"POST", "/cors-proxy"),
                             (b"POST", "/models/load"), (b"GET", "/models/unload")):
            found = refusal(method, path.split("?")[0])
            self.assertIsNotNone(found, (method, path))
            self.assertEqual(found.status, 403)  # type: ignore[union-attr]
        for method, path in ((b"GET", "/props"), (b"GET", "/slots"), (b"GET", "/metrics"), (b"GET", "/"),
                             (b"POST", "/v1/chat/completions"), (b"GET", "/lora-adapters"), (b"GET", "/propsx")):
            self.assertIsNone(refusal(method, path), (method, path))


def echo(attempt: Any) -> FakeResponse:
    """llama-server's answer: the method, path and body it was sent."""
    response = FakeResponse(headers={b"content-type": [b"application/json"]})
    response.autoplay = [json.dumps({"method": attempt.method.decode(), "url": attempt.url.decode(),
                                     "body": attempt.body.decode("utf-8", "replace")}).encode()]
    return response


class WholeApiTests(ApiTestCase):
    keys = (KEY,)

    def setUp(self) -> None:
        super().setUp()
        self.h.agent.auto = echo

    def test_each_route_reaches_the_same_path_on_the_models_child(self) -> None:
        self.loaded("a")
        for route in ROUTES:
            if (route.relayed is None or route.path.startswith("/upstream") or route.path.endswith("transcriptions")
                    or route.handler.startswith("held.")):  # follow-ups: tests/api/test_held_state.py
                continue
            answer = self.h.call("POST", route.path, {"model": "a", **CHAT})
            self.assertEqual(answer.code, 200, (route.path, answer.body))
            self.assertEqual(answer.json()["url"], "http://127.0.0.1:20000" + route.path)

    def test_a_transcription_names_its_model_in_the_form(self) -> None:
        self.loaded("b")
        body = (b'--XX\r\nContent-Disposition: form-data; name="model"\r\n\r\nb\r\n'
                b'--XX\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF\r\n--XX--\r\n')
        answer = self.h.call("POST", "/v1/audio/transcriptions", body,
                             headers={"Content-Type": "multipart/form-data; boundary=XX"})
        self.assertEqual(answer.code, 200, answer.body)
        self.assertEqual(answer.json()["body"], body.decode())
        attempt = self.h.agent.attempts[-1]
        self.assertEqual(attempt.headers.getRawHeaders(b"content-type"), [b"multipart/form-data; boundary=XX"])

    def test_the_anthropic_routes_answer_the_nodes_errors_in_anthropics_shape(self) -> None:
        self.loaded("a")
        anthropic_error(self, self.h.call("POST", "/v1/messages", {"model": "a", **MESSAGES}, key=None), 401,
                        "authentication_error")
        anthropic_error(self, self.h.call("POST", "/v1/messages?beta=true", {"model": "claude-x", **MESSAGES}),
                        404, "not_found_error")
        anthropic_error(self, self.h.call("POST", "/v1/messages/count_tokens", b"[1]"), 400, "invalid_request_error")
        self.h.node.draining = True
        anthropic_error(self, self.h.call("POST", "/v1/messages", {"model": "a", **MESSAGES}), 503,
                        "overloaded_error")

    def test_x_api_key_opens_every_route(self) -> None:
        self.loaded("a")
        answer = self.h.call("POST", "/v1/messages", {"model": "a", **MESSAGES}, headers={"x-api-key": KEY},
                             key=None)
        self.assertEqual(answer.code, 200, answer.body)

    def test_a_body_with_no_model_goes_to_the_default(self) -> None:
        h = ApiHarness(keys=[KEY], default_model="b")
        h.agent.auto = echo
        h.node_h.load("b")
        answer = h.call("POST", "/completion", {"prompt": "x"})
        self.assertEqual(answer.code, 200, answer.body)
        self.assertEqual(h.observed[-1]["model"], "b")

    def test_a_token_utility_is_served_beside_a_generation_on_a_full_device(self) -> None:
        h = ApiHarness(keys=[KEY], auto=False)
        h.node_h.load("a")
        streaming = h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT})
        self.assertEqual(len(h.agent.attempts), 1, "the one slot is busy")
        tokenize = h.send("POST", "/tokenize", {"model": "a", "content": "hi"})
        self.assertEqual(len(h.agent.attempts), 2, "tokenize went to the child at once, beside it")
        self.assertEqual(h.agent.attempts[-1].url, b"http://127.0.0.1:20000/tokenize")
        h.agent.attempts[-1].respond(FakeResponse(200)).finish()
        self.assertEqual(h.finish(tokenize).code, 200)
        h.agent.attempts[0].respond(FakeResponse(200)).finish()
        self.assertEqual(h.finish(streaming).code, 200)

    def test_a_token_utility_for_a_model_no_device_holds_loads_it(self) -> None:
        self.loaded("a")
        d = self.h.send("POST", "/tokenize", {"model": "b", "content": "hi"})
        self.h.node_h.reap()
        self.h.node_h.answer("b")
        self.assertEqual(self.h.finish(d).code, 200)
        self.assertEqual(self.h.node_h.model_on(), "b")

    def test_upstream_passes_any_method_and_the_query_and_refuses_what_changes_a_child(self) -> None:
        self.loaded("a")
        answer = self.h.call("GET", "/upstream/a/slots?fail_on_no_slot=1")
        self.assertEqual(answer.json()["url"], "http://127.0.0.1:20000/slots?fail_on_no_slot=1")
        self.assertEqual(answer.json()["method"], "GET")
        self.assertEqual(self.h.call("POST", "/upstream/a/props", {}).code, 403)
        error = self.assertError(self.h.call("POST", "/upstream/a/slots/0?action=erase", {}), 403, "forbidden")
        self.assertIn("changes a child's state", error["message"])
        attempts = len(self.h.agent.attempts)
        self.assertError(self.h.call("GET", "/upstream/a/props", key=None), 401)
        self.assertEqual(len(self.h.agent.attempts), attempts, "an API path without a key reaches no child")
        self.assertError(self.h.call("GET", "/upstream/nope/", key=None), 404, "model_not_found")

    def test_a_keyless_look_at_the_ui_never_loads_a_model(self) -> None:
        answer = self.h.call("GET", "/upstream/a/", key=None)
        self.assertEqual(answer.code, 503)
        self.assertIn(b"a is not loaded", answer.body)
        self.assertEqual(self.h.agent.attempts, [])
        self.assertIsNone(self.h.node_h.model_on())
        self.loaded("a")
        answer = self.h.call("GET", "/upstream/a/index.html", key=None)
        self.assertEqual((answer.code, answer.json()["url"]), (200, "http://127.0.0.1:20000/index.html"))

    def test_cors_preflight_needs_no_key_and_answers_carry_the_origin(self) -> None:
        self.loaded("a")
        preflight = self.h.call("OPTIONS", "/v1/chat/completions", key=None,
                                headers={"Origin": "http://app.test", "Access-Control-Request-Method": "POST",
                                         "Access-Control-Request-Headers": "content-type,x-api-key"})
        self.assertEqual(preflight.code, 200)
        self.assertEqual(preflight.header("access-control-allow-origin"), "http://app.test")
        self.assertEqual(preflight.header("access-control-allow-headers"), "content-type,x-api-key")
        self.assertEqual(self.h.call("OPTIONS", "/nowhere", key=None).code, 200)
        answer = self.h.chat({"model": "a", **CHAT}, headers={"Origin": "http://app.test"})
        self.assertEqual(answer.header("access-control-allow-origin"), "http://app.test")
        self.assertError(self.h.chat({"model": "a", **CHAT}, key=None, headers={"Origin": "http://app.test"}), 401)

    def test_origins_the_config_does_not_allow_get_no_cors_headers(self) -> None:
        h = ApiHarness(keys=[KEY], cors_allowed_origins=["https://ok.test"])
        h.node_h.load("a")
        self.assertIsNone(h.chat({"model": "a", **CHAT}, headers={"Origin": "http://evil.test"})
                          .header("access-control-allow-origin"))
        self.assertIsNone(h.call("OPTIONS", "/v1/models", key=None, headers={"Origin": "http://evil.test"})
                          .header("access-control-allow-methods"))
        self.assertEqual(h.chat({"model": "a", **CHAT}, headers={"Origin": "https://ok.test"})
                         .header("access-control-allow-origin"), "https://ok.test")


    def test_localhost_allows_every_loopback_origin_and_no_other(self) -> None:
        h = ApiHarness(keys=[KEY], cors_allowed_origins=["localhost"])
        for origin in ("http://localhost", "http://localhost:8080", "https://127.0.0.1:3000", "http://[::1]",
                       "http://[::1]:3000"):
            preflight = h.call("OPTIONS", "/v1/chat/completions", key=None,
                               headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
            self.assertEqual(preflight.header("access-control-allow-origin"), origin)
            self.assertEqual(preflight.header("access-control-allow-methods"), "GET, POST, DELETE, OPTIONS")
        for origin in ("http://evil.test", "http://localhost.evil.test", "http://127.0.0.1.evil.test", "null",
                       "localhost"):
            preflight = h.call("OPTIONS", "/v1/models", key=None, headers={"Origin": origin})
            self.assertIsNone(preflight.header("access-control-allow-origin"), origin)

    def test_llama_servers_tools_and_cors_proxy_are_refused_with_the_reason(self) -> None:
        for method in ("GET", "POST"):
            for path in ("/tools", "/cors-proxy?url=http://127.0.0.1:1/"):
                error = self.assertError(self.h.call(method, path, {}), 403, "forbidden")
                self.assertIn("reaches outside it", error["message"])
                self.assertError(self.h.call(method, path, {}, key=None), 401)
        self.assertEqual(self.h.agent.attempts, [])

    def test_metrics_needs_a_key_and_answers_the_exposition(self) -> None:
        self.assertEqual(self.h.call("GET", "/metrics", key=None).code, 401)
        answer = self.h.call("GET", "/metrics")
        self.assertEqual((answer.code, answer.header("content-type")),
                         (200, "text/plain; version=0.0.4; charset=utf-8"))
        self.assertIn(b"\nrolemesh_up 1\n", answer.body)

    def test_v1_health_is_health(self) -> None:
        answer = self.h.call("GET", "/v1/health", key=None)
        self.assertEqual((answer.code, answer.json()), (200, self.h.call("GET", "/health", key=None).json()))


class FastWholeApiTests(WholeApiTests):
    """The same through the listener's fast channel, with its head checks."""

    fast = True

    def setUp(self) -> None:
        super().setUp()
        site = self.h.treq._agent._serverFactory
        self.h.treq._agent._serverFactory = GuardedSite(
            self.h.api.resource(), reactor=self.h.reactor, idle_timeout=None, request_read_timeout=None,
            max_body_bytes=self.h.config.max_request_body_bytes, fast_routes=site.fast_routes,
            head_policy=self.h.api)
