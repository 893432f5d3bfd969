"""The HTTP API in memory: ``StubTreq`` over the Klein resource, a real Node on
fake children, the real Proxy with a fake upstream agent."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

from treq.testing import StubTreq
from twisted.internet import defer
from twisted.internet.error import ConnectionRefusedError
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.api.answers import MAX_MODEL_NAME
from rolemesh.api.app import NodeAPI
from rolemesh.api.node_routes import MAX_LOG_TAIL
from rolemesh.api.relay import RECORD_DELAY_S
from rolemesh.base import errors
from rolemesh.children.state import READY, STARTING, STOPPING
from rolemesh.http.listener import GuardedSite
from rolemesh.http.proxy import Proxy
from tests.fixtures.fakes import stub_answer
from tests.http.test_proxy import Attempt, FakeAgent, FakeResponse
from tests.node.test_node import NodeHarness

KEY = "sk-rolemesh-test-key-0123456789"
OLD_KEY = "sk-rolemesh-old-key-9876543210"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def json_answer(attempt: Attempt) -> FakeResponse:
    """llama-server's answer: echoes which model was asked for."""
    response = FakeResponse(headers={b"content-type": [b"application/json"]})
    model = json.loads(attempt.body).get("model")
    response.autoplay = [json.dumps({"object": "chat.completion", "model": model}).encode()]
    return response


class Answer:
    """A finished HTTP exchange: status, headers, body."""

    def __init__(self, response: Any, body: bytes) -> None:
        self.code: int = response.code
        self.headers = response.headers
        self.body = body

    def header(self, name: str) -> Optional[str]:
        values = self.headers.getRawHeaders(name)
        return values[0] if values else None

    def json(self) -> Any:
        return json.loads(self.body)


class ApiHarness:
    def __init__(self, keys: Sequence[str] = (), devices: int = 1, auto: bool = True, fast: bool = False,
                 **top: Any) -> None:
        if keys:
            top["api_keys"] = list(keys)
        self.node_h = NodeHarness(devices=devices, **top)
        self.node = self.node_h.node
        self.config = self.node_h.config
        self.reactor = self.node_h.reactor
        self.agent = FakeAgent(auto=json_answer if auto else None)
        self.proxy = Proxy(reactor=self.reactor, agent=self.agent)
        self._observed: List[Dict[str, Any]] = []
        self.api = NodeAPI(
            self.config,
            self.node,
            self.proxy,
            registration=lambda: {"node_id": self.config.node_id},
            render_metrics=lambda: b"# HELP rolemesh_up up\nrolemesh_up 1\n",
            observers=[lambda event, **fields: self._observed.append(dict(fields, event=event))],
        )
        self.treq: Any = StubTreq(self.api.resource())
        self.keys = list(keys)
        #: Requests the fast channel answered itself (``fast``).
        self.fast_served = 0
        if fast:
            # The client's connections go to the listener's site, whose
            # FastChannel serves the proxied routes and hands the rest to
            # twisted.web; no deadlines, as with StubTreq's own Site.
            def counted(route: Any) -> Any:
                def serve(request: Any) -> Any:
                    self.fast_served += 1
                    return route(request)
                return serve

            routes = {path: counted(route) for path, route in self.api.fast_routes().items()}
            self.treq._agent._serverFactory = GuardedSite(
                self.api.resource(), reactor=self.reactor, idle_timeout=None, request_read_timeout=None,
                max_body_bytes=self.config.max_request_body_bytes, fast_routes=routes)

    @property
    def observed(self) -> List[Dict[str, Any]]:
        """What the observers saw; they are told a moment after each answer."""
        self.reactor.advance(RECORD_DELAY_S)
        return self._observed

    def send(self, method: str, path: str, body: Any = None, headers: Optional[Dict[str, Any]] = None,
             key: Optional[str] = "default") -> defer.Deferred:
        headers = dict(headers or {})
        if key == "default":
            key = self.keys[0] if self.keys else None
        if key is not None:
            headers.setdefault("Authorization", f"Bearer {key}")
        if body is not None and not isinstance(body, bytes):
            body = json.dumps(body).encode()
        return self.treq.request(method, "http://node.test" + path, data=body, headers=headers)

    def finish(self, d: defer.Deferred) -> Answer:
        return Answer(*stub_answer(self.treq, d))

    def call(self, method: str, path: str, body: Any = None, **kw: Any) -> Answer:
        return self.finish(self.send(method, path, body, **kw))

    def chat(self, payload: Any, **kw: Any) -> Answer:
        return self.call("POST", "/v1/chat/completions", payload, **kw)


