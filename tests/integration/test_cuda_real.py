"""The ``cuda`` backend on a real NVIDIA GPU (skipped on a host without one).

Where NVML finds a GPU:

- discovery through NVML and through ``nvidia-smi`` name the same devices
  (index, uuid, memory) and a sample reads the same figures both ways;

and, with a CUDA build of llama-server (``ROLEMESH_TEST_LLAMA_SERVER``, or
the installed one when its ``--list-devices`` shows a CUDA device), the
agent as a process with ``backend: cuda``:

- sees the build's CUDA devices at start-up (no "no cuda support" warning);
- starts the child for ``gpu:0`` pinned (``CUDA_VISIBLE_DEVICES=0``,
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` in its environment), the child reports
  exactly one CUDA device and puts the model's buffers on it, and NVML lists
  the child's pid among the GPU's compute processes;
- answers a chat completion and a stream from the GPU;
- reports the GPU in its inventory, busy while eight streams run;
- holds the memory estimate to what the child allocated on the GPU (the
  logged buffers), and prints what the CUDA context adds on top of them.

and with ``backend: cpu`` on the same host the child keeps off the GPU
(``--device none``, no CUDA device visible): NVML does not list it.

``scripts/gpu-check.sh`` runs this module on a GPU host and keeps the output.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Any, Dict, List, Optional, Tuple

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from rolemesh.backends.commands import run_sync
from rolemesh.backends.cuda import (
    NVIDIA_SMI_QUERY,
    CudaBackend,
    import_pynvml,
    nvml_readings,
    parse_nvidia_smi_csv,
)
from rolemesh.children.llama_build import ListedDevice, check_gpu_support, parse_list_devices
from rolemesh.scheduling.estimate import RUNTIME_BYTES
from tests.fixtures.llama import LLAMA_SERVER_ENV, llama_server_binary
from tests.fixtures.tiny_gguf import write_tiny_gguf
from tests.integration.harness import AgentProcess, Stream, require_llama_server, wait_until
from tests.integration.test_estimate_real import logged_buffers

MIB = 1 << 20
BACKEND, DEVICE, BUFFER = "cuda", "gpu:0", "CUDA0"
#: head size 128 (n_embd 256, 2 heads): a size CUDA's flash-attention kernels have.
GPU_MODEL = {"n_embd": 256, "n_head": 2, "n_ff": 512, "n_layer": 4, "n_ctx": 32768}


def nvml() -> Any:
    """Initialised pynvml, or SkipTest when there is no NVIDIA GPU here."""
    try:
        module = import_pynvml()
        module.nvmlInit()
    except Exception as e:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded
        raise SkipTest(f"no NVIDIA GPU here (NVML: {type(e).__name__}: {e})")
    if module.nvmlDeviceGetCount() == 0:
        raise SkipTest("NVML finds no NVIDIA GPU")
    return module


def cuda_llama_server() -> Tuple[str, List[ListedDevice]]:
    """A llama-server built with CUDA and the CUDA devices it lists, or SkipTest."""
    binary = llama_server_binary()
    if binary is None:
        raise SkipTest(f"no llama-server (set {LLAMA_SERVER_ENV} to a CUDA build)")
    out = subprocess.run([binary, "--list-devices"], capture_output=True, text=True, timeout=60).stdout
    listed = [d for d in parse_list_devices(out) or [] if d.name.startswith("CUDA")]
    if not listed:
        raise SkipTest(f"{binary} is not a CUDA build (--list-devices: {out.strip()!r}); "
                       f"set {LLAMA_SERVER_ENV} to one")
    return binary, listed


def long_stream(model: str) -> Dict[str, Any]:
    return {"model": model, "prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}


def gpu_buffers(lines: List[str], model_id: str) -> Dict[str, float]:
    """Bytes per part the last child of ``model_id`` logged on the GPU (``BUFFER``), not in host memory."""
    return logged_buffers([line for line in lines if "buffer size" not in line or BUFFER in line], model_id)


def process_memory(nvml: Any, pid: int) -> Optional[int]:
    """GPU memory NVML says process ``pid`` uses on GPU 0."""
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    return {p.pid: p.usedGpuMemory for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}.get(pid)


class BuildCheckTests(SynchronousTestCase):
    """The start-up check against the real llama-server here, whatever its build."""

    def test_the_check_matches_what_the_build_lists(self) -> None:
        binary = require_llama_server()
        listed = parse_list_devices(subprocess.run([binary, "--list-devices"], capture_output=True, text=True,
                                                   timeout=60).stdout)
        self.assertIsNotNone(listed)
        fine, line = check_gpu_support("cuda", binary)
        print(f"\n{line}")
        self.assertEqual(fine, any(d.name.startswith("CUDA") for d in listed or []))
        self.assertIn("sees CUDA" if fine else "has no cuda support", line)


class DiscoveryTests(SynchronousTestCase):
    """NVML and nvidia-smi agree about the GPUs on this host."""

    def setUp(self) -> None:
        self.nvml = nvml()
        self.addCleanup(self.nvml.nvmlShutdown)

    def test_nvml_and_nvidia_smi_name_the_same_devices(self) -> None:
        by_nvml = CudaBackend()
        by_smi = CudaBackend(load_nvml=None)
        found = by_nvml.discover()
        self.addCleanup(by_nvml.close)
        listed = by_smi.discover()
        print("\nNVML:", [d.to_json() for d in found], "\nnvidia-smi:", [d.to_json() for d in listed])
        self.assertEqual(by_nvml.source, "nvml")
        self.assertEqual(by_smi.source, "nvidia-smi")
        self.assertEqual([(d.name, d.index, d.uuid) for d in found], [(d.name, d.index, d.uuid) for d in listed])
        for a, b in zip(found, listed):
            self.assertTrue(a.uuid and a.uuid.startswith(("GPU-", "MIG-")), a)
            self.assertIn("NVIDIA", a.model or "")
            # nvidia-smi says MiB; NVML says bytes
            self.assertLess(abs((a.memory_total_bytes or 0) - (b.memory_total_bytes or 0)), MIB, (a, b))

    def test_a_sample_reads_the_same_memory_both_ways(self) -> None:
        backend = CudaBackend()
        devices = backend.discover()
        self.addCleanup(backend.close)
        readings = nvml_readings(self.nvml, devices, {})
        smi = {r.index: r for r in parse_nvidia_smi_csv(run_sync(NVIDIA_SMI_QUERY)[1])}
        for reading in readings:
            assert not isinstance(reading, str), reading
            other = smi[reading.index]
            print(f"\ngpu:{reading.index} NVML {reading}\n      nvidia-smi {other}")
            # both what CUDA can allocate; nvidia-smi's used and free are rounded to MiB
            self.assertLessEqual(abs((reading.memory_total_bytes or 0) - (other.memory_total_bytes or 0)), MIB)
            used = reading.memory_used_bytes or 0
            self.assertLess(abs(used - (other.memory_used_bytes or 0)), 64 * MIB, (reading, other))
            self.assertIsNotNone(reading.utilization_pct)
            self.assertIsNotNone(reading.temperature_c)


class AgentOnGpuTests(SynchronousTestCase):
    """The agent, ``backend: cuda``, serving a model from ``gpu:0``."""

    def setUp(self) -> None:
        self.nvml = nvml()
        self.addCleanup(self.nvml.nvmlShutdown)
        self.binary, self.listed = cuda_llama_server()
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        path = write_tiny_gguf(os.path.join(self.dir, "gpu.gguf"), name="gpu", **GPU_MODEL)
        quant = write_tiny_gguf(os.path.join(self.dir, "gpu-q4.gguf"), name="gpu-q4", quant="Q4_0", **GPU_MODEL)
        verbose = {"log-verbosity": 4}
        self.agent = AgentProcess(self.dir, {
            "backend": BACKEND,
            "devices": [DEVICE],
            "llama_server_bin": self.binary,
            "llama_server_startup_timeout_s": 120,
            "max_pending_requests_per_device": 16,
            "models": [
                {"model_id": "gpu", "path": path, "ctx_size": 8 * 4096, "server_args": {"parallel": 8, **verbose}},
                {"model_id": "gpu-q4", "path": quant, "ctx_size": 4096, "server_args": dict(verbose)},
            ],
        }, env={"CUDA_VISIBLE_DEVICES": ""})  # the agent's own pin must not leak into its child's
        self.addCleanup(self.agent.stop)

    def chat(self, model: str, stream: bool = False) -> Any:
        body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16,
                "stream": stream}
        return self.agent.request("POST", "/v1/chat/completions", body, timeout=120)

    def child_lines(self) -> List[str]:
        status, _, raw = self.agent.request("GET", f"/v1/node/devices/{DEVICE}/logs?tail=1000")
        self.assertEqual(status, 200, raw)
        return json.loads(raw)["lines"]

    def assert_build_sees_the_gpu(self, log: str) -> None:
        self.assertNotIn("has no cuda support", log)
        self.assertRegex(log, r"sees CUDA0 \(")

    def assert_pinned(self, pid: int) -> None:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        self.assertEqual(env.get(b"CUDA_VISIBLE_DEVICES"), b"0")
        self.assertEqual(env.get(b"CUDA_DEVICE_ORDER"), b"PCI_BUS_ID")

    def assert_total_is_cudas(self, total: int) -> None:
        """The agent places models in what CUDA can allocate, not in nvidia-smi's larger total."""
        self.assertLessEqual(abs(total / MIB - self.listed[0].total_mib), 1, (total, self.listed))

    def assert_on_the_gpu(self, lines: List[str]) -> None:
        text = "\n".join(lines)
        self.assertRegex(text, r"found 1 CUDA devices")
        self.assertRegex(text, BUFFER + " model buffer size")

    def test_pinned_child_serves_from_the_gpu(self) -> None:
        self.assert_build_sees_the_gpu(self.agent.log_text())
        status, _, raw = self.chat("gpu")
        self.assertEqual(status, 200, raw)
        self.assertTrue(json.loads(raw)["choices"][0]["message"]["content"] is not None)

        inventory = self.agent.inventory()
        print("\ninventory:", json.dumps(inventory, indent=1)[:6000])
        self.assertEqual(inventory["backend"], BACKEND)
        device = inventory["devices"][0]
        self.assertEqual((device["device"], device["state"], device["model"]), (DEVICE, "ready", "gpu"))
        self.assert_total_is_cudas(device["ref"]["memory_total_bytes"])
        pid = device["pid"]

        self.assert_pinned(pid)
        lines = self.child_lines()
        print("\nchild log (CUDA lines):\n" + "\n".join(line for line in lines if "CUDA" in line)[:4000])
        self.assert_on_the_gpu(lines)

        handle = self.nvml.nvmlDeviceGetHandleByIndex(0)
        processes = {p.pid: p for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        print("\nNVML compute processes:", {k: v.usedGpuMemory for k, v in processes.items()})
        self.assertIn(pid, processes)

        status, _, raw = self.chat("gpu", stream=True)
        self.assertEqual(status, 200, raw)
        events = [line[5:].strip() for line in raw.decode().splitlines() if line.startswith("data:")]
        self.assertEqual(events[-1], "[DONE]", events)
        self.assertGreater(len(events), 2, events)

        status, _, raw = self.chat("gpu-q4")
        self.assertEqual(status, 200, raw)
        self.assertEqual(self.agent.inventory()["devices"][0]["model"], "gpu-q4")
        self.assert_on_the_gpu(self.child_lines())

    def test_estimate_against_what_the_child_allocated_on_the_gpu(self) -> None:
        status, _, raw = self.agent.request("GET", "/v1/models")
        estimate = {m["id"]: m["memory_estimate"] for m in json.loads(raw)["data"]}["gpu"]
        status, _, raw = self.agent.request("POST", f"/v1/node/devices/{DEVICE}/load", {"model": "gpu"}, timeout=120)
        self.assertEqual(status, 200, raw)
        pid = self.agent.inventory()["devices"][0]["pid"]
        lines = self.child_lines()
        real = gpu_buffers(lines, "gpu")
        print("\nbuffer lines:\n" + "\n".join(line for line in lines if "buffer size" in line))
        used = process_memory(self.nvml, pid)
        buffers = sum(real.values())
        print(f"\nestimate {json.dumps(estimate)}\nlogged buffers (MiB) "
              f"{ {k: round(v / MIB, 2) for k, v in real.items()} }\nNVML: the child uses "
              f"{(used or 0) / MIB:.0f} MiB of GPU memory: {((used or 0) - buffers) / MIB:.0f} MiB beyond its buffers "
              "(the CUDA context and cuBLAS workspace)")
        self.assertGreater(real["model"], 0)
        for part, logged in (("weights_bytes", real["model"]), ("kv_cache_bytes", real["KV"])):
            self.assertLess(abs(estimate[part] - logged) / logged, 0.15, (part, estimate[part], logged))
        self.assertIsNotNone(used)

    def test_inventory_shows_the_gpu_busy_under_load(self) -> None:
        status, _, raw = self.chat("gpu")
        self.assertEqual(status, 200, raw)
        streams = [Stream(self.agent.port, long_stream("gpu"), repeat=True) for _ in range(8)]
        for s in streams:
            s.start()
        seen: List[Optional[float]] = []

        def busy() -> bool:
            metrics = self.agent.inventory()["devices"][0]["metrics"] or {}
            seen.append(metrics.get("utilization_pct"))
            return bool(metrics.get("utilization_pct"))

        try:
            wait_until(lambda: all(s.first.is_set() or s.error for s in streams), 60, what="eight streams")
            started = time.monotonic()
            wait_until(busy, 30, interval=0.5, what="GPU utilization above 0 in the inventory")
            print(f"\nutilization seen {seen}, above 0 after {time.monotonic() - started:.1f} s")
        finally:
            for s in streams:
                s.stop()
        self.assertEqual([s.error for s in streams], [None] * 8)
        metrics = self.agent.inventory()["devices"][0]["metrics"]
        self.assertGreater(metrics["memory_used_bytes"], 0)
        self.assertRegex(self.agent.log_text(), f"backend {BACKEND}: ")


#: About 1.6 GB of F32 weights (8 layers of 2048, heads of 128), 16k cells over 4 slots.
BIG_MODEL = {"n_embd": 2048, "n_head": 16, "n_ff": 5632, "n_layer": 8, "n_ctx": 16384}


class RuntimeOnGpuTests(SynchronousTestCase):
    """What a child really takes on the GPU (NVML's per-process figure) against
    the estimate: its buffers, plus ``RUNTIME_BYTES["cuda"]`` for the CUDA
    context and workspaces, once loaded and after four streams have run."""

    def setUp(self) -> None:
        self.nvml = nvml()
        self.addCleanup(self.nvml.nvmlShutdown)
        self.binary, _ = cuda_llama_server()
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        path = write_tiny_gguf(os.path.join(self.dir, "big.gguf"), name="big", **BIG_MODEL)
        self.agent = AgentProcess(self.dir, {
            "backend": BACKEND, "devices": [DEVICE], "llama_server_bin": self.binary,
            "llama_server_startup_timeout_s": 120, "max_pending_requests_per_device": 8,
            "models": [{"model_id": "big", "path": path, "ctx_size": 16384,
                        "server_args": {"parallel": 4, "log-verbosity": 4}}],
        })
        self.addCleanup(self.agent.stop)

    def test_the_estimate_covers_what_the_child_takes(self) -> None:
        status, _, raw = self.agent.request("GET", "/v1/models")
        estimate = json.loads(raw)["data"][0]["memory_estimate"]
        status, _, raw = self.agent.request("POST", f"/v1/node/devices/{DEVICE}/load", {"model": "big"}, timeout=120)
        self.assertEqual(status, 200, raw)
        pid = self.agent.inventory()["devices"][0]["pid"]
        loaded = process_memory(self.nvml, pid)
        streams = [Stream(self.agent.port, long_stream("big"), repeat=True) for _ in range(4)]
        for s in streams:
            s.start()
        try:
            wait_until(lambda: all(s.first.is_set() for s in streams), 60, what="four streams")
            busy = process_memory(self.nvml, pid)
        finally:
            for s in streams:
                s.stop()
        self.assertEqual([s.error for s in streams], [None] * 4)
        status, _, raw = self.agent.request("GET", f"/v1/node/devices/{DEVICE}/logs?tail=1000")
        lines = json.loads(raw)["lines"]
        real = gpu_buffers(lines, "big")
        buffers = int(sum(real.values()))
        report: Dict[str, Any] = {
            "estimate_MiB": {k: round(v / MIB, 1) for k, v in estimate.items() if k.endswith("_bytes")},
            "gpu_buffers_MiB": {k: round(v / MIB, 1) for k, v in real.items()},
            "nvml_loaded_MiB": round((loaded or 0) / MIB), "nvml_busy_MiB": round((busy or 0) / MIB),
            "runtime_loaded_MiB": round(((loaded or 0) - buffers) / MIB),
            "runtime_busy_MiB": round(((busy or 0) - buffers) / MIB),
        }
        print("\n" + json.dumps(report, indent=1))
        self.assertIsNotNone(busy)
        for part, logged in (("weights_bytes", real["model"]), ("kv_cache_bytes", real["KV"])):
            self.assertLess(abs(estimate[part] - logged) / logged, 0.15, report)
        self.assertLessEqual(max(loaded or 0, busy or 0) - buffers, RUNTIME_BYTES["cuda"], report)
        self.assertLessEqual(max(loaded or 0, busy or 0), estimate["total_bytes"], report)


class CpuBackendOnGpuHostTests(SynchronousTestCase):
    """``backend: cpu`` on a GPU host with a CUDA build: the child runs on the
    CPU (``--device none``), not on the GPU its memory is not counted in."""

    def test_the_child_leaves_the_gpu_alone(self) -> None:
        self.nvml = nvml()
        self.addCleanup(self.nvml.nvmlShutdown)
        binary, _ = cuda_llama_server()
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        path = write_tiny_gguf(os.path.join(directory, "gpu.gguf"), name="gpu", **GPU_MODEL)
        agent = AgentProcess(directory, {
            "backend": "cpu", "llama_server_bin": binary, "llama_server_startup_timeout_s": 120,
            "models": [{"model_id": "gpu", "path": path, "ctx_size": 4096, "server_args": {"log-verbosity": 4}}],
        })
        self.addCleanup(agent.stop)
        body = {"model": "gpu", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
        status, _, raw = agent.request("POST", "/v1/chat/completions", body, timeout=120)
        self.assertEqual(status, 200, raw)
        pid = agent.inventory()["devices"][0]["pid"]
        status, _, raw = agent.request("GET", "/v1/node/devices/cpu:0/logs?tail=1000")
        lines = [line for line in json.loads(raw)["lines"] if "buffer size" in line or "--device" in line]
        print("\n" + "\n".join(lines), f"\nNVML: the child uses {process_memory(self.nvml, pid)} bytes of GPU memory")
        self.assertTrue(lines)
        self.assertEqual([line for line in lines if "CUDA0" in line], [])
        self.assertIsNone(process_memory(self.nvml, pid))
