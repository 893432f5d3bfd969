"""rolemesh.api.held_state: which child holds a completion's or a stream's state."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.api.held_state import COMPLETION, CONVERSATION, HeldState, Holder, completion_id
from tests.api.test_app import CHAT, KEY, ApiTestCase
from tests.http.test_proxy import FakeResponse

ONE = Holder("cpu:0", "tiny", 100, 1)
TWO = Holder("cpu:1", "tiny", 200, 3)


class HeldStateTests(SynchronousTestCase):
    def test_each_kind_keeps_its_own_ids(self) -> None:
        held = HeldState()
        held.remember(COMPLETION, "x", ONE)
        held.remember(CONVERSATION, "x", TWO)
        self.assertEqual((held.holder(COMPLETION, "x"), held.holder(CONVERSATION, "x")), (ONE, TWO))
        held.forget(COMPLETION, "x")
        self.assertEqual((held.holder(COMPLETION, "x"), held.holder(CONVERSATION, "x")), (None, TWO))

    def test_a_remembered_id_moves_to_its_newest_child(self) -> None:
        held = HeldState()
        held.remember(CONVERSATION, "c", ONE)
        held.remember(CONVERSATION, "c", TWO)
        self.assertEqual(held.holder(CONVERSATION, "c"), TWO)

    @given(st.lists(st.text(min_size=1, max_size=4), max_size=60), st.integers(1, 8))
    def test_at_most_the_bound_and_the_newest_ids_are_kept(self, keys: list, most: int) -> None:
        held = HeldState(most)
        for key in keys:
            held.remember(COMPLETION, key, ONE)
        newest = list(dict.fromkeys(reversed(keys)))[:most]
        kept = [k for k in dict.fromkeys(keys) if held.holder(COMPLETION, k) is not None]
        self.assertEqual(sorted(kept), sorted(newest))

    def test_the_completion_id_is_read_from_a_streams_first_event(self) -> None:
        first = (b'data: {"choices":[{"delta":{"role":"assistant"}}],"created":1,'
                 b'"id":"chatcmpl-R9Zp9Ht","object":"chat.completion.chunk"}\n\n')
        self.assertEqual(completion_id(first), "chatcmpl-R9Zp9Ht")
        self.assertIsNone(completion_id(b"data: {}\n\n"))


def echo_with_headers(attempt: Any) -> FakeResponse:
    """llama-server's answer: the method, path and conversation header it was sent."""
    response = FakeResponse(headers={b"content-type": [b"application/json"]})
    conversation = (attempt.headers.getRawHeaders(b"x-conversation-id") or [b""])[0].decode()
    response.autoplay = [json.dumps({"method": attempt.method.decode(), "url": attempt.url.decode(),
                                     "conversation": conversation}).encode()]
    return response


class HeldRoutesTests(ApiTestCase):
    keys = (KEY,)

    def setUp(self) -> None:
        super().setUp()
        self.h.agent.auto = echo_with_headers
        self.loaded("a")

    def test_a_streams_follow_ups_reach_the_child_that_served_it(self) -> None:
        answer = self.h.call("POST", "/v1/chat/completions", {"model": "a", "stream": True, **CHAT},
                             headers={"X-Conversation-Id": "c-1"})
        self.assertEqual((answer.code, answer.json()["conversation"]), (200, "c-1"))  # the child keeps it by id
        for method in ("GET", "DELETE"):
            answer = self.h.call(method, "/v1/stream?conv_id=c-1&from=3")
            self.assertEqual(answer.code, 200, answer.body)
            self.assertEqual((answer.json()["method"], answer.json()["url"]),
                             (method, "http://127.0.0.1:20000/v1/stream?conv_id=c-1&from=3"))

    def test_ids_the_node_never_saw_are_404s_that_say_so(self) -> None:
        answer = self.h.call("GET", "/v1/stream?conv_id=nobody")
        self.assertEqual((answer.code, answer.json()["error"]["code"]), (404, "unknown_conversation"))
        answer = self.h.call("POST", "/v1/chat/completions/control", {"id": "chatcmpl-x", "action": "reasoning_end"})
        self.assertEqual((answer.code, answer.json()["error"]["code"]), (404, "unknown_completion"))
        self.assertEqual(self.h.call("POST", "/v1/chat/completions/control", {"action": "x"}).code, 400)
        self.assertEqual(self.h.call("GET", "/v1/stream").code, 400)
        self.assertEqual(self.h.call("GET", "/v1/stream?conv_id=c-1", key=None).code, 401)

    def test_a_conversation_id_that_is_no_printable_ascii_is_refused(self) -> None:
        answer = self.h.call("POST", "/v1/chat/completions", {"model": "a", "stream": True, **CHAT},
                             headers={"X-Conversation-Id": "x" * 300})
        self.assertEqual((answer.code, answer.json()["error"]["code"]), (400, "invalid_conversation_id"))