class ApiTestCase(SynchronousTestCase):
    keys: Tuple[str, ...] = ()
    top: Dict[str, Any] = {}
    #: Send requests through the listener's fast channel (see FastChannel*Tests).
    fast = False

    def setUp(self) -> None:
        self.h = ApiHarness(keys=self.keys, fast=self.fast, **self.top)
        self.bodies: List[bytes] = []

    def assertError(self, answer: Answer, status: int, code: Optional[str] = None) -> Dict[str, Any]:
        """An OpenAI-shaped error with this status (and code)."""
        self.assertEqual(answer.code, status, answer.body)
        self.assertEqual(answer.header("content-type"), "application/json")
        body = answer.json()
        self.assertEqual(set(body), {"error"})
        error = body["error"]
        self.assertEqual(set(error), {"message", "type", "code"})
        self.assertIsInstance(error["message"], str)
        self.assertTrue(error["message"])
        self.assertIsInstance(error["type"], str)
        if code is not None:
            self.assertEqual(error["code"], code)
        self.assertNotIn("Traceback", error["message"])
        return error

    def loaded(self, model_id: str = "a") -> None:
        self.h.node_h.load(model_id)


class HealthAndModelsTests(ApiTestCase):
    def test_health(self) -> None:
        answer = self.h.call("GET", "/health")
        self.assertEqual(answer.code, 200)
        self.assertEqual(answer.json(), {"status": "ok", "draining": False})

    def test_health_while_draining(self) -> None:
        self.h.node.drain(30)
        self.assertEqual(self.h.call("GET", "/health").json()["draining"], True)

    def test_models_shape(self) -> None:
        answer = self.h.call("GET", "/v1/models")
        self.assertEqual(answer.code, 200)
        body = answer.json()
        self.assertEqual(body["object"], "list")
        self.assertEqual([m["id"] for m in body["data"]], ["a", "b", "e"])
        for entry in body["data"]:
            self.assertEqual(entry["object"], "model")
            self.assertIsInstance(entry["created"], int)
            self.assertEqual(entry["owned_by"], "rolemesh")
            self.assertEqual((entry["loaded_on"], entry["loading_on"]), ([], []))
        by_id = {m["id"]: m for m in body["data"]}
        self.assertEqual(by_id["a"]["roles"], ["chat"])
        self.assertEqual(by_id["a"]["aliases"], ["a", "alpha"])  # llama-server's entries list every name
        self.assertEqual(by_id["b"]["roles"], ["chat", "summarize"])
        self.assertEqual(by_id["b"]["aliases"], ["b"])
        self.assertEqual(by_id["e"]["aliases"], ["e", "emb"])
        self.assertEqual((by_id["b"]["tags"], by_id["b"]["architecture"]["input_modalities"]), ([], ["text"]))

    def test_models_list_every_alias_and_tag(self) -> None:
        """``aliases`` and ``tags`` as llama-server's ``--alias a,b --tags x,y`` list them; each alias routes."""
        h = ApiHarness(models=[{"model_id": "code", "alias": "fim", "aliases": ["tinyllama-2"],
                                "tags": ["chat", "fim", "small"]}])
        (entry,) = h.call("GET", "/v1/models").json()["data"]
        self.assertEqual((entry["id"], entry["aliases"], entry["tags"]),
                         ("code", ["code", "fim", "tinyllama-2"], ["chat", "fim", "small"]))
        pending = h.send("POST", "/v1/chat/completions", {"model": "tinyllama-2", **CHAT})
        h.treq.flush()
        h.node_h.answer("fim")
        self.assertEqual(h.finish(pending).code, 200)

    def test_models_show_where_loading_and_loaded(self) -> None:
        h = self.h
        pending = h.send("POST", "/v1/chat/completions", {"model": "alpha", **CHAT})
        h.treq.flush()
        self.assertEqual(h.node_h.sup().state, STARTING)
        by_id = {m["id"]: m for m in h.call("GET", "/v1/models").json()["data"]}
        self.assertEqual((by_id["a"]["loaded_on"], by_id["a"]["loading_on"]), ([], ["gpu:0"]))
        h.node_h.answer("alpha")
        self.assertEqual(h.finish(pending).code, 200)
        by_id = {m["id"]: m for m in h.call("GET", "/v1/models").json()["data"]}
        self.assertEqual((by_id["a"]["loaded_on"], by_id["a"]["loading_on"]), (["gpu:0"], []))
        self.assertEqual((by_id["b"]["loaded_on"], by_id["b"]["loading_on"]), ([], []))


