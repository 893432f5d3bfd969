"""``rolemesh-node-agent status`` without an agent (issue 28, item 5): the
pure table, the address from a config, ``--json``, ``--watch`` and the
one-line errors, with a fake fetch."""

from __future__ import annotations

import io
import json
import os
from typing import Any, Dict, List

from twisted.trial.unittest import SynchronousTestCase

from rolemesh import cli, status
from rolemesh.config.file import validate

ANSWER: Dict[str, Any] = {
    "url": "http://127.0.0.1:8090",
    "inventory": {
        "node_id": "n1", "backend": "cuda", "draining": False, "warnings": ["listening on 0.0.0.0 without a key"],
        "devices": [
            {"device": "cuda:0", "state": "ready", "model": "big", "queued": 1, "pending_limit": 4,
             "slots_total": 4, "slots_busy": 3, "tokens_per_s": 41.25, "last_error": None,
             "metrics": {"memory_used_bytes": 7 << 30, "memory_total_bytes": 24 << 30}},
            {"device": "cuda:1", "state": "starting", "model": "small", "queued": 0, "pending_limit": 4,
             "slots_total": None, "slots_busy": None, "tokens_per_s": None, "load": {"progress": 0.5},
             "last_error": "llama-server exited with status 1\nsecond line", "metrics": None},
        ],
        "groups": [{"group": "cuda:0+cuda:1", "state": "stopped"}],
        "models": [
            {"model_id": "big", "memory_estimate": {"total_bytes": 6 << 30}, "fits_on": ["cuda:0"],
             "chat_template": {"source": "gguf"}},
            {"model_id": "small", "memory_estimate": {"total_bytes": 512 << 20}, "fits_on": ["cuda:0", "cuda:1"],
             "chat_template": {"source": "fallback"}},
        ],
    },
    "models": {"data": [
        {"id": "big", "loaded_on": ["cuda:0"], "loading_on": [], "fits_on": ["cuda:0"]},
        {"id": "small", "loaded_on": [], "loading_on": ["cuda:1"], "fits_on": ["cuda:0", "cuda:1"]},
        {"id": "huge", "loaded_on": [], "loading_on": [], "fits_on": []},
    ]},
}


class RenderTests(SynchronousTestCase):
    def test_the_table(self) -> None:
        self.assertEqual(status.render(ANSWER).splitlines(), [
            "node n1 at http://127.0.0.1:8090: backend cuda",
            "",
            "DEVICE  BACKEND  MODEL  STATE         MEMORY EST  MEMORY USED           SLOTS  QUEUE  TOK/S  LAST ERROR",
            "cuda:0  cuda     big    ready         6.00 GiB    7.00 GiB / 24.00 GiB  3/4    1/4    41.2   -",
            "cuda:1  cuda     small  starting 50%  512.0 MiB   -                     -      0/4    -      "
            "llama-server exited with status 1 second line",
            "",
            "MODEL  LOADED ON  LOADING ON  CAN RUN ON        MEMORY EST  CHAT TEMPLATE",
            "big    cuda:0     -           cuda:0            6.00 GiB    gguf",
            "small  -          cuda:1      cuda:0, cuda:1    512.0 MiB   chatml (fallback)",
            "huge   -          -           none (too large)  -           -",
            "warning: listening on 0.0.0.0 without a key",
        ])

    def test_address_from_config(self) -> None:
        config = validate({"listen_host": "0.0.0.0", "listen_port": 9001, "api_keys": ["k1", "k2"]},
                          check_files=False, environ={})
        self.assertEqual(status.address_from_config(config), ("http://127.0.0.1:9001", "k1"))
        config = validate({"listen": "tcp6:8091:interface=\\:\\:1"}, check_files=False, environ={})
        self.assertEqual(status.address_from_config(config), ("http://[::1]:8091", None))


class MainTests(SynchronousTestCase):
    def run_status(self, argv: List[str], answers: List[Any], **kw: Any):
        out, err, asked, slept = io.StringIO(), io.StringIO(), [], []

        def get(url: str, key: Any, timeout: float) -> Dict[str, Any]:
            asked.append((url, key, timeout))
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

        code = status.main(argv, out, err, get=get, sleep=slept.append, **kw)
        return code, out.getvalue(), err.getvalue(), asked, slept

    def test_json(self) -> None:
        code, out, err, asked, _ = self.run_status(["--url", "http://h:1/", "--api-key", "k", "--json"], [ANSWER])
        self.assertEqual((code, err, json.loads(out)), (0, "", ANSWER))
        self.assertEqual(asked, [("http://h:1", "k", 5.0)])

    def test_no_agent_is_one_line_and_exit_1(self) -> None:
        code, out, err, _, _ = self.run_status([], [status.StatusError("no agent answers at http://127.0.0.1:8090 "
                                                                       "(Connection refused)")])
        self.assertEqual((code, out), (1, ""))
        self.assertEqual(err, "rolemesh-node-agent status: no agent answers at http://127.0.0.1:8090 "
                              "(Connection refused)\n")

    def test_watch_redraws_and_outlives_an_absent_agent(self) -> None:
        code, out, err, asked, slept = self.run_status(
            ["--watch", "0.5"], [ANSWER, status.StatusError("no agent answers at x"), ANSWER], rounds=3)
        self.assertEqual((code, err, slept), (0, "", [0.5, 0.5]))
        self.assertEqual(out.count(status.CLEAR), 3)
        self.assertEqual(out.count("node n1 at"), 2)
        self.assertIn("no agent answers at x", out)

    def test_the_config_gives_the_address_and_key(self) -> None:
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        path = os.path.join(directory, "agent.yaml")
        with open(path, "w") as f:
            f.write("listen_port: 9123\napi_key: sekrit\nstate_dir: " + directory + "\n")
        _, _, _, asked, _ = self.run_status(["--config", path], [ANSWER])
        self.assertEqual(asked, [("http://127.0.0.1:9123", "sekrit", 5.0)])
        _, _, _, asked, _ = self.run_status(["--config", path, "--api-key", "other"], [ANSWER])
        self.assertEqual(asked[0][1], "other")

    def test_a_bad_config_is_one_line_and_exit_2(self) -> None:
        code, _, err, asked, _ = self.run_status(["--config", "/nonexistent/agent.yaml"], [])
        self.assertEqual((code, asked), (2, []))
        self.assertEqual(err, "rolemesh-node-agent status: /nonexistent/agent.yaml: no such file\n")

    def test_the_cli_dispatches_the_subcommand_only(self) -> None:
        called = []
        self.patch(status, "main", lambda argv: called.append(argv) or 0)
        self.assertEqual(cli.main(["status", "--json"]), 0)
        self.assertEqual(called, [["--json"]])
        # The agent's own command line is unchanged: a config named "status" is still --config.
        self.assertEqual(cli.build_parser().parse_args(["--config", "status"]).config, "status")
