"""rolemesh.base.backoff: the one doubling every retry policy is built on."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base.backoff import Backoff, doubling, load_retry_delay, restart_delay
from rolemesh.children import restart_policy
from rolemesh.fleet import dispatcher

bases = st.floats(min_value=1e-3, max_value=1e3)
factors = st.floats(min_value=1.0, max_value=1e6)
counts = st.integers(min_value=0, max_value=5000)


class DoublingTests(SynchronousTestCase):
    @given(bases, factors, counts)
    def test_doubles_then_caps_without_overflow(self, base: float, factor: float, n: int) -> None:
        cap = base * factor
        delay = doubling(n, base, cap)
        self.assertLessEqual(delay, cap)
        self.assertGreaterEqual(delay, base)
        self.assertEqual(doubling(n + 1, base, cap), min(cap, delay * 2))

    def test_first_values(self) -> None:
        self.assertEqual([doubling(n, 1.0, 10.0) for n in range(6)], [1.0, 2.0, 4.0, 8.0, 10.0, 10.0])


class PolicyTests(SynchronousTestCase):
    @given(st.integers(min_value=0, max_value=5000))
    def test_restart_delay(self, n: int) -> None:
        delay = restart_delay(n)
        self.assertEqual(delay, 0.0 if n <= 1 else min(60.0, doubling(n - 2, 1.0, 60.0)))
        self.assertLessEqual(delay, restart_delay(n + 1))

    @given(st.integers(min_value=0, max_value=5000))
    def test_load_retry_delay(self, n: int) -> None:
        delay = load_retry_delay(n)
        self.assertLessEqual(delay, 600.0)
        self.assertLessEqual(delay, load_retry_delay(n + 1))
        if n >= 2:
            self.assertGreater(delay, 120.0)  # longer than clients honour as Retry-After

    def test_load_retry_schedule(self) -> None:
        self.assertEqual([load_retry_delay(n) for n in range(5)], [0.0, 15.0, 300.0, 600.0, 600.0])

    def test_one_implementation(self) -> None:
        """The restart policy and the dispatcher use these, not copies."""
        self.assertIs(restart_policy.restart_delay, restart_delay)
        self.assertIs(restart_policy.load_retry_delay, load_retry_delay)
        self.assertIs(dispatcher.Backoff, Backoff)


class JitterTests(SynchronousTestCase):
    @given(bases, factors, st.lists(st.floats(min_value=0.0, max_value=1.0, exclude_max=True), max_size=80))
    def test_ceiling_is_the_doubling_of_attempts(self, base: float, factor: float, draws: list[float]) -> None:
        cap = base * factor
        values = iter(draws)
        backoff = Backoff(base, cap, random=lambda: next(values))
        for n, _ in enumerate(draws):
            self.assertEqual(backoff.ceiling, doubling(n, base, cap))
            self.assertLessEqual(backoff.next_delay(), doubling(n, base, cap))
        backoff.reset()
        self.assertEqual((backoff.ceiling, backoff.attempts), (base, 0))
