"""The on-demand probes of a ready child and their verdicts (rolemesh.children.health)."""

from __future__ import annotations

from typing import Any, List, Tuple

from twisted.internet.defer import Deferred, fail, succeed
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.children.health import ChildHealth
from rolemesh.children.restart_policy import INFERENCE_PROBE_FAILURES, RestartPolicy
from rolemesh.children.views import ChildEndpoint
from rolemesh.config.file import ModelConfig

MODEL = ModelConfig(model_id="qwen", path="/m.gguf", alias="q")
ENDPOINT = ChildEndpoint("qwen", "http://127.0.0.1:20000", 20000, 1001, 3)


class Probes:
    """Answers each probe with the next of ``answers`` (True, False or an exception)."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.asked: List[Tuple[str, Any]] = []

    def _next(self) -> Deferred[Any]:
        answer = self.answers.pop(0)
        return fail(answer) if isinstance(answer, Exception) else succeed(answer)

    def readiness(self, base_url: str, served_name: str) -> Deferred[Any]:
        self.asked.append((base_url, served_name))
        return self._next()

    def inference(self, base_url: str, model: ModelConfig) -> Deferred[Any]:
        self.asked.append((base_url, model.model_id))
        return self._next()


class Harness:
    def __init__(self, *answers: Any, current: int = 3) -> None:
        self.probes = Probes(*answers)
        self.policy = RestartPolicy()
        self.current = current
        self.replaced: List[Tuple[str, str, str]] = []
        self.health = ChildHealth("gpu:0", self.probes, self.policy,  # type: ignore[arg-type]
                                  lambda generation: generation == self.current, self.replace)

    def replace(self, code: str, message: str, why: str) -> bool:
        self.replaced.append((code, message, why))
        return True


class AfterFailureTests(SynchronousTestCase):
    def test_a_healthy_child_stays(self) -> None:
        h = Harness(True)
        self.assertIs(self.successResultOf(h.health.after_failure(ENDPOINT, MODEL, 3, "a timeout")), False)
        self.assertEqual((h.probes.asked, h.replaced), ([("http://127.0.0.1:20000", "q")], []))

    def test_a_child_that_fails_the_probe_is_replaced(self) -> None:
        for answer in (False, RuntimeError("refused")):
            h = Harness(answer)
            self.assertIs(self.successResultOf(h.health.after_failure(ENDPOINT, MODEL, 3, "a timeout")), True)
            self.assertEqual(h.replaced, [("unhealthy", "llama-server for 'qwen' failed a health probe after "
                                                        "a timeout on gpu:0; restarted", "unhealthy after a timeout")])

    def test_the_verdict_counts_only_for_the_child_probed(self) -> None:
        h = Harness(False, current=4)  # replaced meanwhile
        self.assertIs(self.successResultOf(h.health.after_failure(ENDPOINT, MODEL, 3, "a timeout")), False)
        self.assertEqual(h.replaced, [])


class InferenceTests(SynchronousTestCase):
    def test_replaced_after_failures_in_a_row_and_an_answer_starts_over(self) -> None:
        answers = [False] * (INFERENCE_PROBE_FAILURES - 1) + [True] + [False] * INFERENCE_PROBE_FAILURES
        h = Harness(*answers)
        results = [self.successResultOf(h.health.inference(ENDPOINT, MODEL, 3)) for _ in answers]
        self.assertEqual(results, answers)
        self.assertEqual([code for code, _, _ in h.replaced], ["inference_probe_failed"])
        self.assertEqual(h.replaced[0][2], "failed its inference probes")

    def test_a_hung_or_broken_probe_is_a_failure(self) -> None:
        h = Harness(*([RuntimeError("timeout")] * INFERENCE_PROBE_FAILURES))
        for _ in range(INFERENCE_PROBE_FAILURES):
            self.assertIs(self.successResultOf(h.health.inference(ENDPOINT, MODEL, 3)), False)
        self.assertEqual(len(h.replaced), 1)

    def test_a_child_no_longer_serving_is_not_judged(self) -> None:
        h = Harness(False, current=9)
        self.assertIs(self.successResultOf(h.health.inference(ENDPOINT, MODEL, 3)), False)
        self.assertEqual((h.policy.inference_failures, h.replaced), (0, []))
