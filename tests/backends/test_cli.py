"""The CLI backends (rocm, metal, sycl, vulkan): discovery and sample() against recorded tool
answers through fake runners, on a Clock; failures become BackendUnavailable or a failed sample."""

from __future__ import annotations

import os

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from rolemesh.backends import BackendUnavailable
from rolemesh.backends.commands import MIB, ParseError, ToolError, ToolTimeout
from rolemesh.backends.metal import SYSCTL_MEMSIZE, SYSTEM_PROFILER, VM_STAT, MetalBackend
from rolemesh.backends.rocm import (
    AMD_SMI_METRIC,
    AMD_SMI_STATIC,
    ROCM_SMI_DISCOVER,
    ROCM_SMI_METRIC,
    RocmBackend,
)
from rolemesh.backends.sycl import SYCL_LS, XPU_SMI_DISCOVERY, SyclBackend, xpu_smi_device, xpu_smi_dump
from rolemesh.backends.vulkan import VULKANINFO_FULL, VULKANINFO_SUMMARY, VulkanBackend
from rolemesh.base.interfaces import IDeviceBackend
from tests.fixtures.backend_fakes import FakeTools, fixture, ok

GIB = 1024 * MIB


class CliCase(SynchronousTestCase):
    backend_class: type

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(100)

    def backend(self, tools: FakeTools):
        backend = self.backend_class(self.clock, **tools.options())
        self.assertTrue(verifyObject(IDeviceBackend, backend))
        return backend


class RocmTests(CliCase):
    backend_class = RocmBackend

    def test_amd_smi(self) -> None:
        tools = FakeTools(
            {
                AMD_SMI_STATIC: ok(fixture("amd_smi_static_gpu_data.json")),
                AMD_SMI_METRIC: ok(fixture("amd_smi_metric_gpu_data.json")),
            }
        )
        backend = self.backend(tools)
        devices = backend.discover()
        self.assertEqual(
            [(d.name, d.vendor, d.model) for d in devices],
            [("gpu:0", "AMD", "AMD Instinct MI300X"), ("gpu:1", "AMD", "AMD Instinct MI300X")],
        )
        self.assertEqual(devices[0].memory_total_bytes, 196592 * MIB)
        mi300, dead = self.successResultOf(backend.sample(devices))
        self.assertEqual(
            (mi300.memory_free_bytes, mi300.temperature_c, mi300.sampled_at), (196309 * MIB, 41.0, 100)
        )
        self.assertEqual(
            (dead.memory_total_bytes, dead.memory_used_bytes, dead.stale), (196592 * MIB, None, False)
        )
        self.assertEqual(tools.calls, [AMD_SMI_STATIC, AMD_SMI_METRIC])

    def test_amd_smi_broken_falls_back_to_rocm_smi(self) -> None:
        tools = FakeTools(
            {
                AMD_SMI_STATIC: ok(fixture("amd_smi_error.txt")),
                ROCM_SMI_DISCOVER: ok(fixture("rocm_smi_discover.json")),
                ROCM_SMI_METRIC: ok(fixture("rocm_smi.json")),
            }
        )
        backend = self.backend(tools)
        (device,) = backend.discover()
        self.assertEqual(
            (device.name, device.model, device.uuid), ("gpu:0", "Radeon RX 7900 XTX", "0x4a7b9c1d2e3f4051")
        )
        (m,) = self.successResultOf(backend.sample([device]))
        self.assertEqual((m.memory_used_bytes, m.utilization_pct), (1073741824, 12.0))
        self.assertEqual(m.memory_free_bytes, 17163091968 - 1073741824)

    def test_neither_tool(self) -> None:
        e = self.assertRaises(BackendUnavailable, self.backend(FakeTools()).discover)
        self.assertEqual(str(e), "rocm: amd-smi: not found on PATH; rocm-smi: not found on PATH")

    def test_no_gpu_listed(self) -> None:
        tools = FakeTools({AMD_SMI_STATIC: ok('{"gpu_data": []}'), ROCM_SMI_DISCOVER: ok("{}")})
        e = self.assertRaises(BackendUnavailable, self.backend(tools).discover)
        self.assertEqual(str(e), "rocm: amd-smi lists no GPU; rocm-smi lists no GPU")

    def test_failed_sample(self) -> None:
        tools = FakeTools(
            {
                AMD_SMI_STATIC: ok(fixture("amd_smi_static_list.json")),
                AMD_SMI_METRIC: (1, "", "AMD SMI not initialized\n"),
            }
        )
        backend = self.backend(tools)
        failure = self.failureResultOf(backend.sample(backend.discover()), ToolError)
        self.assertEqual(str(failure.value), "amd-smi exited with status 1: AMD SMI not initialized")


