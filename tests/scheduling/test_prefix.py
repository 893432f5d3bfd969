"""Prefix affinity's pure parts: the hashes, the memory, the choice."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.scheduling.prefix import BLOCK_CHARS, MAX_HASHES, PrefixMemory, affine_choice, prefix_hashes
from tests.api.test_fuzz import json_values

messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                           "content": st.text(max_size=40)}), min_size=1, max_size=8)


#: Bodies shaped like a chat or completions request, with any JSON where a string belongs.
odd_bodies = st.one_of(
    st.fixed_dictionaries({"messages": st.lists(
        st.dictionaries(st.sampled_from(["role", "content", "name"]), json_values, max_size=3) | json_values,
        max_size=4)}),
    st.fixed_dictionaries({"prompt": json_values}),
    st.dictionaries(st.text(max_size=8), json_values, max_size=3),
)


class HashTests(SynchronousTestCase):
    @given(messages, messages)
    def test_a_later_turn_shares_the_earlier_turns_hashes(self, first, more):
        earlier = prefix_hashes({"messages": first})
        later = prefix_hashes({"messages": first + more})
        self.assertEqual(len(earlier), len(first))
        self.assertEqual(later[:len(earlier)], earlier)

    @given(messages, st.text(min_size=1, max_size=10))
    def test_a_changed_message_changes_every_hash_from_it_on(self, msgs, extra):
        changed = [dict(m) for m in msgs]
        changed[-1]["content"] += extra
        a, b = prefix_hashes({"messages": msgs}), prefix_hashes({"messages": changed})
        self.assertEqual(a[:-1], b[:-1])
        self.assertNotEqual(a[-1], b[-1])

    @given(st.text(min_size=1, max_size=3 * BLOCK_CHARS), st.text(max_size=2 * BLOCK_CHARS))
    def test_a_prompt_is_hashed_per_block(self, prompt, more):
        earlier = prefix_hashes({"prompt": prompt})
        later = prefix_hashes({"prompt": prompt + more})
        self.assertEqual(len(earlier), -(-len(prompt) // BLOCK_CHARS))
        whole = len(prompt) // BLOCK_CHARS  # the full blocks are shared; a partial last one may grow
        self.assertEqual(later[:whole], earlier[:whole])

    def test_bounded_and_tolerant(self):
        self.assertEqual(len(prefix_hashes({"messages": [{"role": "user", "content": "x"}] * 100})), MAX_HASHES)
        self.assertEqual(len(prefix_hashes({"prompt": "x" * (BLOCK_CHARS * 100)})), MAX_HASHES)
        self.assertEqual(prefix_hashes({"prompt": ["abc", "def"]}), prefix_hashes({"prompt": "abc"}))
        for odd in ({}, {"prompt": 3}, {"prompt": ""}, {"prompt": [1]}, {"messages": "no"}):
            self.assertEqual(prefix_hashes(odd), [])
        self.assertEqual(len(prefix_hashes({"messages": ["a", {"role": "user", "content": [{"type": "text"}]}]})), 2)

    def test_a_role_that_is_not_a_string_is_hashed_not_raised(self):
        # It raised TypeError (unhashable dict), and the request, on a model
        # held by two devices, got a 500 with a traceback in the log.
        for role in ({"x": 1}, ["user"], None, 3):
            self.assertEqual(len(prefix_hashes({"messages": [{"role": role, "content": "hi"}]})), 1)
        self.assertNotEqual(prefix_hashes({"messages": [{"role": ["user"], "content": "hi"}]}),
                            prefix_hashes({"messages": [{"role": "user", "content": "hi"}]}))

    @given(odd_bodies)
    def test_any_json_body_gives_a_list_of_hashes(self, body):
        hashes = prefix_hashes(body)
        self.assertLessEqual(len(hashes), MAX_HASHES)
        self.assertTrue(all(isinstance(h, int) for h in hashes))


class OtherApiHashTests(SynchronousTestCase):
    """Anthropic's ``system`` + ``messages`` and the Responses API's
    ``instructions`` + ``input``: a later turn shares the earlier turn's
    hashes; the system prompt and the tools are part of the prefix."""

    TOOLS = [{"name": "read_file", "input_schema": {"type": "object"}}]

    def test_an_anthropic_conversation_shares_its_prefix_and_the_system_prompt_counts(self) -> None:
        first = {"system": "You are terse.", "tools": self.TOOLS, "messages": [{"role": "user", "content": "hi"}]}
        later = dict(first, messages=first["messages"] + [{"role": "assistant", "content": "yo"},
                                                           {"role": "user", "content": "more"}])
        a, b = prefix_hashes(first), prefix_hashes(later)
        self.assertEqual(len(a), 2)  # the head (system + tools), then the one message
        self.assertEqual(b[:2], a)
        self.assertNotEqual(prefix_hashes(dict(first, system="You are verbose."))[0], a[0])
        self.assertNotEqual(prefix_hashes(dict(first, tools=[]))[0], a[0])
        block_system = dict(first, system=[{"type": "text", "text": "You are terse."}])
        self.assertEqual(len(prefix_hashes(block_system)), 2)

    def test_a_responses_conversation_shares_its_prefix(self) -> None:
        first = {"instructions": "Be brief.", "input": [{"role": "user", "content": "hi"}]}
        later = dict(first, input=first["input"] + [{"type": "function_call_output", "output": "42"}])
        self.assertEqual(prefix_hashes(later)[:2], prefix_hashes(first))
        self.assertEqual(len(prefix_hashes({"input": "just text"})), 1)


class MemoryTests(SynchronousTestCase):
    def test_the_longest_remembered_prefix_wins(self):
        m = PrefixMemory(10)
        m.remember([1, 2], "d0")
        m.remember([1, 2, 3, 4], "d1")
        self.assertEqual(m.lookup([1, 2, 3, 4, 5]), "d1")
        m.remember([1, 2, 7], "d0")
        self.assertEqual(m.lookup([1, 2, 7, 8]), "d0")
        self.assertIsNone(m.lookup([9]))
        self.assertEqual((m.lookups, m.hits), (3, 2))
        self.assertAlmostEqual(m.hit_rate, 2 / 3)

    def test_a_restarted_device_is_forgotten(self):
        m = PrefixMemory(10)
        m.remember([1, 2], "d0")
        m.remember([5], "d1")
        m.forget("d0")
        self.assertIsNone(m.lookup([1, 2]))
        self.assertEqual(m.lookup([5]), "d1")
        m.remember([1], "d0")  # served again after the restart
        self.assertEqual(m.lookup([1, 2]), "d0")

    @given(st.integers(0, 20), st.lists(st.lists(st.integers(0, 50), max_size=6), max_size=30))
    def test_bounded_least_recently_used_out(self, size, batches):
        m = PrefixMemory(size)
        for i, batch in enumerate(batches):
            m.remember(batch, f"d{i % 2}")
            self.assertLessEqual(len(m), size)
        if size and batches and batches[-1]:
            self.assertEqual(m.lookup(batches[-1][-1:]), f"d{(len(batches) - 1) % 2}")

    def test_zero_entries_is_off(self):
        m = PrefixMemory(0)
        m.remember([1], "d0")
        self.assertIsNone(m.lookup([1]))
        self.assertEqual(m.lookups, 0)
        m.resize(2)
        m.remember([1, 2, 3], "d0")
        self.assertEqual(len(m), 2)
        self.assertEqual(m.to_json()["capacity"], 2)


class ChoiceTests(SynchronousTestCase):
    @given(st.dictionaries(st.sampled_from(["d0", "d1", "d2"]), st.integers(0, 10), min_size=1),
           st.sampled_from([None, "d0", "d1", "d2", "dx"]), st.integers(0, 4))
    def test_preferred_unless_clearly_busier(self, pending, preferred, bound):
        chosen = affine_choice(pending, preferred, bound)
        if preferred in pending and pending[preferred] - min(pending.values()) <= bound:
            self.assertEqual(chosen, preferred)
        else:
            self.assertIsNone(chosen)
