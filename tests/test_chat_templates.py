"""Which chat template a model uses (issue 28, item 7): the pure
:func:`rolemesh.chat_templates.describe`, the GGUF header read, and what
``--check`` prints."""

from __future__ import annotations

import io
import os

from twisted.trial.unittest import SynchronousTestCase

from rolemesh import chat_templates
from rolemesh.cli import template_report
from rolemesh.config import validate
from tests.fixtures.tiny_gguf import write_tiny_gguf


class DescribeTests(SynchronousTestCase):
    def test_the_field_wins(self) -> None:
        self.assertEqual(chat_templates.describe("gemma", False)["source"], "config")
        self.assertEqual(chat_templates.describe("/t/x.jinja", True)["kind"], "file")

    def test_the_ggufs_own(self) -> None:
        info = chat_templates.describe(None, True)
        self.assertEqual((info["source"], info["warning"]), ("gguf", None))

    def test_none_is_the_fallback_with_a_warning(self) -> None:
        info = chat_templates.describe(None, False)
        self.assertEqual((info["source"], info["template"]), ("fallback", "chatml"))
        self.assertIn("set chat_template", info["warning"])

    def test_unreadable_header_is_unknown_without_a_warning(self) -> None:
        info = chat_templates.describe(None, None)
        self.assertEqual((info["source"], info["warning"]), ("unknown", None))


class CheckReportTests(SynchronousTestCase):
    def test_check_says_which_template_each_model_uses(self) -> None:
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        with_template = write_tiny_gguf(os.path.join(directory, "t.gguf"))
        missing = os.path.join(directory, "missing.gguf")
        config = validate({"models": [
            {"model_id": "own", "path": with_template},
            {"model_id": "set", "path": with_template, "chat_template": "gemma"},
            {"model_id": "gone", "path": missing}]}, check_files=False, environ={})
        self.assertTrue(chat_templates.gguf_has_template(with_template))
        out = io.StringIO()
        template_report(config, out)
        self.assertEqual(out.getvalue().splitlines(), [
            "",
            "# chat template per model",
            "own: the GGUF's own (tokenizer.chat_template)",
            "set: gemma (built-in, from chat_template)",
            "gone: unknown (the GGUF header cannot be read)",
        ])
