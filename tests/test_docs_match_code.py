"""docs/api.md and docs/operations/logs.md agree with what the code really does.

The error table must name every error code the code can answer with (found
by reading the source for ``ApiError(...)`` and ``_bad_request(...)``
calls), and the JSON log documentation must match a real request log line
(its example has exactly the real keys, and every key is in the field table).
"""

from __future__ import annotations

import ast
import json
import os
import re
from typing import Set

from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base.logs import event_as_json
from tests.api.test_app import CHAT, ApiHarness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_DOC = os.path.join(ROOT, "docs", "api.md")
LOGS_DOC = os.path.join(ROOT, "docs", "operations", "logs.md")


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def error_codes_in_source() -> Set[str]:
    """Every literal ``code`` passed to ``ApiError`` or ``_bad_request`` in rolemesh/."""
    codes: Set[str] = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "rolemesh")):
        for name in files:
            if not name.endswith(".py"):
                continue
            tree = ast.parse(read(os.path.join(folder, name)))
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                position = {"ApiError": 3, "_bad_request": 1}.get(called or "")
                if position is None:
                    continue
                values = [k.value for k in node.keywords if k.arg == "code"]
                if len(node.args) > position:
                    values.append(node.args[position])
                for value in values:
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        codes.add(value.value)
                if called == "_bad_request" and not values:
                    codes.add("invalid_request")
    return codes


class ErrorTableTests(SynchronousTestCase):
    def test_every_error_code_is_in_the_error_table(self) -> None:
        codes = error_codes_in_source()
        self.assertIn("model_not_found", codes, "the source scan finds the codes")
        self.assertIn("device_not_found", codes)
        table = "\n".join(line for line in read(API_DOC).splitlines() if line.startswith("|"))
        documented = set(re.findall(r"`([a-z][a-z_]+)`", table))
        self.assertEqual(codes - documented, set(), "error codes missing from docs/api.md's tables")


class JsonLogTests(SynchronousTestCase):
    def real_request_line(self) -> dict:
        h = ApiHarness()
        h.node_h.load("a")
        with capturedLogs() as events:
            answer = h.chat({"model": "a", **CHAT})
            h.reactor.advance(1)  # the request line is logged a moment after the answer
        self.assertEqual(answer.code, 200, answer.body)
        lines = [json.loads(event_as_json(e)) for e in events if e.get("log_namespace") == "rolemesh.api"]
        request_lines = [line for line in lines if "status" in line]
        self.assertEqual(len(request_lines), 1, lines)
        return request_lines[0]

    def documented_example(self) -> dict:
        text = read(LOGS_DOC)
        block = re.search(r"\*\*json\*\*.*?```json\n(.*?)\n```", text, re.DOTALL)
        assert block is not None, "the JSON log example in docs/operations/logs.md"
        return json.loads(block.group(1))

    def test_example_line_has_exactly_the_real_keys(self) -> None:
        real = self.real_request_line()
        example = self.documented_example()
        self.assertEqual(set(example), set(real))
        for key in ("status", "duration", "duration_ms"):
            self.assertIsInstance(example[key], type(real[key]), key)
        self.assertAlmostEqual(example["duration"] * 1000, example["duration_ms"], places=1)

    def test_every_real_key_is_in_the_field_table(self) -> None:
        real = self.real_request_line()
        text = read(LOGS_DOC)
        section = text[text.index("**json**"):]
        table = "\n".join(line.split("|")[1] for line in section.splitlines() if line.startswith("| `"))
        documented = set(re.findall(r"`([a-z_]+)`", table)) | {"time", "level", "namespace", "message"}
        self.assertEqual(set(real) - documented, set())
