"""``/infill`` and the rerank routes through the node, served by models that
support them: the agent as a process over the real llama-server, a tiny
FIM model and a tiny reranker (:mod:`tests.fixtures.tiny_task_gguf`), each
route compared with a llama-server of its own on the same file and flags.

Random weights: the infilled text and the scores mean nothing, so the
answers are compared by status, keys and the figures that do not depend
on sampling (the prompt, its token counts, the indices ranked).  Both the
child and the direct server run one slot (``--parallel 1``, what the agent
gives every child): with four slots this llama-server gives identical
documents of one rerank request different scores.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List

from twisted.trial.unittest import SynchronousTestCase

from tests.fixtures.llama import ServerProcess, http_request, read_sse, start_llama_server
from tests.fixtures.tiny_task_gguf import FIM_TOKENS, write_tiny_fim_gguf, write_tiny_reranker_gguf
from tests.integration.harness import AgentProcess, require_llama_server, wait_until

INFILL: Dict[str, Any] = {"input_prefix": "def f(", "input_suffix": "):", "n_predict": 2,
                          # random weights may stop at once (an end-of-text token): generate every token asked for
                          "ignore_eos": True}
RERANK: Dict[str, Any] = {"query": "a", "documents": ["a", "b", "hello world"]}
RERANK_ROUTES = ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking")


class InfillRerankRealTests(SynchronousTestCase):
    def setUp(self) -> None:
        require_llama_server()
        self.directory = os.path.abspath(self.mktemp())
        os.makedirs(self.directory)
        self.fim = write_tiny_fim_gguf(os.path.join(self.directory, "fim.gguf"), seed=31)
        self.ranker = write_tiny_reranker_gguf(os.path.join(self.directory, "ranker.gguf"), seed=32)
        self.agent = AgentProcess(self.directory, {"models": [
            {"model_id": "fim", "path": self.fim},
            {"model_id": "ranker", "path": self.ranker, "server_args": {"reranking": True}},
        ]})
        self.addCleanup(self.agent.stop)

    def node(self, path: str, body: Any) -> Any:
        return self.agent.request("POST", path, body, timeout=60)

    def direct(self, path: str, alias: str, *args: str) -> ServerProcess:
        """A llama-server of the test's own on ``path``, one slot as the agent's children."""
        server = start_llama_server(path, alias=alias, args=["--parallel", "1", *args],
                                    log_path=os.path.join(self.directory, f"direct-{alias}.log"))
        self.addCleanup(server.stop)
        return server

    def served(self, line: str) -> None:
        wait_until(lambda: line in self.agent.log_text(), 5, what=f"the log line {line!r}")

    def test_infill_through_the_node_answers_what_the_child_answers(self) -> None:
        direct = self.direct(self.fim, "fim")
        want_status, _, want_body = http_request("POST", direct.url + "/infill", INFILL, timeout=30)
        status, _, body = self.node("/infill", {"model": "fim", **INFILL})
        self.assertEqual((status, want_status), (200, 200), (body, want_body))
        got, want = json.loads(body), json.loads(want_body)
        self.assertEqual(sorted(got), sorted(want))
        self.assertEqual(sorted(got["generation_settings"]), sorted(want["generation_settings"]))
        self.assertEqual(sorted(got["timings"]), sorted(want["timings"]))
        for key in ("model", "prompt", "tokens_evaluated", "tokens_predicted", "stop_type", "truncated"):
            self.assertEqual(got[key], want[key], key)
        self.assertEqual(got["timings"]["prompt_n"], want["timings"]["prompt_n"])
        # the prompt is the child's own FIM assembly of the model's tokens
        self.assertEqual([got["prompt"].find(token) >= 0 for token in FIM_TOKENS], [True] * 3, got["prompt"])
        self.assertEqual((got["model"], got["tokens_predicted"]), ("fim", 2))
        self.served("POST /infill fim -> 200 on cpu:0")

    def test_a_streamed_infill_through_the_node_ends_as_the_childs(self) -> None:
        direct = self.direct(self.fim, "fim")
        body = {**INFILL, "stream": True}
        want_status, want_headers, want_raw = http_request("POST", direct.url + "/infill", body, timeout=30)
        status, headers, raw = self.node("/infill", {"model": "fim", **body})
        self.assertEqual((status, want_status), (200, 200), (raw, want_raw))
        self.assertEqual(headers["content-type"].split(";")[0], want_headers["content-type"].split(";")[0])
        got, want = ([json.loads(e) for e in read_sse(r) if e != "[DONE]"][-1] for r in (raw, want_raw))
        self.assertEqual(sorted(got), sorted(want))
        for key in ("stop", "tokens_predicted", "tokens_evaluated", "prompt"):
            self.assertEqual(got[key], want[key], key)

    def test_every_rerank_route_through_the_node_ranks_what_the_child_ranks(self) -> None:
        direct = self.direct(self.ranker, "ranker", "--reranking")
        # the OpenAI-style answer (``documents``: {"results": [...]}), cut to ``top_n``, and the
        # TEI-style one (``texts``: a bare list, with the texts where ``return_text``)
        bodies: List[Dict[str, Any]] = [RERANK, {**RERANK, "top_n": 1},
                                        {"query": "a", "texts": ["b", "a"], "return_text": True}]
        for path in RERANK_ROUTES:
            for body in bodies:
                want_status, _, want_raw = http_request("POST", direct.url + path, body, timeout=30)
                status, _, raw = self.node(path, {"model": "ranker", **body})
                self.assertEqual((status, want_status), (200, 200), (path, body, raw, want_raw))
                got, want = json.loads(raw), json.loads(want_raw)
                if "texts" in body:
                    self.assertIsInstance(got, list, raw)
                    got_results, want_results = got, want
                else:
                    self.assertEqual(sorted(got), sorted(want), path)
                    self.assertEqual((got["model"], got["usage"]), (want["model"], want["usage"]), path)
                    got_results, want_results = got["results"], want["results"]
                documents = body.get("documents") or body["texts"]
                self.assertEqual(len(got_results), min(body.get("top_n", len(documents)), len(documents)))
                self.assertEqual([sorted(r) for r in got_results], [sorted(r) for r in want_results])
                self.assertEqual(sorted(r["index"] for r in got_results),
                                 sorted(r["index"] for r in want_results), (path, body))
                score = "score" if "texts" in body else "relevance_score"
                scores = {r["index"]: r[score] for r in want_results}
                for result in got_results:
                    self.assertAlmostEqual(result[score], scores[result["index"]], places=4,
                                           msg=(path, body, got, want))
            self.served(f"POST {path} ranker -> 200 on cpu:0")

    def test_the_childs_own_refusals_pass_through_unchanged(self) -> None:
        # /v1/rerank of a model started without --reranking; /infill of a model with no FIM tokens
        plain = self.direct(self.fim, "fim")
        reranking = self.direct(self.ranker, "ranker", "--reranking")
        cases = [("fim", plain, "/v1/rerank", RERANK), ("ranker", reranking, "/infill", INFILL)]
        for model, direct, path, body in cases:
            want_status, want_headers, want_raw = http_request("POST", direct.url + path, body, timeout=30)
            status, headers, raw = self.node(path, {"model": model, **body})
            self.assertEqual(want_status, 501, want_raw)
            self.assertEqual((status, json.loads(raw)), (want_status, json.loads(want_raw)), (model, path))
            self.assertEqual(headers["content-type"].split(";")[0], want_headers["content-type"].split(";")[0])
            self.served(f"POST {path} {model} -> 501 on cpu:0")