class MetalTests(CliCase):
    backend_class = MetalBackend

    def test_apple_silicon(self) -> None:
        tools = FakeTools(
            {
                SYSTEM_PROFILER: ok(fixture("system_profiler_apple_m2.json")),
                SYSCTL_MEMSIZE: ok(fixture("sysctl_memsize.txt")),
                VM_STAT: ok(fixture("vm_stat.txt")),
            }
        )
        backend = self.backend(tools)
        (device,) = backend.discover()
        self.assertEqual(
            (device.name, device.vendor, device.model, device.memory_total_bytes),
            ("gpu:0", "Apple", "Apple M2 Max", 64 * GIB),
        )
        (m,) = self.successResultOf(backend.sample([device]))
        free = (93212 + 890325) * 16384
        self.assertEqual((m.memory_free_bytes, m.memory_used_bytes), (free, 64 * GIB - free))
        self.assertIsNone(m.utilization_pct)
        self.assertEqual(backend.child_environment(device, {"A": "1"}), {"A": "1"})

    def test_intel_mac_discrete_gpu_reports_its_total_only(self) -> None:
        tools = FakeTools({SYSTEM_PROFILER: ok(fixture("system_profiler_intel_mac.json"))})
        backend = self.backend(tools)
        (device,) = backend.discover()
        self.assertEqual((device.model, device.memory_total_bytes), ("AMD Radeon Pro 5500M", 8 * GIB))
        (m,) = self.successResultOf(backend.sample([device]))
        self.assertEqual((m.memory_total_bytes, m.memory_free_bytes), (8 * GIB, None))
        self.assertNotIn(VM_STAT, tools.calls)

    def test_not_a_mac(self) -> None:
        e = self.assertRaises(BackendUnavailable, self.backend(FakeTools()).discover)
        self.assertEqual(str(e), "metal: system_profiler: not found on PATH")

    def test_no_gpu_and_garbage(self) -> None:
        tools = FakeTools({SYSTEM_PROFILER: ok(fixture("system_profiler_empty.json"))})
        self.assertRaises(BackendUnavailable, self.backend(tools).discover)
        tools = FakeTools({SYSTEM_PROFILER: ok(fixture("garbage.txt"))})
        self.assertRaises(BackendUnavailable, self.backend(tools).discover)

    def test_bad_vm_stat_fails_the_sample(self) -> None:
        tools = FakeTools(
            {
                SYSTEM_PROFILER: ok(fixture("system_profiler_apple_m2.json")),
                SYSCTL_MEMSIZE: ok("68719476736\n"),
                VM_STAT: ok(""),
            }
        )
        backend = self.backend(tools)
        self.failureResultOf(backend.sample(backend.discover()), ParseError)


class SyclTests(CliCase):
    backend_class = SyclBackend

    def full_tools(self) -> FakeTools:
        device0 = fixture("xpu_smi_discovery_device0.json")
        return FakeTools(
            {
                SYCL_LS: ok(fixture("sycl_ls.txt")),
                XPU_SMI_DISCOVERY: ok(fixture("xpu_smi_discovery.json")),
                tuple(xpu_smi_device(0)): ok(device0),
                tuple(xpu_smi_device(1)): ok(device0.replace('"device_id": 0', '"device_id": 1')),
                tuple(xpu_smi_dump([0, 1])): ok(fixture("xpu_smi_dump.csv")),
            }
        )

    def test_with_xpu_smi(self) -> None:
        tools = self.full_tools()
        backend = self.backend(tools)
        devices = backend.discover()
        self.assertEqual(
            [(d.name, d.index, d.vendor) for d in devices], [("gpu:0", 0, "Intel"), ("gpu:1", 1, "Intel")]
        )
        self.assertEqual(devices[0].model, "Intel(R) Data Center GPU Max 1550")
        self.assertEqual(devices[0].memory_total_bytes, 137438953472)
        self.assertEqual(devices[1].uuid, "01000000-0000-0000-0000-00003a000000")
        first, second = self.successResultOf(backend.sample(devices))
        self.assertEqual(
            (first.memory_used_bytes, first.memory_free_bytes), (2048 * MIB, 137438953472 - 2048 * MIB)
        )
        self.assertEqual((first.utilization_pct, first.power_w, first.temperature_c), (12.5, 214.61, 39.5))
        self.assertIsNone(second.utilization_pct)

    def test_sycl_ls_runs_without_the_inherited_selector(self) -> None:
        tools = self.full_tools()
        self.patch(os, "environ", {"ONEAPI_DEVICE_SELECTOR": "level_zero:1", "PATH": "/bin"})
        self.backend(tools).discover()
        self.assertEqual(tools.envs[0], {"PATH": "/bin"})

    def test_without_xpu_smi(self) -> None:
        tools = FakeTools({SYCL_LS: ok(fixture("sycl_ls_old.txt"))})
        backend = self.backend(tools)
        devices = backend.discover()
        self.assertEqual(
            [(d.name, d.model) for d in devices],
            [("gpu:0", "Intel(R) Arc(TM) A770 Graphics"), ("gpu:1", "Intel(R) UHD Graphics 770")],
        )
        self.assertEqual(backend.notes, ["xpu-smi is not on PATH: no memory figures"])
        (m, _) = self.successResultOf(backend.sample(devices))
        self.assertEqual((m.memory_used_bytes, m.stale), (None, False))

    def test_counts_that_disagree_are_not_matched(self) -> None:
        tools = FakeTools(
            {
                SYCL_LS: ok(fixture("sycl_ls_old.txt")),
                XPU_SMI_DISCOVERY: ok('{"device_list": [{"device_id": 0, "device_name": "A770"}]}'),
            }
        )
        backend = self.backend(tools)
        devices = backend.discover()
        self.assertEqual({d.memory_total_bytes for d in devices}, {None})
        self.assertIn("xpu-smi lists 1 GPUs, sycl-ls 2", backend.notes[0])

    def test_no_level_zero_gpu(self) -> None:
        tools = FakeTools({SYCL_LS: ok(fixture("sycl_ls_cpu_only.txt"))})
        e = self.assertRaises(BackendUnavailable, self.backend(tools).discover)
        self.assertEqual(str(e), "sycl: sycl-ls lists no Level Zero GPU")

    def test_sycl_ls_missing_or_broken(self) -> None:
        e = self.assertRaises(BackendUnavailable, self.backend(FakeTools()).discover)
        self.assertEqual(str(e), "sycl: sycl-ls: not found on PATH")
        tools = FakeTools(
            {SYCL_LS: (127, "", "sycl-ls: error while loading shared libraries: libsycl.so.7\n")}
        )
        e = self.assertRaises(BackendUnavailable, self.backend(tools).discover)
        self.assertIn("libsycl.so.7", str(e))

    def test_slow_dump_fails_the_sample(self) -> None:
        tools = self.full_tools()
        backend = self.backend(tools)
        devices = backend.discover()
        tools.answers[tuple(xpu_smi_dump([0, 1]))] = ToolTimeout("xpu-smi: no answer within 10s; killed")
        self.failureResultOf(backend.sample(devices), ToolTimeout)