class ProxiedRequestTests(ApiTestCase):
    def test_chat_is_relayed_to_the_child(self) -> None:
        self.loaded("a")
        payload = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "unknown_field": [1, 2]}
        answer = self.h.chat(payload)
        self.assertEqual(answer.code, 200, answer.body)
        self.assertEqual(answer.json(), {"object": "chat.completion", "model": "a"})
        attempt = self.h.agent.last
        self.assertEqual(attempt.url, b"http://127.0.0.1:20000/v1/chat/completions")
        self.assertEqual(json.loads(attempt.body), payload, "unknown fields pass through unchanged")
        self.assertTrue(self.h.node_h.idle(), "the lease was released")

    def test_each_proxied_endpoint(self) -> None:
        self.loaded("e")
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
            answer = self.h.call("POST", path, {"model": "emb", "input": "x"})
            self.assertEqual(answer.code, 200)
            self.assertEqual(self.h.agent.last.url, b"http://127.0.0.1:20000" + path.encode())
        self.assertEqual([o["endpoint"] for o in self.h.observed],
                         ["chat/completions", "completions", "embeddings"])

    def test_cold_request_waits_for_the_load(self) -> None:
        h = self.h
        pending = h.send("POST", "/v1/chat/completions", {"model": "chat", **CHAT})
        h.treq.flush()
        self.assertEqual(h.agent.attempts, [], "nothing is sent to a loading child")
        h.node_h.answer("alpha")
        self.assertEqual(h.finish(pending).json()["model"], "chat")
        self.assertEqual(h.node_h.model_on(), "a", "the role resolved to a")

    def test_observers_see_each_request(self) -> None:
        self.loaded("a")
        self.h.chat({"model": "alpha", **CHAT})
        self.h.chat({"model": "nope", **CHAT})
        first, second = self.h.observed
        self.assertEqual((first["event"], first["endpoint"], first["model"], first["status"]),
                         ("request", "chat/completions", "a", 200))
        self.assertIsNotNone(first["ttfb"])
        self.assertEqual((second["model"], second["status"]), (None, 404))

    def test_records_wait_to_be_batched_and_flush_at_once_when_asked(self) -> None:
        self.loaded("a")
        self.h.chat({"model": "a", **CHAT})
        self.h.chat({"model": "a", **CHAT})
        self.h.reactor.advance(RECORD_DELAY_S / 2)
        self.assertEqual(self.h._observed, [], "not yet: answers first, records together")
        self.h.api.flush_records()  # what the shutdown does after its drain
        self.assertEqual([o["status"] for o in self.h._observed], [200, 200])
        self.assertEqual(self.h.reactor.getDelayedCalls(), [], "no timer left behind")

    def test_prompt_tokens_are_counted_from_the_answers_timings(self) -> None:
        """llama-server's ``timings`` of each answer, per device and model;
        not for embeddings (they have none), and the bodies unchanged."""
        self.loaded("a")
        whole = b'{"object":"chat.completion","timings":{"cache_n":0,"prompt_n":9,"prompt_ms":2.5}}'
        last = b'data: {"choices":[],"timings":{"cache_n":21,"prompt_n":5,"prompt_ms":1.0}}\n\n'

        def answer(attempt: Attempt) -> FakeResponse:
            streaming = json.loads(attempt.body).get("stream") is True
            response = FakeResponse(headers={b"content-type": [b"text/event-stream" if streaming
                                                               else b"application/json"]})
            response.autoplay = [last, b"data: [DONE]\n\n"] if streaming else [whole]
            return response

        self.h.agent.auto = answer
        self.assertEqual(self.h.chat({"model": "a", **CHAT}).body, whole)
        self.assertEqual(self.h.node.prompt_cache.get("gpu:0", "a"), (0, 9))
        streamed = self.h.call("POST", "/v1/completions", {"model": "a", "prompt": "p", "stream": True})
        self.assertEqual(streamed.body, last + b"data: [DONE]\n\n")
        self.assertEqual(self.h.node.prompt_cache.get("gpu:0", "a"), (21, 14))
        self.assertEqual(self.h.call("POST", "/v1/embeddings", {"model": "a", "input": "x"}).code, 200)
        self.assertEqual(self.h.node.prompt_cache.get("gpu:0", "a"), (21, 14), "embeddings: not read")
        self.assertEqual(self.h.node.inventory()["devices"][0]["prompt_tokens"],
                         {"a": {"cached": 21, "processed": 14, "hit_rate": 0.6}})

    def test_streaming_headers_reach_the_client(self) -> None:
        self.loaded("a")

        def stream(attempt: Attempt) -> FakeResponse:
            response = FakeResponse(headers={b"content-type": [b"text/event-stream"]})
            response.autoplay = [b'data: {"n": 1}\n\n', b"data: [DONE]\n\n"]
            return response

        self.h.agent.auto = stream
        answer = self.h.chat({"model": "a", "stream": True, **CHAT})
        self.assertEqual(answer.code, 200)
        self.assertEqual(answer.header("x-accel-buffering"), "no")
        self.assertEqual(answer.body, b'data: {"n": 1}\n\ndata: [DONE]\n\n')
        self.assertEqual(self.h.agent.last.url, b"http://127.0.0.1:20000/v1/chat/completions")

    def test_upstream_4xx_body_passes_through(self) -> None:
        self.loaded("a")
        body = b'{"error":{"code":400,"message":"messages required","type":"invalid_request_error"}}'

        def bad(attempt: Attempt) -> FakeResponse:
            response = FakeResponse(400, b"Bad Request")
            response.autoplay = [body]
            return response

        self.h.agent.auto = bad
        answer = self.h.chat({"model": "a"})
        self.assertEqual((answer.code, answer.body), (400, body))  # unchanged: llama-server's numeric code stays

    def test_the_log_line_says_where_a_request_went_or_that_it_reached_no_device(self) -> None:
        from twisted.logger import capturedLogs, formatEvent

        self.loaded("a")
        with capturedLogs() as events:
            self.assertEqual(self.h.chat({"model": "a", **CHAT}).code, 200)
            self.assertError(self.h.chat({"model": "nope", **CHAT}), 404)
            self.h.node.draining = True
            self.assertError(self.h.chat({"model": "a", **CHAT}), 503)
            self.h.node.draining = False
            self.patch(self.h.node, "lease_now", lambda model, *_: None)
            self.patch(self.h.node, "acquire", lambda model, **_: defer.fail(errors.queue_timeout("device gpu:0", 30)))
            self.assertError(self.h.chat({"model": "a", **CHAT}), 503, "queue_timeout")
            self.h.observed  # noqa: B018 - the records are written a moment after the answers
        lines = [formatEvent(e) for e in events if e.get("log_namespace") == "rolemesh.api"]
        self.assertEqual(len(lines), 4, lines)
        self.assertRegex(lines[0], r"^POST /v1/chat/completions a -> 200 on gpu:0 in [0-9.]+ ms$")
        self.assertRegex(lines[1], r"^POST /v1/chat/completions -> 404 on no device in [0-9.]+ ms$")
        self.assertRegex(lines[2], r"^POST /v1/chat/completions -> 503 on no device in [0-9.]+ ms$")
        self.assertRegex(lines[3], r"^POST /v1/chat/completions a -> 503 on no device in [0-9.]+ ms$")
        self.assertNotIn("None", "".join(lines))
        self.assertEqual([e["device"] for e in events if e.get("log_namespace") == "rolemesh.api"],
                         ["gpu:0", None, None, None], "the device field stays null (log_format: json)")

    def test_client_disconnect_frees_the_device_quietly(self) -> None:
        h = ApiHarness(auto=False)
        h.node_h.load("a")
        pending = h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT})
        h.treq.flush()
        attempt = h.agent.last
        self.assertEqual(h.node_h.book().pending, 1)
        pending.cancel()  # the client hangs up while llama-server is thinking
        h.treq.flush()
        self.failureResultOf(pending)
        self.assertEqual(attempt.cancelled, 1, "the upstream request was closed")
        self.assertTrue(h.node_h.idle(), "the slot was freed")
        self.assertEqual(h.observed[-1]["status"], 499)
        self.assertEqual(self.flushLoggedErrors(), [], "a client hanging up is not an error")
        # The device is usable at once.
        h.agent.auto = json_answer
        self.assertEqual(h.chat({"model": "a", **CHAT}).code, 200)


