"""``rolemesh-node-agent --model PATH.gguf``: a start without a config file
(issue 26, item 6).  Config loading and the command line's argument errors;
nothing here starts an agent (tests/integration/test_one_line_start.py does)."""

from __future__ import annotations

import io
import os
import sys
from typing import List, Tuple

from twisted.trial.unittest import SynchronousTestCase

from rolemesh import cli
from rolemesh.base.errors import ConfigError
from rolemesh.config.file import load_config, model_id_of, with_model_files


class Files(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.env = {"XDG_STATE_HOME": os.path.join(self.dir, "state")}

    def gguf(self, name: str, folder: str = "") -> str:
        directory = os.path.join(self.dir, folder)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, name)
        with open(path, "wb") as f:
            f.write(b"GGUF")
        return path

    def yaml(self, text: str) -> str:
        path = os.path.join(self.dir, "node.yaml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path


class ModelFilesTests(Files):
    def test_model_ids_are_the_file_names_without_gguf(self) -> None:
        self.assertEqual(model_id_of("/w/qwen2.5-7b-q4_k_m.gguf"), "qwen2.5-7b-q4_k_m")
        self.assertEqual(model_id_of("x.GGUF"), "x")
        self.assertEqual(model_id_of("weights/llama"), "llama")
        self.assertEqual(model_id_of(".gguf"), ".gguf")

    def test_models_alone_everything_else_default(self) -> None:
        a, b = self.gguf("a.gguf"), self.gguf("b-1.gguf", "sub")
        config = load_config(None, model_files=[a, os.path.relpath(b)], environ=self.env)
        self.assertEqual([(m.model_id, m.path) for m in config.models], [("a", a), ("b-1", b)])
        self.assertEqual((config.listen_host, config.listen_port), ("127.0.0.1", 8090))
        self.assertEqual(config.models[0].parallel, 1)
        self.assertEqual(config.state_dir, os.path.join(self.dir, "state", "rolemesh-node"))

    def test_added_to_the_configs_models(self) -> None:
        x, y = self.gguf("x.gguf"), self.gguf("y.gguf")
        path = self.yaml(f"listen_port: 9001\nmodels:\n  - model_id: x\n    path: {x}\n    ctx_size: 512\n")
        config = load_config(path, model_files=[y], environ=self.env)
        self.assertEqual([m.model_id for m in config.models], ["x", "y"])
        self.assertEqual((config.listen_port, config.models[0].ctx_size, config.models[1].ctx_size), (9001, 512, None))

    def assertError(self, files: List[str], expected: str, config: str = "") -> None:
        path = self.yaml(config) if config else None
        with self.assertRaises(ConfigError) as caught:
            load_config(path, model_files=files, environ=self.env)
        self.assertEqual(str(caught.exception), expected)

    def test_a_missing_file(self) -> None:
        missing = os.path.join(self.dir, "nope.gguf")
        self.assertError([missing], f"--model {missing}: no such file")

    def test_a_folder(self) -> None:
        self.assertError([self.dir], f"--model {self.dir}: not a regular file (expected a GGUF file)")

    def test_two_files_of_one_name(self) -> None:
        a, b = self.gguf("m.gguf", "one"), self.gguf("m.gguf", "two")
        self.assertError([a, b], f"--model {b}: model id \"m\" (the file name without .gguf) is already used by "
                                 f"--model {a}; rename the file or give it an entry with its own model_id in a "
                                 "config file")

    def test_a_name_the_config_uses(self) -> None:
        x, other = self.gguf("x.gguf"), self.gguf("coder.gguf", "o")
        config = f"models:\n  - model_id: x\n    path: {x}\n  - model_id: c\n    alias: coder\n    path: {x}\n"
        self.assertError([other], f"--model {other}: model id \"coder\" (the file name without .gguf) is already "
                                  "used by models[1].alias in the config; rename the file or give it an entry "
                                  "with its own model_id in a config file", config)

    def test_pure_without_file_checks(self) -> None:
        raw = with_model_files({"models": None}, ["/srv/w/m.gguf"], check_files=False)
        self.assertEqual(raw["models"], [{"model_id": "m", "path": "/srv/w/m.gguf"}])


class SlotWarningTests(Files):
    def test_slots_the_pending_limit_keeps_unused_are_named(self) -> None:
        a = self.gguf("a.gguf")
        path = self.yaml(f"max_pending_requests_per_device: 2\nmodels:\n"
                         f"  - {{model_id: four, path: {a}, server_args: {{parallel: 4}}}}\n"
                         f"  - {{model_id: two, path: {a}, server_args: {{parallel: 2}}}}\n")
        config = load_config(path, model_files=[a], environ=self.env)
        self.assertEqual(cli.slot_warnings(config), [
            "four: llama-server gets 4 slots (parallel) but a device admits 2 requests "
            "(max_pending_requests_per_device): at most 2 run at once; raise max_pending_requests_per_device "
            "to use every slot"])


class CommandLineTests(Files):
    def main(self, *argv: str) -> Tuple[int, str]:
        err, saved = io.StringIO(), sys.stderr
        sys.stderr = err
        try:
            try:
                code = cli.main(list(argv))
            except SystemExit as e:  # argparse's usage errors
                code = int(e.code or 0)
        finally:
            sys.stderr = saved
        return code, err.getvalue()

    def test_neither_config_nor_model(self) -> None:
        code, err = self.main()
        self.assertEqual(code, 2)
        self.assertIn("give --config FILE, or --model PATH.gguf (or both)", err)

    def test_an_override_needs_a_base(self) -> None:
        code, err = self.main("--model", self.gguf("m.gguf"), "--config-override", self.yaml("{}"))
        self.assertEqual(code, 2)
        self.assertIn("--config-override needs --config", err)

    def test_a_missing_model_is_one_line_and_status_2(self) -> None:
        missing = os.path.join(self.dir, "typo.gguf")
        code, err = self.main("--model", missing)
        self.assertEqual((code, err), (2, f"rolemesh-node-agent: --model {missing}: no such file\n"))

    def test_a_clash_is_one_line_and_status_2(self) -> None:
        a = self.gguf("m.gguf")
        code, err = self.main("--model", a, "--model", a)
        self.assertEqual(code, 2)
        self.assertEqual(err.count("\n"), 1, err)
        self.assertIn("model id \"m\" (the file name without .gguf) is already used by --model", err)

    def test_help_shows_the_option(self) -> None:
        self.assertIn("--model PATH.gguf", cli.build_parser().format_help())