class VulkanTests(CliCase):
    backend_class = VulkanBackend

    def test_hardware_devices_with_budget(self) -> None:
        tools = FakeTools(
            {
                VULKANINFO_SUMMARY: ok(fixture("vulkaninfo_summary_multi.txt")),
                VULKANINFO_FULL: ok(fixture("vulkaninfo_full_budget.txt")),
            }
        )
        backend = self.backend(tools)
        devices = backend.discover()
        self.assertEqual(
            [(d.name, d.vendor, d.model) for d in devices],
            [("gpu:0", "NVIDIA", "NVIDIA GeForce RTX 4090"), ("gpu:1", "Intel", "Intel(R) Graphics (RPL-S)")],
        )
        self.assertEqual(len(backend.notes), 2)
        total = 24 * GIB - 512 * MIB + 246 * MIB
        self.assertEqual(devices[0].memory_total_bytes, total)
        discrete, integrated = self.successResultOf(backend.sample(devices))
        self.assertEqual(
            (discrete.memory_free_bytes, discrete.memory_used_bytes),
            (20 * GIB + 200 * MIB, total - 20 * GIB - 200 * MIB),
        )
        self.assertEqual((integrated.memory_total_bytes, integrated.memory_free_bytes), (16 * GIB, None))

    def test_only_llvmpipe_is_unavailable(self) -> None:
        tools = FakeTools({VULKANINFO_SUMMARY: ok(fixture("vulkaninfo_summary_llvmpipe.txt"))})
        e = self.assertRaises(BackendUnavailable, self.backend(tools).discover)
        self.assertEqual(
            str(e), "vulkan: only software devices found (llvmpipe (LLVM 15.0.6, 256 bits)); use backend: cpu"
        )

    def test_no_driver(self) -> None:
        tools = FakeTools({VULKANINFO_SUMMARY: (1, fixture("vulkaninfo_no_driver.txt"), "")})
        e = self.assertRaises(BackendUnavailable, self.backend(tools).discover)
        self.assertIn("vkCreateInstance: Found no drivers!", str(e))

    def test_memory_figures_are_optional(self) -> None:
        tools = FakeTools(
            {
                VULKANINFO_SUMMARY: ok(fixture("vulkaninfo_summary_multi.txt")),
                VULKANINFO_FULL: (1, "", "vkEnumeratePhysicalDevices failed\n"),
            }
        )
        backend = self.backend(tools)
        devices = backend.discover()
        self.assertEqual({d.memory_total_bytes for d in devices}, {None})
        self.assertIn("no memory figures", backend.notes[-1])
        self.failureResultOf(backend.sample(devices), ToolError)
