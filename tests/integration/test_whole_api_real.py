"""The whole llama-server API through the node, end to end (issue 36): the
agent as a process over the real llama-server and the tiny model, called
with the real SDKs (``anthropic``, ``openai``) and, route by route, against
a llama-server of its own on the same model: every token utility answers
through the node exactly what the child answers directly."""

from __future__ import annotations

import json
import os
from typing import Any, Dict

from prometheus_client.parser import text_string_to_metric_families
from twisted.trial.unittest import SkipTest, SynchronousTestCase

from tests.fixtures.gemma import gemma_model
from tests.fixtures.llama import http_request, start_llama_server
from tests.integration.harness import AgentProcess, require_llama_server, tiny_model, wait_until
from tests.integration.test_metrics_real import value

KEY = "sk-whole-api-0123456789"
HI = [{"role": "user", "content": "hi"}]
#: Random weights may stop at once (an end-of-text token): generate every token asked for.
FULL = {"ignore_eos": True}


def sdks() -> Any:
    try:
        import anthropic
        import openai
    except ImportError as e:  # the test extra installs both
        raise SkipTest(f"the real SDKs are not installed ({e}): pip install '.[test]'") from None
    return anthropic, openai


class WholeApiRealTests(SynchronousTestCase):
    def setUp(self) -> None:
        require_llama_server()
        cls: Any = self
        cls.directory = os.path.abspath(self.mktemp())
        cls.path = tiny_model(cls.directory, "tiny", 11)
        other = tiny_model(cls.directory, "other", 12)
        cls.gemma = gemma_model()
        models = [{"model_id": "tiny", "path": cls.path}, {"model_id": "other", "path": other}]
        if cls.gemma is not None:
            models.append({"model_id": "gemma", "path": cls.gemma})
        cls.agent = AgentProcess(cls.directory, {
            "api_keys": [KEY, {"name": "capped", "key": "sk-capped-0123456789", "max_concurrent": 1}],
            "models": models,
            "max_pending_requests_per_device": 4,
        })
        self.addCleanup(self.agent.stop)

    def node(self, method: str, path: str, body: Any = None, **headers: str) -> Any:
        return self.agent.request(method, path, body, headers={"Authorization": f"Bearer {KEY}", **headers},
                                  timeout=60)

    def test_anthropic_sdk_messages_stream_and_count_tokens_with_x_api_key(self) -> None:
        anthropic, _ = sdks()
        client = anthropic.Anthropic(base_url=self.agent.url, api_key=KEY, max_retries=0)
        message = client.messages.create(model="tiny", max_tokens=4, messages=HI, extra_body=FULL)
        self.assertEqual((message.type, message.role), ("message", "assistant"))
        self.assertTokensAsStopped(message)
        # This llama-server build drops the first events of about one stream in three on its own
        # (measured directly, 66 of 200 began after message_start: the random weights' first tokens are
        # often partial UTF-8). The SDK then raises "Unexpected event order" (older releases) or hands
        # over a stream with no snapshot (2.x): a stream is tried up to ten times, and only that may fail it.
        for _ in range(10):
            try:
                with client.messages.stream(model="tiny", max_tokens=4, messages=HI, extra_body=FULL) as stream:
                    kinds = [event.type for event in stream]
            except RuntimeError as e:
                self.assertIn('before "message_start"', str(e))
                continue
            if kinds[0] == "message_start":
                break
        self.assertEqual((kinds[0], kinds[-1]), ("message_start", "message_stop"), kinds)
        self.assertTokensAsStopped(stream.get_final_message())
        counted = client.messages.count_tokens(model="tiny", messages=HI)
        self.assertGreater(counted.input_tokens, 0)
        wait_until(lambda: "POST /v1/messages/count_tokens tiny -> 200 on cpu:0" in self.agent.log_text(), 5,
                   what="count_tokens' log line")
        self.assertRegex(self.agent.log_text(), r"POST /v1/messages tiny -> 200 on cpu:0")

        def counted_200() -> bool:
            status, _, body = self.node("GET", "/metrics")
            families = {f.name: f for f in text_string_to_metric_families(body.decode("utf-8"))}
            return (value(families, "rolemesh_requests_total", model="tiny", endpoint="messages",
                          status="200") or 0) >= 2

        wait_until(counted_200, 5, what="two 200s of /v1/messages in the metrics")

    def assertTokensAsStopped(self, message: Any) -> None:  # noqa: N802 - unittest's style
        """Four tokens when it stopped at max_tokens. llama-server's /v1/messages does not honour
        ignore_eos (measured directly: 7 of 150 answers ended "end_turn", after 1 to 4 tokens), so
        an end_turn may come first."""
        self.assertIn(message.stop_reason, ("max_tokens", "end_turn"))
        if message.stop_reason == "max_tokens":
            self.assertEqual(message.usage.output_tokens, 4)
        else:
            self.assertIn(message.usage.output_tokens, range(1, 5))

    def test_the_nodes_own_errors_raise_the_anthropic_sdks_classes(self) -> None:
        anthropic, _ = sdks()
        wrong = anthropic.Anthropic(base_url=self.agent.url, api_key="wrong", max_retries=0)
        with self.assertRaises(anthropic.AuthenticationError) as raised:
            wrong.messages.create(model="tiny", max_tokens=4, messages=HI)
        self.assertEqual(raised.exception.body["error"]["type"], "authentication_error")  # type: ignore[index]
        client = anthropic.Anthropic(base_url=self.agent.url, api_key=KEY, max_retries=0)
        with self.assertRaises(anthropic.NotFoundError) as raised:
            client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=HI)
        self.assertIn("models here: tiny, other", str(raised.exception))
        self.assertEqual(raised.exception.body["error"]["type"], "not_found_error")  # type: ignore[index]


    def test_a_tenant_at_its_cap_gets_the_anthropic_sdks_rate_limit_error(self) -> None:
        anthropic, _ = sdks()
        if self.gemma is None:
            raise SkipTest("Gemma 3 270M (the demo extra) holds a stream long enough; not installed")
        # A tenant at its cap: a stream (Gemma: ~40 tokens/s) holds its one request, the next is 429.
        capped = anthropic.Anthropic(base_url=self.agent.url, api_key="sk-capped-0123456789", max_retries=0)
        with capped.messages.stream(model="gemma", max_tokens=64, messages=HI) as stream:
            next(iter(stream))
            with self.assertRaises(anthropic.RateLimitError) as limited:
                capped.messages.create(model="gemma", max_tokens=4, messages=HI)
        self.assertEqual(limited.exception.body["error"]["type"], "rate_limit_error")  # type: ignore[index]

    def test_openai_sdk_responses_plain_and_streamed(self) -> None:
        _, openai = sdks()
        client = openai.OpenAI(base_url=self.agent.url + "/v1", api_key=KEY, max_retries=0)
        response = client.responses.create(model="tiny", input="hi", max_output_tokens=4, extra_body=FULL)
        self.assertEqual(response.status, "completed")
        self.assertEqual(response.usage.output_tokens, 4)
        kinds = [event.type for event in client.responses.create(model="tiny", input="hi", max_output_tokens=4,
                                                                  stream=True, extra_body=FULL)]
        self.assertEqual(kinds[-1], "response.completed", kinds)
        wait_until(lambda: "POST /v1/responses tiny -> 200 on cpu:0" in self.agent.log_text(), 5,
                   what="the Responses log line")

    def test_every_utility_route_answers_what_the_child_answers(self) -> None:
        bodies: Dict[str, Dict[str, Any]] = {
            "/tokenize": {"content": "hello world", "add_special": True},
            "/detokenize": {"tokens": [259, 296, 297]},
            "/apply-template": {"messages": HI},
            "/v1/messages/count_tokens": {"messages": HI},
            "/v1/chat/completions/input_tokens": {"messages": HI},
            "/v1/responses/input_tokens": {"input": "hi"},
            "/chat/completions/input_tokens": {"messages": HI},
            "/responses/input_tokens": {"input": "hi"},
            "/infill": {"input_prefix": "def f(", "input_suffix": "):", "n_predict": 2},  # not a FIM model: 501
            "/v1/rerank": {"query": "a", "documents": ["b"]},  # not started with --reranking: 501
            "/v1/embeddings": {"input": "x"},  # not started with --embeddings: 501
        }
        self.direct = start_llama_server(self.path, alias="tiny", log_path=os.path.join(self.directory, "direct.log"))
        self.addCleanup(self.direct.stop)
        for path, body in bodies.items():
            direct = http_request("POST", self.direct.url + path, body, timeout=30)
            through = self.node("POST", path, {"model": "tiny", **body})
            self.assertEqual(through[0], direct[0], (path, through[2], direct[2]))
            self.assertEqual(json.loads(through[2]), json.loads(direct[2]), path)

    def test_vertex_ai_predict_fans_out_on_the_models_child(self) -> None:
        """Google Vertex AI's ``POST /predict``: each instance answered by the model's child, in order."""
        instances = [
            {"@requestFormat": "chatCompletions", "model": "other", "max_tokens": 2, "messages": HI},
            {"@requestFormat": "tokenize", "content": "hello world"},
            {"@requestFormat": "nothing-here"},
        ]
        status, _, body = self.node("POST", "/predict", {"instances": instances})
        self.assertEqual(status, 200, body)
        chat, tokens, unknown = json.loads(body)["predictions"]
        self.assertEqual((chat["object"], chat["choices"][0]["message"]["role"]), ("chat.completion", "assistant"))
        direct = json.loads(self.node("POST", "/tokenize", {"model": "other", "content": "hello world"})[2])
        self.assertEqual(tokens, direct)
        self.assertIn("no handler registered for @requestFormat: nothing-here", unknown["error"]["message"])
        status, _, inventory = self.node("GET", "/v1/node/inventory")
        self.assertEqual(json.loads(inventory)["devices"][0]["model"], "other")  # the instances' model
        status, _, body = self.node("POST", "/predict", {"instances": [{"model": "tiny"}, {"model": "other"}]})
        self.assertEqual((status, json.loads(body)["error"]["code"]), (400, "invalid_model"))

    def test_a_utility_for_a_model_no_device_holds_loads_it(self) -> None:
        self.assertEqual(self.node("POST", "/v1/chat/completions", {"model": "tiny", "messages": HI,
                                                                     "max_tokens": 1})[0], 200)
        status, _, body = self.node("POST", "/tokenize", {"model": "other", "content": "hi"})
        self.assertEqual(status, 200, body)
        status, _, inventory = self.node("GET", "/v1/node/inventory")
        self.assertEqual(json.loads(inventory)["devices"][0]["model"], "other")

    def test_the_passthrough_and_cors(self) -> None:
        self.node("POST", "/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": 1})
        status, _, props = self.node("GET", "/upstream/tiny/props")
        self.assertEqual(status, 200, props)
        self.assertIn("total_slots", json.loads(props))
        self.assertEqual(self.node("POST", "/upstream/tiny/props", {})[0], 403)
        self.assertEqual(self.node("POST", "/upstream/tiny/slots/0?action=erase", {})[0], 403)
        # No key: the UI's static files, from the child itself (this build of llama-server has no web
        # UI: its own 404 comes back), never the node's 401; an API path of the child stays behind the key.
        direct = start_llama_server(self.path, alias="tiny", log_path=os.path.join(self.directory, "ui.log"))
        self.addCleanup(direct.stop)
        expected = http_request("GET", direct.url + "/", timeout=10)
        status, _, page = self.agent.request("GET", "/upstream/tiny/")
        self.assertEqual((status, page), expected[::2])
        self.assertEqual(self.agent.request("GET", "/upstream/tiny/props")[0], 401)
        status, headers, _ = self.agent.request("OPTIONS", "/v1/messages", headers={
            "Origin": "http://app.test", "Access-Control-Request-Method": "POST"})
        self.assertEqual((status, headers.get("access-control-allow-origin")), (200, "http://app.test"))