class RareEndTests(ApiTestCase):
    """The ends of a relay that wait on Deferreds: a child that gave no
    answer (checked, then retried once), a bug, a client leaving meanwhile."""

    def refused(self, h: ApiHarness) -> Any:
        h.node_h.load("a")
        pending = h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT})
        h.treq.flush()
        h.agent.last.fail(ConnectionRefusedError())
        return pending

    def test_an_unreachable_child_is_checked_and_the_request_sent_once_more(self) -> None:
        h = ApiHarness(auto=False)
        pending = self.refused(h)
        self.assertEqual(len(h.agent.attempts), 2, "the try, then once more after the child was checked")
        self.assertEqual(h.node_h.probe.calls[-1], ("http://127.0.0.1:20000", "alpha"), "the check")
        self.assertEqual(h.node_h.book().pending, 1, "the device stays held meanwhile")
        h.agent.last.respond(json_answer(h.agent.last))
        self.assertEqual(h.finish(pending).code, 200)
        self.assertTrue(h.node_h.idle())
        self.assertEqual(h.observed[-1]["status"], 200)

    def test_the_retried_answers_prompt_tokens_are_counted(self) -> None:
        h = ApiHarness(auto=False)
        pending = self.refused(h)
        response = FakeResponse()
        response.autoplay = [b'{"timings":{"cache_n":2,"prompt_n":7}}']
        h.agent.last.respond(response)
        self.assertEqual(h.finish(pending).code, 200)
        self.assertEqual(h.node.prompt_cache.get("gpu:0", "a"), (2, 7))

    def test_a_client_leaving_during_the_retry_closes_it(self) -> None:
        h = ApiHarness(auto=False)
        pending = self.refused(h)
        retry = h.agent.last
        pending.cancel()
        h.treq.flush()
        self.failureResultOf(pending)
        self.assertEqual(retry.cancelled, 1)
        self.assertTrue(h.node_h.idle())
        self.assertEqual(h.observed[-1]["status"], 499)
        self.assertEqual(self.flushLoggedErrors(), [])

    def test_a_bug_in_the_relay_is_a_500_and_frees_the_device(self) -> None:
        h = ApiHarness()
        h.node_h.load("a")

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("bug")

        h.proxy.start = broken  # type: ignore[method-assign]
        self.assertError(h.chat({"model": "a", **CHAT}), 500)
        self.assertTrue(h.node_h.idle())
        self.assertEqual(h.observed[-1]["status"], 500)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)


