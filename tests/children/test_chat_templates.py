"""Which chat template a model uses (issue 28, item 7): the pure
:func:`rolemesh.children.chat_templates.describe`, the GGUF header read, and what
``--check`` prints."""

from __future__ import annotations

import io
import os

from twisted.trial.unittest import SynchronousTestCase

from rolemesh.children import chat_templates
from rolemesh.cli import template_report
from rolemesh.config import template_names as chat_template_names
from rolemesh.config.file import validate
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


class NamesTests(SynchronousTestCase):
    """rolemesh.config.template_names: the names the config check and the
    description share (below rolemesh.config.file, which imports them)."""

    def test_built_in_names_are_not_files_and_the_rest_are(self) -> None:
        self.assertFalse(chat_template_names.is_file("gemma"))
        self.assertFalse(chat_template_names.is_file(chat_template_names.FALLBACK))
        self.assertTrue(chat_template_names.is_file("/t/x.jinja"))
        self.assertTrue(chat_template_names.is_file("gemma3"))  # not a name this llama-server knows

    def test_the_fallback_is_a_built_in_name(self) -> None:
        self.assertIn(chat_template_names.FALLBACK, chat_template_names.BUILT_IN)

    def test_the_config_check_takes_names_and_paths_only(self) -> None:
        from rolemesh.base.errors import ConfigError
        from rolemesh.config.file import _chat_template

        self.assertEqual(_chat_template("m.chat_template", "llama3"), "llama3")
        for path in ("t/x", "x.jinja", "X.J2", "x.tmpl"):
            self.assertEqual(_chat_template("m.chat_template", path), path)
        with self.assertRaises(ConfigError) as raised:
            _chat_template("m.chat_template", "lama3")
        self.assertIn('(did you mean "llama3"?)', str(raised.exception))

    def test_chat_templates_shows_the_same_names(self) -> None:
        self.assertIs(chat_templates.BUILT_IN, chat_template_names.BUILT_IN)
        self.assertIs(chat_templates.is_file, chat_template_names.is_file)
        self.assertEqual(chat_templates.template_args("gemma"), ["--no-jinja", "--chat-template", "gemma"])
        self.assertEqual(chat_templates.template_args("t.jinja"), ["--chat-template-file", "t.jinja"])


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
