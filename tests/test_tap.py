"""``twistd rolemesh-node``: option parsing and service building (rolemesh.tap)."""

from __future__ import annotations

import io
import os
import sys
import types
from typing import Any, Dict, List

import yaml
from twisted.application.service import IServiceMaker
from twisted.plugin import getPlugins
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

import rolemesh.service
from rolemesh import tap


class TapTestCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.stderr = io.StringIO()
        self.patch(sys, "stderr", self.stderr)

    def write(self, name: str, data: Dict[str, Any]) -> str:
        path = os.path.join(self.dir, name)
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(data, f)
        return path

    def base(self, **extra: Any) -> str:
        return self.write("agent.yaml", {"node_id": "tap-node", "backend": "cpu", "models": [],
                                         "state_dir": os.path.join(self.dir, "state"), **extra})

    def parse(self, argv: List[str], parent: Any = None) -> tap.Options:
        options = tap.Options()
        if parent is not None:
            options.parent = parent
        options.parseOptions(argv)
        return options

    def one_line_exit(self, call: Any) -> str:
        with self.assertRaises(SystemExit) as caught:
            call()
        self.assertEqual(caught.exception.code, 2)
        text = self.stderr.getvalue()
        self.assertEqual(text.count("\n"), 1, text)
        self.assertNotIn("Traceback", text)
        self.assertTrue(text.startswith("rolemesh-node-agent: "), text)
        return text


class OptionsTests(TapTestCase):
    def test_config_and_override_are_loaded(self) -> None:
        override = self.write("local.yaml", {"node_id": "overridden"})
        options = self.parse(["--config", self.base(), "--config-override", override])
        self.assertEqual(options.config.node_id, "overridden")
        self.assertEqual(options["config"], os.path.join(self.dir, "agent.yaml"))

    def test_short_config_flag(self) -> None:
        self.assertEqual(self.parse(["-c", self.base()]).config.node_id, "tap-node")

    def test_config_is_required(self) -> None:
        with self.assertRaises(usage.UsageError) as caught:
            self.parse([])
        self.assertIn("--config is required", str(caught.exception))

    def test_log_format_must_be_text_or_json(self) -> None:
        with self.assertRaises(usage.UsageError) as caught:
            self.parse(["--config", self.base(), "--log-format", "xml"])
        self.assertIn("text or json", str(caught.exception))

    def test_log_format_overrides_the_config_and_json_picks_twistds_logger(self) -> None:
        parent: Dict[str, Any] = {"logger": None}
        options = self.parse(["--config", self.base(), "--log-format", "json"], parent=parent)
        self.assertEqual(options.config.log_format, "json")
        self.assertEqual(parent["logger"], "rolemesh.base.logs.json_logger")

    def test_an_explicit_twistd_logger_is_kept(self) -> None:
        parent: Dict[str, Any] = {"logger": "my.logger"}
        self.parse(["--config", self.base(log_format="json")], parent=parent)
        self.assertEqual(parent["logger"], "my.logger")

    def test_a_bad_config_is_one_line_and_exit_2(self) -> None:
        path = self.base(listen_port="nope")
        text = self.one_line_exit(lambda: self.parse(["--config", path]))
        self.assertIn("listen_port", text)

    def test_a_missing_config_file_is_one_line_and_exit_2(self) -> None:
        self.one_line_exit(lambda: self.parse(["--config", os.path.join(self.dir, "absent.yaml")]))


class MakeServiceTests(TapTestCase):
    def test_a_config_the_service_rejects_is_one_line_and_exit_2(self) -> None:
        options = self.parse(["--config", self.base(listen_host="0.0.0.0", require_auth_off_loopback=True)])
        text = self.one_line_exit(lambda: tap.makeService(options))
        self.assertIn("require_auth_off_loopback", text)

    def test_the_service_rereads_the_files_it_was_started_with(self) -> None:
        override = self.write("local.yaml", {"node_id": "overridden"})
        options = self.parse(["--config", self.base(), "--config-override", override])
        calls: List[Any] = []
        built = types.SimpleNamespace(freeze_heap=False)
        self.patch(rolemesh.service, "make_service", lambda config, **kw: calls.append((config, kw)) or built)
        self.assertIs(tap.makeService(options), built)
        [(config, kw)] = calls
        self.assertIs(config, options.config)
        self.assertEqual(kw["config_paths"], (options["config"], override))
        self.assertTrue(built.freeze_heap, "the long-running process freezes its start-up heap")


class PluginTests(SynchronousTestCase):
    def test_twistd_finds_the_plugin(self) -> None:
        makers = {m.tapname: m for m in getPlugins(IServiceMaker)}
        self.assertIn("rolemesh-node", makers)
        maker = makers["rolemesh-node"]
        self.assertIs(maker.options, tap.Options)
        self.assertEqual(maker.module, "rolemesh.tap")