class DisconnectWhileWaitingTests(ApiTestCase):
    def test_disconnect_while_loading(self) -> None:
        h = self.h
        pending = h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT})
        h.treq.flush()
        self.assertEqual(h.node_h.sup().state, STARTING)
        pending.cancel()
        h.treq.flush()
        self.failureResultOf(pending)
        self.assertTrue(h.node_h.idle(), "the slot was freed at once")
        self.assertEqual(h.observed[-1]["status"], 499)
        self.assertEqual(self.flushLoggedErrors(), [])
        h.node_h.answer("alpha")
        self.assertEqual(h.agent.attempts, [], "nothing was sent for the client that left")
        self.assertEqual(h.chat({"model": "a", **CHAT}).code, 200)

    def test_disconnect_while_queued(self) -> None:
        h = ApiHarness(auto=False)
        h.node_h.load("a")
        first = h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT})
        queued = h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT})
        h.treq.flush()
        self.assertEqual(len(h.node_h.book().queue), 1)
        queued.cancel()
        h.treq.flush()
        self.failureResultOf(queued)
        self.assertEqual(len(h.node_h.book().queue), 0, "left the queue at once")
        h.agent.last.respond(json_answer(h.agent.last))
        self.assertEqual(h.finish(first).code, 200)
        self.assertEqual(len(h.agent.attempts), 1)
        self.assertTrue(h.node_h.idle())
        self.assertEqual(self.flushLoggedErrors(), [])


class RequestErrorTests(ApiTestCase):
    top = {"max_request_body_bytes": 4096}

    def test_not_json(self) -> None:
        for body in (b"", b"{", b"not json", b'{"model": "a",}', b"[" * 4000):
            error = self.assertError(self.h.chat(body), 400)
            self.assertEqual(error["type"], "invalid_request_error")

    def test_deeply_nested_json_is_400_not_500(self) -> None:
        h = ApiHarness(max_request_body_bytes=1 << 20)
        self.assertError(h.chat(b"[" * 200000), 400)
        self.assertError(h.chat(b'{"model": "a", "x": ' + b"[" * 200000 + b"]" * 200000 + b"}"), 400)
        self.assertEqual(self.flushLoggedErrors(), [])

    def test_not_an_object(self) -> None:
        for body in (b"[]", b'"a"', b"1", b"null", b"true", b'[{"model": "a"}]'):
            self.assertError(self.h.chat(body), 400)

    def test_no_model(self) -> None:
        self.assertError(self.h.chat({"messages": []}), 400, "missing_model")
        self.assertError(self.h.chat({"model": None}), 400, "missing_model")

    def test_model_not_a_string(self) -> None:
        for model in (1, 1.5, True, [], ["a"], {"id": "a"}, ""):
            self.assertError(self.h.chat({"model": model}), 400, "invalid_model")

    def test_absurdly_long_model(self) -> None:
        error = self.assertError(self.h.chat({"model": "m" * (MAX_MODEL_NAME + 1)}), 400, "invalid_model")
        self.assertNotIn("m" * 100, error["message"], "the name is not echoed back")

    def test_non_utf8(self) -> None:
        self.assertError(self.h.chat(b'{"model": "\xff\xfe"}'), 400)
        self.assertError(self.h.chat('{"model": "a"}'.encode("utf-16")), 400)

    def test_body_over_the_limit_is_413(self) -> None:
        payload = {"model": "a", "pad": "x" * 5000}
        error = self.assertError(self.h.chat(payload), 413)
        self.assertIn("max_request_body_bytes", error["message"])
        self.assertEqual(self.h.agent.attempts, [])

    def test_body_at_the_limit_is_accepted(self) -> None:
        self.loaded("a")
        payload = {"model": "a", "pad": ""}
        pad = 4096 - len(json.dumps(payload).encode())
        payload["pad"] = "x" * pad
        self.assertEqual(self.h.chat(payload).code, 200)

    def test_unknown_model_is_404(self) -> None:
        error = self.assertError(self.h.chat({"model": "gpt-4", **CHAT}), 404, "model_not_found")
        self.assertIn("gpt-4", error["message"])
        self.assertEqual(self.h.reactor.processes, [], "nothing was started")

    def test_queue_full_is_429_with_retry_after(self) -> None:
        h = ApiHarness(auto=False)
        h.node_h.load("a")
        first = h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT})
        second = h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT})
        h.treq.flush()
        self.assertEqual(h.node_h.book().pending, 2)
        answer = h.chat({"model": "a", **CHAT})
        self.assertError(answer, 429, "queue_full")
        self.assertEqual(answer.header("retry-after"), "1")
        self.assertEqual(answer.json()["error"]["type"], "rate_limit_error")
        # The two others are served.
        h.agent.attempts[0].respond(json_answer(h.agent.attempts[0]))
        self.assertEqual(h.finish(first).code, 200)
        h.agent.attempts[1].respond(json_answer(h.agent.attempts[1]))
        self.assertEqual(h.finish(second).code, 200)
        self.assertTrue(h.node_h.idle())

    def test_draining_is_503_shutting_down(self) -> None:
        self.h.node.drain(30)
        answer = self.h.chat({"model": "a", **CHAT})
        self.assertError(answer, 503, "shutting_down")
        self.assertIsNotNone(answer.header("retry-after"))

    def test_load_failure_is_503_with_retry_after(self) -> None:
        h = self.h
        pending = h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT})
        h.treq.flush()
        h.node_h.child().output("llama_model_load: error loading model: /models/a.gguf: bad magic\n")
        h.node_h.child().exit(1)
        answer = h.finish(pending)
        error = self.assertError(answer, 503, "model_load_failed")
        self.assertIn("bad magic", error["message"])
        self.assertNotIn("/models/a.gguf", error["message"])
        self.assertIsNotNone(answer.header("retry-after"))
        self.assertTrue(h.node_h.idle())

    def test_load_timeout_is_503(self) -> None:
        h = self.h
        pending = h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT})
        h.treq.flush()
        h.reactor.advance(h.config.llama_server_startup_timeout_s)
        answer = h.finish(pending)
        self.assertError(answer, 503, "model_load_timeout")
        self.assertIsNotNone(answer.header("retry-after"))

    def test_upstream_refused_is_502(self) -> None:
        self.loaded("a")

        def refuse(attempt: Attempt) -> None:
            attempt.fail(ConnectionRefusedError())

        self.h.agent.auto = refuse
        self.assertError(self.h.chat({"model": "a", **CHAT}), 502, "upstream_error")
        self.assertTrue(self.h.node_h.idle())

    def test_upstream_timeout_is_504_and_an_unhealthy_child_is_restarted(self) -> None:
        h = ApiHarness(auto=False, request_timeout_s=60)
        h.node_h.load("a")
        pending = h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT})
        h.treq.flush()
        h.node_h.probe.ready = set()  # the child stopped answering
        h.reactor.advance(60)
        self.assertError(h.finish(pending), 504, "upstream_timeout")
        self.assertEqual(h.node_h.sup().state, STOPPING)
        self.assertTrue(h.node_h.idle())

    def test_upstream_timeout_keeps_a_healthy_child(self) -> None:
        h = ApiHarness(auto=False, request_timeout_s=60)
        h.node_h.load("a")
        pending = h.send("POST", "/v1/chat/completions", {"model": "a", **CHAT})
        h.treq.flush()
        h.reactor.advance(60)
        self.assertError(h.finish(pending), 504, "upstream_timeout")
        self.assertEqual(h.node_h.sup().state, READY)

    def test_unknown_route_is_404_json(self) -> None:
        for method, path in (("GET", "/nope"), ("POST", "/v1/chat"), ("GET", "/v1/models/a/b"),
                             ("GET", "/v2/models")):
            self.assertError(self.h.call(method, path), 404)

    def test_wrong_method_is_405_json(self) -> None:
        for method, path in (("GET", "/v1/chat/completions"), ("POST", "/health"), ("DELETE", "/v1/models"),
                             ("PUT", "/v1/embeddings")):
            answer = self.h.call(method, path)
            self.assertError(answer, 405, "method_not_allowed")
            self.assertIsNotNone(answer.header("allow"))


