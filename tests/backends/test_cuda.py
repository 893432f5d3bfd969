"""The cuda backend with an injected pynvml stand-in, and its nvidia-smi fallback with recorded
answers.  No NVIDIA driver, no threads: NVML work runs through an injected to_thread."""

from __future__ import annotations

from typing import Any, Callable, List

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from rolemesh.backends import BackendUnavailable
from rolemesh.backends.commands import MIB, ToolError, ToolTimeout
from rolemesh.backends.cuda import NVIDIA_SMI_LIST, NVIDIA_SMI_QUERY, CudaBackend
from rolemesh.base.devices import DeviceRef
from rolemesh.base.interfaces import IDeviceBackend
from rolemesh.children.llama_build import parse_list_devices
from tests.fixtures.backend_fakes import FakeNvml, FakeNVMLError, FakeTools, fixture, h100, ok, recorded_nvml


def inline(f: Callable[..., Any], *args: Any) -> Deferred:
    """to_thread that runs the work at once (the real one uses the reactor's thread pool)."""
    return maybeDeferred(f, *args)


class HeldThreads:
    """to_thread whose work only runs when the test says so: a thread that is slow or wedged."""

    def __init__(self) -> None:
        self.pending: List[tuple] = []

    def __call__(self, f: Callable[..., Any], *args: Any) -> Deferred:
        d: Deferred = Deferred()
        self.pending.append((d, f, args))
        return d

    def finish(self) -> None:
        d, f, args = self.pending.pop(0)
        d.callback(f(*args))


def no_pynvml() -> Any:
    raise ImportError("No module named 'pynvml'")


class NvmlTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(50)
        self.tools = FakeTools()

    def backend(self, nvml: Any, to_thread: Callable[..., Deferred] = inline) -> CudaBackend:
        backend = CudaBackend(self.clock, load_nvml=lambda: nvml, to_thread=to_thread, **self.tools.options())
        self.assertTrue(verifyObject(IDeviceBackend, backend))
        return backend

    def test_discover(self) -> None:
        nvml = FakeNvml([h100(0), h100(1)])
        backend = self.backend(nvml)
        devices = backend.discover()
        self.assertTrue(nvml.initialised)
        self.assertEqual(backend.source, "nvml")
        self.assertEqual([d.name for d in devices], ["gpu:0", "gpu:1"])
        self.assertEqual(
            devices[1],
            DeviceRef(
                backend="cuda",
                index=1,
                name="gpu:1",
                uuid="GPU-00000001-aaaa-bbbb-cccc-dddddddddddd",
                vendor="NVIDIA",
                model="NVIDIA H100 80GB HBM3",
                memory_total_bytes=85520809984,
            ),
        )
        self.assertEqual(self.tools.calls, [])  # nvidia-smi not needed

    def test_sample_uses_v2_memory(self) -> None:
        nvml = FakeNvml([h100(0)])
        backend = self.backend(nvml)
        devices = backend.discover()
        self.clock.advance(2)
        (m,) = self.successResultOf(backend.sample(devices))
        self.assertEqual(nvml.memory_calls[-1], nvml.nvmlMemory_v2)
        self.assertEqual((m.device, m.sampled_at), ("gpu:0", 52))
        self.assertEqual(
            (m.memory_total_bytes, m.memory_used_bytes, m.memory_free_bytes),
            (85520809984, 1293942784, 83666599936),
        )
        self.assertEqual((m.utilization_pct, m.temperature_c, m.power_w), (17.0, 34.0, 71.52))
        self.assertFalse(m.stale)

    def test_binding_without_v2_uses_v1(self) -> None:
        nvml = FakeNvml([h100(0)], v2=False)
        backend = self.backend(nvml)
        (m,) = self.successResultOf(backend.sample(backend.discover()))
        self.assertEqual(set(nvml.memory_calls), {None})
        self.assertEqual(m.memory_free_bytes, 83666599936)

    def test_driver_without_v2_falls_back_to_v1(self) -> None:
        nvml = FakeNvml([h100(0)], v2_fails=True)
        backend = self.backend(nvml)
        (m,) = self.successResultOf(backend.sample(backend.discover()))
        self.assertEqual(nvml.memory_calls[-2:], [nvml.nvmlMemory_v2, None])
        self.assertEqual(m.memory_used_bytes, 1293942784)

    def test_optional_fields_that_raise_are_none(self) -> None:
        backend = self.backend(FakeNvml([h100(0, temp=None, power_mw=None, util=None)]))
        (m,) = self.successResultOf(backend.sample(backend.discover()))
        self.assertEqual((m.utilization_pct, m.temperature_c, m.power_w), (None, None, None))
        self.assertEqual(m.memory_free_bytes, 83666599936)
        self.assertFalse(m.stale)

    def test_memory_error_marks_only_that_device_stale(self) -> None:
        nvml = FakeNvml([h100(0), h100(1)])
        backend = self.backend(nvml)
        devices = backend.discover()
        nvml.gpus[1]["memory_error"] = "GPU is lost"
        ok0, lost = self.successResultOf(backend.sample(devices))
        self.assertFalse(ok0.stale)
        self.assertTrue(lost.stale)
        self.assertEqual(lost.error, "gpu:1: NVML: GPU is lost")
        self.assertEqual(lost.memory_total_bytes, 85520809984)

    def test_mig_instances_replace_their_gpu(self) -> None:
        migs = [
            {
                "name": "NVIDIA A100-SXM4-40GB MIG 3g.20gb",
                "uuid": "MIG-aaaa",
                "total": 20 * 1024 * MIB,
                "used": 13 * MIB,
                "free": 20 * 1024 * MIB - 13 * MIB,
                "util": None,
                "temp": None,
                "power_mw": None,
            },
            {
                "name": "NVIDIA A100-SXM4-40GB MIG 2g.10gb",
                "uuid": "MIG-bbbb",
                "total": 10 * 1024 * MIB,
                "used": 0,
                "free": 10 * 1024 * MIB,
                "util": None,
                "temp": None,
                "power_mw": None,
            },
        ]
        nvml = FakeNvml([h100(0, name="NVIDIA A100-SXM4-40GB", mig=migs), h100(1)])
        backend = self.backend(nvml)
        devices = backend.discover()
        self.assertEqual(
            [(d.name, d.index, d.uuid) for d in devices],
            [
                ("gpu:0.0", 0, "MIG-aaaa"),
                ("gpu:0.1", 0, "MIG-bbbb"),
                ("gpu:1", 1, "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd"),
            ],
        )
        self.assertEqual(devices[0].model, "NVIDIA A100-SXM4-40GB MIG 3g.20gb")
        env = backend.child_environment(devices[1], {})
        self.assertEqual(env["CUDA_VISIBLE_DEVICES"], "MIG-bbbb")
        mig0, _, whole = self.successResultOf(backend.sample(devices))
        self.assertEqual((mig0.memory_used_bytes, mig0.utilization_pct), (13 * MIB, None))
        self.assertEqual(whole.utilization_pct, 17.0)

    def test_mig_mode_without_instances_is_noted(self) -> None:
        nvml = FakeNvml([h100(0, mig=[]), h100(1)])
        backend = self.backend(nvml)
        self.assertEqual([d.name for d in backend.discover()], ["gpu:1"])
        self.assertEqual(
            backend.notes, ["gpu:0 (NVIDIA H100 80GB HBM3) is in MIG mode with no MIG instances; skipped"]
        )

    def test_lost_gpu_at_discovery_is_skipped(self) -> None:
        backend = self.backend(FakeNvml([h100(0, lost=True), h100(1)]))
        self.assertEqual([d.name for d in backend.discover()], ["gpu:1"])
        self.assertEqual(backend.notes, ["gpu:0 skipped: NVML: GPU is lost"])

    def test_no_gpu(self) -> None:
        nvml = FakeNvml([])
        e = self.assertRaises(BackendUnavailable, self.backend(nvml).discover)
        self.assertEqual(str(e), "cuda: NVML found no usable NVIDIA GPU")
        self.assertTrue(nvml.shut_down)

    def test_sample_devices_it_did_not_discover(self) -> None:
        backend = self.backend(FakeNvml([h100(0), h100(1)]))
        backend.discover()
        other = DeviceRef("cuda", 1, "gpu:1", uuid="GPU-00000001-aaaa-bbbb-cccc-dddddddddddd")
        (m,) = self.successResultOf(backend.sample([other]))
        self.assertEqual(m.power_w, 71.52)

    def test_one_nvml_sample_at_a_time_even_after_a_cancel(self) -> None:
        threads = HeldThreads()
        backend = self.backend(FakeNvml([h100(0)]), to_thread=threads)
        devices = backend.discover()
        first = backend.sample(devices)
        first.cancel()  # the caller's timeout gives up on it; the thread is still busy
        self.failureResultOf(first).trap(Exception)
        self.failureResultOf(backend.sample(devices), ToolError)
        self.assertEqual(len(threads.pending), 1)
        threads.finish()
        second = backend.sample(devices)
        threads.finish()
        self.assertEqual(len(self.successResultOf(second)), 1)

    def test_close_shuts_nvml_down(self) -> None:
        nvml = FakeNvml([h100(0)])
        backend = self.backend(nvml)
        backend.discover()
        backend.close()
        self.assertTrue(nvml.shut_down)


class NvidiaSmiFallbackTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(10)

    def backend(self, tools: FakeTools, load_nvml: Any = no_pynvml) -> CudaBackend:
        return CudaBackend(self.clock, load_nvml=load_nvml, to_thread=inline, **tools.options())

    def test_without_pynvml(self) -> None:
        tools = FakeTools(
            {
                NVIDIA_SMI_QUERY: ok(fixture("nvidia_smi_query_2gpus.csv")),
                NVIDIA_SMI_LIST: ok("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-3f4c)\n"),
            }
        )
        backend = self.backend(tools)
        devices = backend.discover()
        self.assertEqual(backend.source, "nvidia-smi")
        self.assertEqual(backend.notes, ["NVML not loaded: No module named 'pynvml'"])
        self.assertEqual(
            [(d.name, d.memory_total_bytes) for d in devices],
            [("gpu:0", 81025 * MIB), ("gpu:1", 81025 * MIB)],  # used + free: the driver's reserve left out
        )
        self.clock.advance(1)
        first, second = self.successResultOf(backend.sample(devices))
        self.assertEqual((first.sampled_at, first.memory_used_bytes, first.power_w), (11, 1234 * MIB, 71.52))
        self.assertEqual(second.temperature_c, 29.0)

    def test_nvml_that_fails_to_initialise(self) -> None:
        tools = FakeTools(
            {NVIDIA_SMI_QUERY: ok(fixture("nvidia_smi_query_2gpus.csv")), NVIDIA_SMI_LIST: (0, "", "")}
        )
        nvml = FakeNvml([], init_error=FakeNVMLError("Driver Not Loaded"))
        backend = self.backend(tools, load_nvml=lambda: nvml)
        self.assertEqual(len(backend.discover()), 2)
        self.assertEqual(backend.notes, ["NVML not initialised: Driver Not Loaded"])

    def test_mig_in_fallback_reports_no_figures_for_instances(self) -> None:
        tools = FakeTools(
            {
                NVIDIA_SMI_QUERY: ok(fixture("nvidia_smi_query_awkward.csv")),
                NVIDIA_SMI_LIST: ok(fixture("nvidia_smi_list_mig.txt")),
            }
        )
        backend = self.backend(tools)
        devices = backend.discover()
        self.assertEqual([d.name for d in devices], ["gpu:0.0", "gpu:0.1", "gpu:1", "gpu:2"])
        mig, _, gtx, t4 = self.successResultOf(backend.sample(devices))
        self.assertEqual((mig.memory_used_bytes, mig.utilization_pct, mig.stale), (None, None, False))
        self.assertEqual(gtx.memory_used_bytes, 2 * MIB)
        self.assertIsNone(t4.utilization_pct)

    def test_nvidia_smi_missing_too(self) -> None:
        e = self.assertRaises(BackendUnavailable, self.backend(FakeTools()).discover)
        self.assertEqual(
            str(e), "cuda: NVML not loaded: No module named 'pynvml'; nvidia-smi: not found on PATH"
        )

    def test_driver_error(self) -> None:
        tools = FakeTools({NVIDIA_SMI_QUERY: (9, fixture("nvidia_smi_driver_error.txt"), "")})
        e = self.assertRaises(BackendUnavailable, self.backend(tools).discover)
        self.assertIn("nvidia-smi exited with status 9: NVIDIA-SMI has failed", str(e))

    def test_error_text_with_status_zero(self) -> None:
        tools = FakeTools({NVIDIA_SMI_QUERY: ok(fixture("nvidia_smi_driver_error.txt"))})
        e = self.assertRaises(BackendUnavailable, self.backend(tools).discover)
        self.assertIn("nvidia-smi: unexpected output: NVIDIA-SMI has failed", str(e))

    def test_no_devices(self) -> None:
        tools = FakeTools(
            {NVIDIA_SMI_QUERY: ok(fixture("nvidia_smi_no_devices.txt")), NVIDIA_SMI_LIST: ok("")}
        )
        e = self.assertRaises(BackendUnavailable, self.backend(tools).discover)
        self.assertEqual(str(e), "cuda: nvidia-smi lists no GPU")

    def test_failed_or_slow_sample_fails_the_deferred(self) -> None:
        tools = FakeTools(
            {NVIDIA_SMI_QUERY: ok(fixture("nvidia_smi_query_2gpus.csv")), NVIDIA_SMI_LIST: ok("")}
        )
        backend = self.backend(tools)
        devices = backend.discover()
        tools.answers[NVIDIA_SMI_QUERY] = ToolTimeout("nvidia-smi: no answer within 10s; killed")
        self.failureResultOf(backend.sample(devices), ToolTimeout)
        tools.answers[NVIDIA_SMI_QUERY] = ok("garbage\n")
        self.failureResultOf(backend.sample(devices), ValueError)

    def test_gpu_missing_from_a_sample_is_stale(self) -> None:
        tools = FakeTools(
            {NVIDIA_SMI_QUERY: ok(fixture("nvidia_smi_query_2gpus.csv")), NVIDIA_SMI_LIST: ok("")}
        )
        backend = self.backend(tools)
        devices = backend.discover()
        tools.answers[NVIDIA_SMI_QUERY] = ok(fixture("nvidia_smi_query_2gpus.csv").splitlines()[0])
        first, second = self.successResultOf(backend.sample(devices))
        self.assertFalse(first.stale)
        self.assertTrue(second.stale)
        self.assertEqual(second.error, "gpu:1 missing from nvidia-smi output")


