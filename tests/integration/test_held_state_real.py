"""State one child holds, reached through the node on the real llama-server
(issue 36): a resumable stream (``X-Conversation-Id``) is looked up,
replayed and stopped on the child that served it; a live completion armed
with ``reasoning_control`` is controlled on its child; once that child is
gone, each follow-up is a 404 that says so, never an answer from another
child."""

from __future__ import annotations

import json
import os
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.integration.harness import AgentProcess, require_llama_server, tiny_model

KEY = "sk-held-state-0123456789"
HI = [{"role": "user", "content": "hi"}]


class HeldStateRealTests(SynchronousTestCase):
    def setUp(self) -> None:
        require_llama_server()
        self.directory = os.path.abspath(self.mktemp())
        tiny = tiny_model(self.directory, "tiny", 21)
        other = tiny_model(self.directory, "other", 22)
        self.agent = AgentProcess(self.directory, {
            "api_keys": [KEY],
            "models": [{"model_id": "tiny", "path": tiny}, {"model_id": "other", "path": other}],
        })
        self.addCleanup(self.agent.stop)

    def node(self, method: str, path: str, body: Any = None, **headers: str) -> Any:
        return self.agent.request(method, path, body, headers={"Authorization": f"Bearer {KEY}", **headers},
                                  timeout=60)

    def stream(self, **extra: Any) -> bytes:
        status, _, body = self.node("POST", "/v1/chat/completions", {
            "model": "tiny", "messages": HI, "max_tokens": 3, "ignore_eos": True, "stream": True, **extra},
            **{"X-Conversation-Id": "conv-one"})
        self.assertEqual(status, 200, body)
        return body

    def test_a_resumable_stream_is_looked_up_replayed_and_stopped_on_its_child(self) -> None:
        streamed = self.stream()
        status, _, found = self.node("POST", "/v1/streams/lookup", {"conversation_ids": ["conv-one", "nobody"]})
        self.assertEqual(status, 200, found)
        sessions = json.loads(found)
        self.assertEqual([s["conversation_id"] for s in sessions], ["conv-one"])
        self.assertTrue(sessions[0]["is_done"])
        status, headers, replay = self.node("GET", "/v1/stream?conv_id=conv-one&from=0")
        self.assertEqual(status, 200, replay)
        self.assertEqual(replay, streamed)  # the same bytes, from the child that kept them
        self.assertEqual(self.node("DELETE", "/v1/stream?conv_id=conv-one")[0], 204)
        status, _, body = self.node("GET", "/v1/stream?conv_id=never-sent")
        self.assertEqual(status, 404, body)
        self.assertEqual(json.loads(body)["error"]["code"], "unknown_conversation")
        self.assertEqual(self.node("GET", "/v1/stream?conv_id=conv-one")[0], 404)  # stopped: the child's own 404
        self.assertEqual(self.agent.request("GET", "/v1/stream?conv_id=conv-one")[0], 401)

    def test_a_live_completions_control_goes_to_its_child_and_a_gone_child_is_a_404(self) -> None:
        streamed = self.stream(reasoning_control=True)
        completion = json.loads(streamed.split(b"\n", 1)[0][len(b"data: "):])["id"]
        status, _, body = self.node("POST", "/v1/chat/completions/control",
                                    {"id": completion, "action": "reasoning_end"})
        self.assertEqual(status, 200, body)  # the child's own answer: finished, so a safe no-op
        self.assertIn("no active completion", json.loads(body)["message"])
        status, _, body = self.node("POST", "/v1/chat/completions/control", {"id": "chatcmpl-unknown"})
        self.assertEqual((status, json.loads(body)["error"]["code"]), (404, "unknown_completion"))
        # Another model takes the device (its answer means its child serves): the child that held both ids is gone.
        self.assertEqual(self.node("POST", "/tokenize", {"model": "other", "content": "x"})[0], 200)
        for method, path, body in (("POST", "/v1/chat/completions/control", {"id": completion}),
                                   ("GET", "/v1/stream?conv_id=conv-one", None)):
            status, _, answer = self.node(method, path, body)
            self.assertEqual((status, json.loads(answer)["error"]["code"]), (404, "state_gone"), answer)
        status, _, found = self.node("POST", "/v1/streams/lookup", {"conversation_ids": ["conv-one"]})
        self.assertEqual((status, json.loads(found)), (200, []))