class UrlTests(ApiTestCase):
    def test_non_utf8_path_is_a_json_400_and_not_logged(self) -> None:
        for path in ("/v1/node/devices/%ff/logs", "/%ff", "/v1/models%c3"):
            self.assertError(self.h.call("GET", path), 400, "invalid_url")
        self.assertEqual(self.flushLoggedErrors(), [])

    def test_non_utf8_host_is_a_json_400(self) -> None:
        answer = self.h.call("GET", "/v1/models", headers={b"Host": b"\xff.example"})
        self.assertError(answer, 400, "invalid_url")
        self.assertEqual(self.flushLoggedErrors(), [])

    def test_a_host_werkzeug_cannot_route_is_a_json_400(self) -> None:
        """UTF-8, but no IDNA name (a C1 control): werkzeug's BadHost was a 500 page."""
        answer = self.h.call("POST", "/", b"x", headers={b"Host": b"W\xc2\x92W"})
        self.assertError(answer, 400, "invalid_url")
        self.assertEqual(self.flushLoggedErrors(), [])

    def test_merged_slashes_redirect_says_where(self) -> None:
        h = self.h
        d = h.treq.request("GET", "http://node.test/v1//models", allow_redirects=False)
        answer = h.finish(d)
        self.assertEqual(answer.code, 308)
        self.assertEqual(answer.header("location"), "http://node.test/v1/models")


class NodeRouteTests(ApiTestCase):
    def test_inventory(self) -> None:
        answer = self.h.call("GET", "/v1/node/inventory")
        self.assertEqual(answer.code, 200)
        body = answer.json()
        self.assertEqual(body["node_id"], "test-node")
        self.assertEqual([d["device"] for d in body["devices"]], ["gpu:0"])

    def test_registration(self) -> None:
        self.assertEqual(self.h.call("GET", "/v1/node/registration").json(), {"node_id": "test-node"})

    def test_registration_unavailable_is_404_json(self) -> None:
        h = self.h
        api = NodeAPI(h.config, h.node, h.proxy)
        answer = ApiHarnessView(h, api).call("GET", "/v1/node/registration")
        self.assertError(answer, 404)
        self.assertError(ApiHarnessView(h, api).call("GET", "/metrics"), 404)

    def test_metrics(self) -> None:
        answer = self.h.call("GET", "/metrics")
        self.assertEqual(answer.code, 200)
        self.assertTrue((answer.header("content-type") or "").startswith("text/plain"))
        self.assertIn(b"rolemesh_up 1", answer.body)