class RecordedH200Tests(SynchronousTestCase):
    """What a real H200 host answered (recorded by scripts/gpu-check.sh: driver 580.159.04, CUDA 13.0),
    through NVML and through nvidia-smi, against what a CUDA llama-server saw on the same host."""

    #: ``CUDA0: NVIDIA H200 (143155 MiB, ...)``: the total CUDA reports (cudaMemGetInfo, floored to MiB).
    CUDA_TOTAL_MIB = 143155

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(50)

    def by_nvml(self, **kw: Any) -> CudaBackend:
        backend = CudaBackend(self.clock, load_nvml=lambda: recorded_nvml("nvml_h200.json", **kw), to_thread=inline,
                              **FakeTools().options())
        self.assertTrue(verifyObject(IDeviceBackend, backend))
        return backend

    def by_smi(self) -> CudaBackend:
        tools = FakeTools({NVIDIA_SMI_QUERY: ok(fixture("nvidia_smi_query_h200.csv")),
                           NVIDIA_SMI_LIST: ok(fixture("nvidia_smi_list_h200.txt"))})
        return CudaBackend(self.clock, load_nvml=no_pynvml, **tools.options())

    def test_both_sources_name_the_same_gpu(self) -> None:
        (nvml,), (smi,) = self.by_nvml().discover(), self.by_smi().discover()
        self.assertEqual((nvml.name, nvml.index, nvml.uuid, nvml.model),
                         ("gpu:0", 0, "GPU-67c00e15-5ea1-6819-d1aa-b5cb81b2bf84", "NVIDIA H200"))
        self.assertEqual((smi.name, smi.index, smi.uuid, smi.model), (nvml.name, nvml.index, nvml.uuid, nvml.model))

    def test_the_total_is_what_cuda_can_allocate(self) -> None:
        """nvidia-smi and NVML say 143771 MiB, of which the driver keeps 615 MiB (NVML v2's
        ``reserved``; v1 counts it as used): the agent places models in the 143155 MiB CUDA has."""
        (nvml,), (smi,) = self.by_nvml().discover(), self.by_smi().discover()
        listed = parse_list_devices(fixture("llama_server_list_devices_cuda_h200.txt"))
        self.assertEqual([(d.name, d.total_mib) for d in listed or []], [("CUDA0", self.CUDA_TOTAL_MIB)])
        for total in (nvml.memory_total_bytes, smi.memory_total_bytes):  # nvidia-smi rounds to MiB
            self.assertLessEqual(abs((total or 0) / MIB - self.CUDA_TOTAL_MIB), 1, total)
        self.assertIn("143771,", fixture("nvidia_smi_query_h200.csv"))

    def test_an_old_binding_without_v2_counts_the_reserve_as_used(self) -> None:
        backend = self.by_nvml(v2=False)
        (device,) = backend.discover()
        self.assertEqual(device.memory_total_bytes, 143771 * MIB)
        (sample,) = self.successResultOf(backend.sample([device]))
        self.assertEqual((sample.memory_used_bytes, sample.memory_free_bytes), (644939776, 150109880320))

    def test_a_sample_reads_the_idle_gpu(self) -> None:
        backend = self.by_nvml()
        devices = backend.discover()
        (sample,) = self.successResultOf(backend.sample(devices))
        self.assertEqual((sample.memory_used_bytes, sample.utilization_pct, sample.temperature_c, sample.power_w),
                         (0, 0.0, 36.0, 79.273))
        self.assertEqual(sample.memory_total_bytes, sample.memory_used_bytes + sample.memory_free_bytes)
        (smi,) = self.successResultOf(self.by_smi().sample(self.by_smi().discover()))
        self.assertLess(abs(smi.memory_free_bytes - sample.memory_free_bytes), MIB)
