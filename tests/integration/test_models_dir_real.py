"""The models folder with a real llama-server (issue 28, item 1): every GGUF
in ``models_dir`` is served under its file name, a ``models`` entry refines
one by id, bad files are one log line each (the agent starts), and a reload
serves a file that appeared and drops one that went -- once idle: while a
request for it runs, it is still listed and that request finishes."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal

from twisted.trial.unittest import SynchronousTestCase

from tests.fixtures.llama import read_sse
from tests.fixtures.tiny_gguf import write_tiny_gguf
from tests.integration.harness import AgentProcess, require_llama_server, tiny_model, wait_until

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class ModelsFolderTests(SynchronousTestCase):
    def setUp(self) -> None:
        require_llama_server()
        self.dir = os.path.abspath(self.mktemp())
        self.folder = os.path.join(self.dir, "models")
        os.makedirs(self.folder)
        self.spare = os.path.join(self.dir, "spare")
        shutil.copy(tiny_model(self.spare, "a", 1), os.path.join(self.folder, "tiny-a.gguf"))
        with open(os.path.join(self.folder, "README.txt"), "w") as f:
            f.write("not a model\n")
        with open(os.path.join(self.folder, "broken.gguf"), "wb") as f:
            f.write(b"<html>a failed download</html>")

    def ids(self, agent: AgentProcess) -> list:
        status, _, body = agent.request("GET", "/v1/models")
        self.assertEqual(status, 200, body)
        return sorted(m["id"] for m in json.loads(body)["data"])

    def chat(self, agent: AgentProcess, model: str) -> int:
        return agent.request("POST", "/v1/chat/completions", {**CHAT, "model": model}, timeout=60)[0]

    def reload(self, agent: AgentProcess) -> dict:
        status, _, body = agent.request("POST", "/v1/node/reload", timeout=30)
        self.assertEqual(status, 200, body)
        return json.loads(body)

    def test_add_and_remove_a_file_then_reload(self) -> None:
        agent = AgentProcess(self.dir, {"models_dir": self.folder,
                                        "models": [{"model_id": "tiny-a", "roles": ["chat"]}]})
        self.addCleanup(agent.stop)
        self.assertEqual(self.ids(agent), ["tiny-a"])
        self.assertEqual(self.chat(agent, "chat"), 200)  # the refining entry's role
        log = agent.log_text()
        self.assertEqual(log.count("broken.gguf: not a GGUF file (bad magic); not served"), 1, log)
        self.assertEqual(log.count("README.txt: not a .gguf file; not served"), 1, log)

        shutil.copy(tiny_model(self.spare, "b", 2), os.path.join(self.folder, "tiny-b.gguf"))
        answer = self.reload(agent)
        self.assertEqual(answer["models"]["added"], ["tiny-b"])
        self.assertEqual(self.ids(agent), ["tiny-a", "tiny-b"])
        self.assertEqual(self.chat(agent, "tiny-b"), 200)

        os.remove(os.path.join(self.folder, "tiny-a.gguf"))
        answer = self.reload(agent)
        self.assertEqual(answer["models"]["removed"], ["tiny-a"])
        self.assertEqual(self.ids(agent), ["tiny-b"])
        self.assertEqual(self.chat(agent, "tiny-a"), 404)
        self.assertIn("models[0]: no file in models_dir for model_id 'tiny-a' and no path; not served",
                      agent.log_text())

    def test_a_removed_file_stays_listed_while_its_request_runs_then_leaves(self) -> None:
        long = os.path.join(self.folder, "tiny-long.gguf")
        write_tiny_gguf(long, seed=5, name="tiny-long", n_ctx=4096)
        agent = AgentProcess(self.dir, {"models_dir": self.folder,
                                        "models": [{"model_id": "tiny-long", "ctx_size": 4096}]})
        self.addCleanup(agent.stop)
        self.assertEqual(self.chat(agent, "tiny-long"), 200)
        pid = agent.inventory()["devices"][0]["pid"]
        conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=60)
        self.addCleanup(conn.close)
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": "tiny-long", "prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True}),
            {"Content-Type": "application/json"})
        response = conn.getresponse()
        self.assertEqual(response.status, 200)
        self.assertTrue(response.readline().startswith(b"data: "))
        os.kill(pid, signal.SIGSTOP)  # the answer is under way, and stays so until SIGCONT
        try:
            os.remove(long)
            self.assertEqual(self.reload(agent)["models"]["removed"], ["tiny-long"])
            status, _, body = agent.request("GET", "/v1/models")
            listed = {m["id"]: m for m in json.loads(body)["data"]}
            self.assertEqual(sorted(listed), ["tiny-a", "tiny-long"])
            self.assertIs(listed["tiny-long"]["leaving"], True)
            self.assertNotIn("leaving", listed["tiny-a"])
            self.assertEqual(self.chat(agent, "tiny-long"), 404)  # a new request: gone
            self.assertEqual(agent.inventory()["devices"][0]["in_flight"], 1, "the request ran throughout")
        finally:
            os.kill(pid, signal.SIGCONT)
        events = read_sse(response.read())
        self.assertEqual(events[-1], "[DONE]")  # the request in flight finished
        self.assertGreater(len(events), 100)
        wait_until(lambda: self.ids(agent) == ["tiny-a"], 30, interval=0.05, what="tiny-long leaving /v1/models")
        wait_until(lambda: agent.inventory()["devices"][0]["state"] == "stopped", 30, interval=0.05,
                   what="its child stopped")
        self.assertIn("unloading tiny-long from cpu:0: removed from the configuration", agent.log_text())