class ApiHarnessView(ApiHarness):
    """Another NodeAPI over the same harness."""

    def __init__(self, base: ApiHarness, api: NodeAPI) -> None:
        self.__dict__.update(base.__dict__)
        self.api = api
        self.treq: Any = StubTreq(api.resource())


class LogsEndpointTests(ApiTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.loaded("a")
        for i in range(5):
            self.h.node_h.child().output(f"log line {i}\n")

    def test_tail(self) -> None:
        answer = self.h.call("GET", "/v1/node/devices/gpu:0/logs?tail=2")
        self.assertEqual(answer.code, 200)
        self.assertEqual(answer.json(), {"device": "gpu:0", "lines": ["log line 3", "log line 4"]})

    def test_default_tail(self) -> None:
        lines = self.h.call("GET", "/v1/node/devices/gpu:0/logs").json()["lines"]
        self.assertEqual(lines[-1], "log line 4")
        self.assertLessEqual(len(lines), 100)

    def test_tail_bounds(self) -> None:
        self.assertEqual(self.h.call("GET", "/v1/node/devices/gpu:0/logs?tail=0").json()["lines"], [])
        answer = self.h.call("GET", f"/v1/node/devices/gpu:0/logs?tail={MAX_LOG_TAIL}")
        self.assertEqual(answer.code, 200)

    def test_invalid_tail_is_400(self) -> None:
        for tail in ("-1", "abc", "100000", str(MAX_LOG_TAIL + 1), "1e3", "", "9" * 5000, "%00"):
            self.assertError(self.h.call("GET", f"/v1/node/devices/gpu:0/logs?tail={tail}"), 400, "invalid_tail")

    def test_unknown_device_is_404(self) -> None:
        self.assertError(self.h.call("GET", "/v1/node/devices/gpu:7/logs"), 404, "device_not_found")

    def test_path_traversal_is_404(self) -> None:
        for device in ("..%2F..%2Fetc", "..%2F..%2Fetc%2Fpasswd", "%2e%2e", "..", "gpu:0%2F..%2F..",
                       "%2Fetc%2Fpasswd", "gpu%3A0%00"):
            answer = self.h.call("GET", f"/v1/node/devices/{device}/logs")
            self.assertError(answer, 404)
            self.assertNotIn(b"root:", answer.body)


class AuthTests(ApiTestCase):
    keys = (KEY, OLD_KEY)

    ROUTES = [
        ("GET", "/v1/models", None),
        ("GET", "/v1/node/inventory", None),
        ("GET", "/v1/node/registration", None),
        ("GET", "/v1/node/devices/gpu:0/logs", None),
        ("GET", "/metrics", None),
        ("POST", "/v1/chat/completions", {"model": "a", **CHAT}),
        ("POST", "/v1/completions", {"model": "a", "prompt": "x"}),
        ("POST", "/v1/embeddings", {"model": "e", "input": "x"}),
    ]

    def collect(self, answer: Answer) -> Answer:
        self.bodies.append(answer.body)
        for _name, values in answer.headers.getAllRawHeaders():
            self.bodies.extend(values)
        return answer

    def tearDown(self) -> None:
        for body in self.bodies:
            self.assertNotIn(KEY.encode(), body)
            self.assertNotIn(OLD_KEY.encode(), body)
            self.assertNotIn(b"sk-rolemesh", body)

    def test_health_needs_no_key(self) -> None:
        self.assertEqual(self.collect(self.h.call("GET", "/health", key=None)).code, 200)

    def test_every_other_route_needs_a_key(self) -> None:
        for method, path, body in self.ROUTES:
            answer = self.collect(self.h.call(method, path, body, key=None))
            error = self.assertError(answer, 401, "invalid_api_key")
            self.assertEqual(answer.header("www-authenticate"), 'Bearer realm="rolemesh-node"')
            self.assertIn("Authorization", error["message"])
        self.assertEqual(self.h.agent.attempts, [])
        self.assertEqual(self.h.reactor.processes, [], "an unauthenticated request loads nothing")

    def test_wrong_keys_are_refused(self) -> None:
        self.loaded("a")
        wrong = [
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Bearer {KEY}x"},
            {"Authorization": f"Bearer {KEY[:-1]}"},
            {"Authorization": f"Basic {KEY}"},
            {"Authorization": f"{KEY}"},
            {"Authorization": "Bearer"},
            {"Authorization": "Bearer "},
            {"Authorization": ""},
            {"Authorization": f"Bearer {KEY} {KEY}"},
            {"Authorization": "Bearer sk-r\u00e9le"},
            {"X-Api-Key": "wrong"},
            {"X-Api-Key": f"Bearer {KEY}"},
        ]
        for headers in wrong:
            for method, path, body in self.ROUTES:
                answer = self.collect(self.h.call(method, path, body, headers=headers, key=None))
                self.assertError(answer, 401, "invalid_api_key")
        self.assertEqual(self.h.agent.attempts, [])

    def test_an_anthropic_clients_x_api_key_is_accepted(self) -> None:
        """``x-api-key: <key>`` (what Anthropic's SDK sends) passes on every
        route, as llama-server takes it; so does a right key in either
        header when the other is wrong."""
        self.loaded("a")
        for headers in ({"X-Api-Key": KEY}, {"Authorization": "Bearer wrong", "X-Api-Key": KEY},
                        {"Authorization": f"Bearer {KEY}", "X-Api-Key": "wrong"}):
            for method, path, body in self.ROUTES[:5]:
                answer = self.collect(self.h.call(method, path, body, headers=headers, key=None))
                self.assertEqual(answer.code, 200, (path, headers, answer.body))

    def test_right_key_is_accepted(self) -> None:
        self.loaded("a")
        for method, path, body in self.ROUTES[:5]:
            answer = self.collect(self.h.call(method, path, body, key=KEY))
            self.assertEqual(answer.code, 200, (path, answer.body))
        self.assertEqual(self.collect(self.h.chat({"model": "a", **CHAT}, key=KEY)).code, 200)

    def test_rotation_both_keys_work(self) -> None:
        self.loaded("a")
        for key in (KEY, OLD_KEY):
            self.assertEqual(self.collect(self.h.call("GET", "/v1/models", key=key)).code, 200)
            self.assertEqual(self.collect(self.h.chat({"model": "a", **CHAT}, key=key)).code, 200)

    def test_scheme_is_case_insensitive(self) -> None:
        answer = self.collect(self.h.call("GET", "/v1/models", headers={"Authorization": f"bearer {KEY}"},
                                          key=None))
        self.assertEqual(answer.code, 200)

    def test_auth_comes_before_body_checks(self) -> None:
        for body in (b"not json", b'{"model": "gpt-4"}', b"x" * 100):
            self.assertError(self.collect(self.h.chat(body, key=None)), 401)

    def test_key_never_in_a_response(self) -> None:
        # Error paths that echo input: an unknown model named like the key.
        self.collect(self.h.chat({"model": KEY}, key=KEY))
        self.collect(self.h.chat({"model": "x" * 300}, key=KEY))
        self.collect(self.h.call("GET", "/v1/node/inventory", key=KEY))
        self.collect(self.h.call("GET", "/v1/node/registration", key=KEY))
        self.collect(self.h.call("GET", "/nope", key=KEY))
        self.collect(self.h.call("GET", "/v1/models", key="sk-rolemesh-guess"))
        # (tearDown checks the bodies; the first one names the model the client sent,
        # which is the client's own text -- drop it, it is not a leak.)
        self.bodies = [b for b in self.bodies if b"does not exist" not in b]


class RequestIdTests(ApiTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.loaded("a")

    def rid(self, value: Optional[str]) -> Optional[str]:
        headers = {"X-Request-Id": value} if value is not None else {}
        answer = self.h.chat({"model": "a", **CHAT}, headers=headers)
        self.assertEqual(answer.code, 200)
        return answer.header("x-request-id")

    def test_sane_id_is_echoed(self) -> None:
        for value in ("abc", "req-123_4.5:6", "A" * 64):
            self.assertEqual(self.rid(value), value)

    def test_otherwise_one_is_generated(self) -> None:
        seen = set()
        for value in (None, "", "has space", "A" * 65, "semi;colon", "<script>", "caf\u00e9"):
            rid = self.rid(value)
            self.assertIsNotNone(rid)
            self.assertRegex(rid or "", r"^[0-9a-f]{32}$")
            self.assertNotEqual(rid, value)
            seen.add(rid)
        self.assertEqual(len(seen), 7, "a fresh id each time")

    def test_errors_carry_the_id_too(self) -> None:
        answer = self.h.chat({"model": "nope"}, headers={"X-Request-Id": "trace-1"})
        self.assertEqual(answer.code, 404)
        self.assertEqual(answer.header("x-request-id"), "trace-1")


# The same tests with the listener's fast channel in front (rolemesh/http/fast_channel.py):
# the proxied routes must answer exactly as through Klein.


class FastChannelProxiedRequestTests(ProxiedRequestTests):
    fast = True

    def test_served_by_the_fast_channel(self) -> None:
        self.loaded()
        answer = self.h.chat({"model": "a", **CHAT})
        self.assertEqual(answer.code, 200)
        self.assertEqual(self.h.fast_served, 1)
        self.assertEqual(answer.header("x-request-id") is not None, True)


class FastChannelHealthAndModelsTests(HealthAndModelsTests):
    fast = True

    def test_served_by_the_fast_channel(self) -> None:
        for path in ("/health", "/v1/models", "/ready"):
            self.h.call("GET", path)
        self.assertEqual(self.h.fast_served, 3)

    def test_errors_as_through_klein(self) -> None:
        h = ApiHarness(keys=["k"], fast=True)
        self.assertError(h.call("GET", "/v1/models", key=None), 401)
        self.assertEqual(h.call("GET", "/v1/models", key=None).header("www-authenticate"),
                         'Bearer realm="rolemesh-node"')
        self.assertEqual(h.fast_served, 2)


class FastChannelDisconnectTests(DisconnectWhileWaitingTests):
    fast = True


class FastChannelRequestErrorTests(RequestErrorTests):
    fast = True


class FastChannelAuthTests(AuthTests):
    fast = True


class FastChannelRequestIdTests(RequestIdTests):
    fast = True
