"""Device backends: every parser on its recorded outputs, every provider against IDeviceBackend,
each backend's pin environment, backend auto-detection and the ``devices`` allow-list."""

from __future__ import annotations

import os
import string

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from rolemesh.backends import commands
from rolemesh.backends.commands import MIB, ParseError, Reading, ToolError
from rolemesh.backends.cpu import CpuBackend
from rolemesh.backends.cuda import (
    CudaBackend,
    devices_from_smi,
    is_mig,
    parse_nvidia_smi_csv,
    parse_nvidia_smi_list,
)
from rolemesh.backends.detect import (
    BACKEND_NAMES,
    filter_devices,
    is_accelerator,
    make_backend,
    scan_pci,
    select_backend,
)
from rolemesh.backends.metal import (
    MetalBackend,
    available_bytes,
    parse_memsize,
    parse_system_profiler,
    parse_vm_stat,
    pick_gpu,
)
from rolemesh.backends.rocm import (
    RocmBackend,
    amd_bytes,
    parse_amd_smi_metric,
    parse_amd_smi_static,
    parse_rocm_smi,
)
from rolemesh.backends.sycl import (
    SyclBackend,
    level_zero_gpus,
    parse_sycl_ls,
    parse_xpu_discovery,
    parse_xpu_dump,
)
from rolemesh.backends.vulkan import (
    VulkanBackend,
    heap_totals,
    parse_vulkan_heaps,
    parse_vulkaninfo_summary,
    usable_devices,
)
from rolemesh.base.devices import DeviceRef
from rolemesh.base.errors import ConfigError
from rolemesh.base.interfaces import IDeviceBackend
from tests.fixtures.backend_fakes import FakeTools, fixture

GIB = 1024 * MIB


class NvidiaSmiParserTests(SynchronousTestCase):
    def test_two_gpus(self) -> None:
        readings = parse_nvidia_smi_csv(fixture("nvidia_smi_query_2gpus.csv"))
        self.assertEqual([r.index for r in readings], [0, 1])
        first = readings[0]
        self.assertEqual(first.uuid, "GPU-3f4c3c2e-8b1a-4c7e-9d55-0a1b2c3d4e5f")
        self.assertEqual(first.name, "NVIDIA H100 80GB HBM3")
        # what CUDA can allocate: used + free, without the 534 MiB the driver keeps of its 81559 MiB
        self.assertEqual(first.memory_total_bytes, (1234 + 79791) * MIB)
        self.assertEqual(first.memory_used_bytes, 1234 * MIB)
        self.assertEqual(first.memory_free_bytes, 79791 * MIB)
        self.assertEqual((first.utilization_pct, first.temperature_c, first.power_w), (17.0, 34.0, 71.52))

    def test_not_available_fields_are_none(self) -> None:
        a100, gtx, t4 = parse_nvidia_smi_csv(fixture("nvidia_smi_query_awkward.csv"))
        self.assertIsNone(a100.memory_used_bytes)
        self.assertIsNone(a100.utilization_pct)
        self.assertEqual(a100.power_w, 57.03)
        self.assertIsNone(gtx.power_w)  # [Not Supported]
        self.assertIsNone(t4.utilization_pct)  # [Unknown Error]
        self.assertIsNone(t4.temperature_c)
        self.assertEqual(t4.memory_free_bytes, 14912 * MIB)

    def test_name_with_a_comma(self) -> None:
        (r,) = parse_nvidia_smi_csv("3, [N/A], Quadro RTX 8000, rev B, 48601, 1, 48600, 0, 30, 20.5\n")
        self.assertEqual((r.index, r.name, r.power_w), (3, "Quadro RTX 8000, rev B", 20.5))
        self.assertIsNone(r.uuid)

    def test_no_devices_is_an_empty_list(self) -> None:
        self.assertEqual(parse_nvidia_smi_csv(fixture("nvidia_smi_no_devices.txt")), [])
        self.assertEqual(parse_nvidia_smi_csv(fixture("empty.txt")), [])

    def test_error_text_with_status_zero_is_a_parse_error(self) -> None:
        e = self.assertRaises(ParseError, parse_nvidia_smi_csv, fixture("nvidia_smi_driver_error.txt"))
        self.assertIn("couldn't communicate with the NVIDIA driver", str(e))
        self.assertNotIn("\n", str(e))
        self.assertRaises(ParseError, parse_nvidia_smi_csv, fixture("garbage.txt"))

    def test_garbage_lines_around_rows_are_skipped(self) -> None:
        text = "WARNING: infoROM is corrupted at gpu 0000:01:00.0\n" + fixture("nvidia_smi_query_2gpus.csv")
        self.assertEqual(len(parse_nvidia_smi_csv(text)), 2)

    def test_mig_listing(self) -> None:
        migs = parse_nvidia_smi_list(fixture("nvidia_smi_list_mig.txt"))
        self.assertEqual(
            [(m.parent_index, m.index, m.profile) for m in migs], [(0, 0, "3g.20gb"), (0, 1, "2g.10gb")]
        )
        self.assertEqual(migs[0].uuid, "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f")
        self.assertEqual(migs[0].parent_model, "NVIDIA A100-SXM4-40GB")
        self.assertEqual(parse_nvidia_smi_list(fixture("garbage.txt")), [])

    def test_devices_from_smi_replace_a_mig_gpu_by_its_instances(self) -> None:
        readings = parse_nvidia_smi_csv(fixture("nvidia_smi_query_awkward.csv"))
        devices = devices_from_smi(readings, parse_nvidia_smi_list(fixture("nvidia_smi_list_mig.txt")))
        self.assertEqual([d.name for d in devices], ["gpu:0.0", "gpu:0.1", "gpu:1", "gpu:2"])
        self.assertTrue(is_mig(devices[0]))
        self.assertFalse(is_mig(devices[2]))
        self.assertEqual(devices[0].model, "NVIDIA A100-SXM4-40GB MIG 3g.20gb")
        self.assertEqual(devices[2].memory_total_bytes, (2 + 11003) * MIB)  # used + free
        self.assertEqual(readings[0].memory_total_bytes, 40960 * MIB)  # used and free unknown: the total
        self.assertEqual({d.vendor for d in devices}, {"NVIDIA"})


class AmdParserTests(SynchronousTestCase):
    def test_static_gpu_data_form(self) -> None:
        readings = parse_amd_smi_static(fixture("amd_smi_static_gpu_data.json"))
        self.assertEqual([r.index for r in readings], [0, 1])
        self.assertEqual(readings[0].name, "AMD Instinct MI300X")
        self.assertEqual(readings[0].memory_total_bytes, 196592 * MIB)

    def test_static_older_list_form(self) -> None:
        (r,) = parse_amd_smi_static(fixture("amd_smi_static_list.json"))
        self.assertEqual(
            (r.index, r.name, r.memory_total_bytes), (0, "Navi 31 [Radeon RX 7900 XT/7900 XTX]", 24560 * MIB)
        )

    def test_metric_gpu_data_form_with_not_available(self) -> None:
        mi300, dead = parse_amd_smi_metric(fixture("amd_smi_metric_gpu_data.json"))
        self.assertEqual(mi300.memory_total_bytes, 196592 * MIB)
        self.assertEqual(mi300.memory_used_bytes, 283 * MIB)
        self.assertEqual(mi300.memory_free_bytes, 196309 * MIB)
        self.assertEqual(mi300.utilization_pct, 37.0)
        self.assertEqual(mi300.temperature_c, 41.0)  # edge is N/A: hotspot
        self.assertEqual(mi300.power_w, 239.0)
        self.assertEqual(dead, Reading(index=1))

    def test_metric_list_form(self) -> None:
        (r,) = parse_amd_smi_metric(fixture("amd_smi_metric_list.json"))
        self.assertEqual((r.temperature_c, r.power_w, r.utilization_pct), (45.0, 22.0, 2.0))
        self.assertIsNone(r.memory_free_bytes)

    def test_error_text_and_garbage(self) -> None:
        e = self.assertRaises(ParseError, parse_amd_smi_metric, fixture("amd_smi_error.txt"))
        self.assertIn("AMDSMI_STATUS_DRM_ERROR", str(e))
        self.assertRaises(ParseError, parse_amd_smi_static, fixture("garbage.txt"))
        self.assertRaises(ParseError, parse_amd_smi_static, fixture("empty.txt"))
        self.assertRaises(ParseError, parse_amd_smi_static, '"just a string"')

    def test_empty_list(self) -> None:
        self.assertEqual(parse_amd_smi_static("[]"), [])
        self.assertEqual(parse_amd_smi_metric('{"gpu_data": []}'), [])

    def test_amd_bytes_units(self) -> None:
        self.assertEqual(amd_bytes({"value": 2, "unit": "GB"}), 2 * GIB)
        self.assertEqual(amd_bytes({"value": 512, "unit": "B"}), 512)
        self.assertEqual(amd_bytes(16), 16 * MIB)
        self.assertIsNone(amd_bytes("N/A"))

    def test_rocm_smi_with_a_warning_line_first(self) -> None:
        card0, card1 = parse_rocm_smi(fixture("rocm_smi.json"))
        self.assertEqual(card0.memory_total_bytes, 17163091968)
        self.assertEqual(card0.memory_used_bytes, 1073741824)
        self.assertEqual((card0.utilization_pct, card0.temperature_c, card0.power_w), (12.0, 35.0, 41.0))
        self.assertEqual(card1.temperature_c, 61.0)  # edge N/A: junction
        self.assertIsNone(card1.power_w)

    def test_rocm_smi_discovery_fields(self) -> None:
        (card,) = parse_rocm_smi(fixture("rocm_smi_discover.json"))
        self.assertEqual(card.name, "Radeon RX 7900 XTX")
        self.assertEqual(card.uuid, "0x4a7b9c1d2e3f4051")

    def test_rocm_smi_empty_and_garbage(self) -> None:
        self.assertEqual(parse_rocm_smi(fixture("rocm_smi_empty.json")), [])
        self.assertRaises(ParseError, parse_rocm_smi, fixture("garbage.txt"))
        self.assertRaises(ParseError, parse_rocm_smi, "[1, 2]")


class MetalParserTests(SynchronousTestCase):
    def test_apple_silicon_is_unified(self) -> None:
        (gpu,) = parse_system_profiler(fixture("system_profiler_apple_m2.json"))
        self.assertEqual((gpu.model, gpu.vendor, gpu.cores, gpu.unified), ("Apple M2 Max", "Apple", 38, True))

    def test_intel_mac_picks_the_discrete_gpu(self) -> None:
        gpus = parse_system_profiler(fixture("system_profiler_intel_mac.json"))
        self.assertEqual([g.vendor for g in gpus], ["Intel", "AMD"])
        gpu = pick_gpu(gpus)
        assert gpu is not None
        self.assertEqual((gpu.model, gpu.vram_bytes, gpu.unified), ("AMD Radeon Pro 5500M", 8 * GIB, False))

    def test_empty_and_garbage(self) -> None:
        self.assertEqual(parse_system_profiler(fixture("system_profiler_empty.json")), [])
        self.assertIsNone(pick_gpu([]))
        self.assertRaises(ParseError, parse_system_profiler, fixture("garbage.txt"))
        self.assertRaises(ParseError, parse_system_profiler, '{"SPSoftwareDataType": []}')

    def test_memsize(self) -> None:
        self.assertEqual(parse_memsize(fixture("sysctl_memsize.txt")), 64 * GIB)
        e = self.assertRaises(ParseError, parse_memsize, "sysctl: unknown oid 'hw.memsize'\n")
        self.assertIn("unknown oid", str(e))

    def test_vm_stat(self) -> None:
        pages = parse_vm_stat(fixture("vm_stat.txt"))
        self.assertEqual(pages["free"], 93212 * 16384)
        self.assertEqual(available_bytes(pages), (93212 + 890325) * 16384)
        self.assertRaises(ParseError, parse_vm_stat, fixture("garbage.txt"))
        self.assertIsNone(available_bytes({}))


class SyclParserTests(SynchronousTestCase):
    def test_current_format(self) -> None:
        devices = parse_sycl_ls(fixture("sycl_ls.txt"))
        self.assertEqual(len(devices), 5)
        gpus = level_zero_gpus(devices)
        self.assertEqual(
            [(g.index, g.name) for g in gpus],
            [(0, "Intel(R) Data Center GPU Max 1550")] * 1 + [(1, "Intel(R) Data Center GPU Max 1550")],
        )
        self.assertEqual(gpus[0].platform, "Intel(R) oneAPI Unified Runtime over Level-Zero")

    def test_older_format_with_warnings(self) -> None:
        gpus = level_zero_gpus(parse_sycl_ls(fixture("sycl_ls_old.txt")))
        self.assertEqual(
            [(g.index, g.name) for g in gpus],
            [(0, "Intel(R) Arc(TM) A770 Graphics"), (1, "Intel(R) UHD Graphics 770")],
        )

    def test_no_gpu_empty_and_garbage(self) -> None:
        self.assertEqual(level_zero_gpus(parse_sycl_ls(fixture("sycl_ls_cpu_only.txt"))), [])
        self.assertEqual(parse_sycl_ls(fixture("empty.txt")), [])
        self.assertRaises(ParseError, parse_sycl_ls, fixture("garbage.txt"))

    def test_xpu_smi_discovery(self) -> None:
        listed = parse_xpu_discovery(fixture("xpu_smi_discovery.json"))
        self.assertEqual(
            [(r.index, r.uuid) for r in listed],
            [(0, "01000000-0000-0000-0000-000029000000"), (1, "01000000-0000-0000-0000-00003a000000")],
        )
        (one,) = parse_xpu_discovery(fixture("xpu_smi_discovery_device0.json"))
        self.assertEqual(one.memory_total_bytes, 137438953472)
        self.assertEqual(one.memory_free_bytes, 136702181376)
        self.assertRaises(ParseError, parse_xpu_discovery, fixture("xpu_smi_error.txt"))

    def test_xpu_smi_dump(self) -> None:
        first, second = parse_xpu_dump(fixture("xpu_smi_dump.csv"))
        self.assertEqual(
            first,
            Reading(
                index=0,
                memory_used_bytes=2048 * MIB,
                utilization_pct=12.5,
                temperature_c=39.5,
                power_w=214.61,
            ),
        )
        self.assertIsNone(second.utilization_pct)
        self.assertIsNone(second.temperature_c)
        self.assertEqual(second.memory_used_bytes, round(27.05 * MIB))
        self.assertEqual(parse_xpu_dump(""), [])
        self.assertRaises(ParseError, parse_xpu_dump, fixture("xpu_smi_error.txt"))


class VulkanParserTests(SynchronousTestCase):
    def test_recorded_llvmpipe_summary(self) -> None:
        (device,) = parse_vulkaninfo_summary(fixture("vulkaninfo_summary_llvmpipe.txt"))
        self.assertEqual(device.name, "llvmpipe (LLVM 15.0.6, 256 bits)")
        self.assertTrue(device.software)
        self.assertEqual(device.vendor, "Mesa")
        self.assertEqual(usable_devices([device])[0], [])

    def test_several_devices_skip_software_and_duplicates(self) -> None:
        listed = parse_vulkaninfo_summary(fixture("vulkaninfo_summary_multi.txt"))
        self.assertEqual([d.index for d in listed], [0, 1, 2, 3])
        chosen, notes = usable_devices(listed)
        self.assertEqual([(d.index, d.vendor) for d in chosen], [(0, "NVIDIA"), (1, "Intel")])
        self.assertEqual(len(notes), 2)
        self.assertIn("software", notes[0])
        self.assertIn("GPU3 (NVIDIA GeForce RTX 4090 (NVK AD102)) is GPU0 again", notes[1])

    def test_error_output_and_garbage(self) -> None:
        self.assertRaises(ParseError, parse_vulkaninfo_summary, fixture("vulkaninfo_no_driver.txt"))
        self.assertRaises(ParseError, parse_vulkaninfo_summary, fixture("garbage.txt"))
        self.assertEqual(parse_vulkaninfo_summary(""), [])

    def test_recorded_llvmpipe_heaps(self) -> None:
        heaps = parse_vulkan_heaps(fixture("vulkaninfo_full_llvmpipe.txt"))
        self.assertEqual(list(heaps), [0])
        (heap,) = heaps[0]
        self.assertEqual((heap.size, heap.device_local, heap.budget), (2 * GIB, True, None))
        self.assertEqual(heap_totals(heaps[0]), (2 * GIB, None))

    def test_heaps_with_memory_budget(self) -> None:
        heaps = parse_vulkan_heaps(fixture("vulkaninfo_full_budget.txt"))
        self.assertEqual([len(heaps[0]), len(heaps[1])], [3, 1])
        self.assertEqual([h.device_local for h in heaps[0]], [True, False, True])
        total, free = heap_totals(heaps[0])
        self.assertEqual(total, 24 * GIB - 512 * MIB + 246 * MIB)
        self.assertEqual(free, 20 * GIB + 200 * MIB)
        self.assertEqual(heap_totals(heaps[1]), (16 * GIB, None))
        self.assertEqual(heap_totals([]), (None, None))


class SharedHelperTests(SynchronousTestCase):
    def test_number(self) -> None:
        for text, value in (
            ("12.5", 12.5),
            (" 7 ", 7.0),
            ("35.0 C", 35.0),
            ({"value": 3, "unit": "%"}, 3.0),
            (4, 4.0),
            ("-1", -1.0),
            ("1e3", 1000.0),
        ):
            self.assertEqual(commands.number(text), value)
        for text in (
            "[N/A]",
            "N/A",
            "",
            "[Not Supported]",
            None,
            True,
            {"unit": "W"},
            "Unknown",
            "1e999",
            float("nan"),
        ):
            self.assertIsNone(commands.number(text))

    @given(st.text(alphabet=string.printable, max_size=40))
    def test_number_never_raises(self, text: str) -> None:
        value = commands.number(text)
        self.assertTrue(value is None or isinstance(value, float))

    @given(st.text(alphabet=string.printable + "[]\u00e9", max_size=400))
    def test_parsers_fail_only_with_parse_error(self, text: str) -> None:
        for parse in (
            parse_nvidia_smi_csv,
            parse_nvidia_smi_list,
            parse_amd_smi_metric,
            parse_rocm_smi,
            parse_sycl_ls,
            parse_xpu_dump,
            parse_vulkaninfo_summary,
            parse_vulkan_heaps,
            parse_system_profiler,
            parse_vm_stat,
        ):
            try:
                parse(text)
            except ParseError:
                pass

    def test_absurd_figures_are_unknown(self) -> None:
        self.assertEqual(parse_amd_smi_metric('[{"gpu": 1e999}]'), [])
        (r,) = parse_amd_smi_metric('[{"gpu": 0, "mem_usage": {"total_vram": 1e999, "used_vram": NaN}}]')
        self.assertEqual(r, Reading(index=0))

    def test_load_json_reports_the_first_line(self) -> None:
        e = self.assertRaises(ParseError, commands.load_json, "\n\nboom: no json here\n", "tool")
        self.assertEqual(str(e), "tool: expected JSON, got: boom: no json here")
        self.assertEqual(commands.load_json('warning {"a": 1} trailing', "tool"), {"a": 1})

    def test_checked(self) -> None:
        self.assertEqual(commands.checked("t", (0, "out", "")), "out")
        e = self.assertRaises(ToolError, commands.checked, "t", (6, "No devices were found\n", ""))
        self.assertEqual(str(e), "t exited with status 6: No devices were found")

    def test_reading_derives_used_or_free_from_the_total(self) -> None:
        device = DeviceRef(backend="x", index=0, name="gpu:0", memory_total_bytes=100)
        m = Reading(index=0, memory_used_bytes=30).metrics(device, 5.0)
        self.assertEqual((m.memory_total_bytes, m.memory_used_bytes, m.memory_free_bytes), (100, 30, 70))
        m = Reading(index=0, memory_free_bytes=90).metrics(device, 5.0)
        self.assertEqual(m.memory_used_bytes, 10)
        self.assertEqual(m.sampled_at, 5.0)

    def test_match_readings_marks_missing_devices_stale(self) -> None:
        devices = [DeviceRef("x", 0, "gpu:0", uuid="U0"), DeviceRef("x", 1, "gpu:1", memory_total_bytes=7)]
        out = commands.match_readings(devices, [Reading(index=5, uuid="U0", power_w=1.0)], 2.0, "tool")
        self.assertEqual(out[0].power_w, 1.0)  # matched by uuid, not index
        self.assertTrue(out[1].stale)
        self.assertEqual(out[1].error, "gpu:1 missing from tool output")
        self.assertEqual(out[1].memory_total_bytes, 7)


def all_backends() -> list:
    tools = FakeTools()
    return [
        CpuBackend(),
        CudaBackend(**tools.options()),
        RocmBackend(**tools.options()),
        MetalBackend(**tools.options()),
        SyclBackend(**tools.options()),
        VulkanBackend(**tools.options()),
    ]


class ProviderTests(SynchronousTestCase):
    def test_every_backend_provides_the_interface(self) -> None:
        backends = all_backends()
        self.assertEqual(sorted(b.name for b in backends), sorted(BACKEND_NAMES))
        for backend in backends:
            self.assertTrue(verifyObject(IDeviceBackend, backend))

    def test_make_backend_builds_each_provider(self) -> None:
        for name in BACKEND_NAMES:
            backend = make_backend(name)
            self.assertEqual(backend.name, name)
            self.assertTrue(verifyObject(IDeviceBackend, backend))

    def test_make_backend_passes_cpu_devices_and_options(self) -> None:
        backend = make_backend("cpu", cpu_devices=2, allowed_cores=lambda: [0, 1, 2, 3])
        self.assertEqual([d.cpus for d in backend.discover()], [(0, 1), (2, 3)])
        tools = FakeTools()
        self.assertEqual(make_backend("rocm", cpu_devices=2, **tools.options())._which, tools.which)

    def test_make_backend_rejects_unknown_names(self) -> None:
        e = self.assertRaises(ConfigError, make_backend, "tpu")
        self.assertIn("'tpu'", str(e))
        self.assertRaises(ConfigError, make_backend, "auto")


class PinEnvironmentTests(SynchronousTestCase):
    base = {"PATH": "/usr/bin", "HOME": "/home/agent", "CUDA_VISIBLE_DEVICES": "7", "GPU_DEVICE_ORDINAL": "3"}

    def pinned(self, backend, device: DeviceRef) -> dict:
        before = dict(self.base)
        env = backend.child_environment(device, self.base)
        self.assertEqual(self.base, before, "the parent's environment was changed")
        self.assertIsNot(env, self.base)
        self.assertEqual(env["PATH"], "/usr/bin")
        self.assertEqual(env["HOME"], "/home/agent")
        return env

    def test_cuda(self) -> None:
        tools = FakeTools()
        cuda = CudaBackend(**tools.options())
        env = self.pinned(cuda, DeviceRef("cuda", 2, "gpu:2", uuid="GPU-abc"))
        self.assertEqual((env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"]), ("2", "PCI_BUS_ID"))
        env = self.pinned(cuda, DeviceRef("cuda", 0, "gpu:0.1", uuid="MIG-c6d4f1ef"))
        self.assertEqual(env["CUDA_VISIBLE_DEVICES"], "MIG-c6d4f1ef")
        self.assertEqual(cuda.child_arguments(DeviceRef("cuda", 2, "gpu:2")), {})

    def test_rocm_pins_with_rocr_and_drops_relative_indices(self) -> None:
        env = self.pinned(RocmBackend(), DeviceRef("rocm", 3, "gpu:3"))
        self.assertEqual((env["ROCR_VISIBLE_DEVICES"], env["HIP_VISIBLE_DEVICES"]), ("3", "0"))
        self.assertNotIn("CUDA_VISIBLE_DEVICES", env)
        self.assertNotIn("GPU_DEVICE_ORDINAL", env)

    def test_sycl(self) -> None:
        env = self.pinned(SyclBackend(), DeviceRef("sycl", 1, "gpu:1"))
        self.assertEqual(env["ONEAPI_DEVICE_SELECTOR"], "level_zero:1")

    def test_vulkan(self) -> None:
        env = self.pinned(VulkanBackend(), DeviceRef("vulkan", 2, "gpu:2"))
        self.assertEqual(env["GGML_VK_VISIBLE_DEVICES"], "2")

    def test_metal_adds_nothing(self) -> None:
        self.assertEqual(self.pinned(MetalBackend(), DeviceRef("metal", 0, "gpu:0")), self.base)

    def test_cpu_hides_nvidia_gpus(self) -> None:
        """A CUDA build given ``--device none`` still opens a CUDA context on GPU 0 (measured on an H200)."""
        pinned = self.pinned(CpuBackend(), DeviceRef("cpu", 0, "cpu:0", cpus=(0, 1)))
        self.assertEqual(pinned, {**self.base, "CUDA_VISIBLE_DEVICES": ""})

    def test_no_backend_gives_an_empty_environment(self) -> None:
        device = DeviceRef("x", 0, "gpu:0", cpus=(0,))
        for backend in all_backends():
            self.assertTrue(backend.child_environment(device, self.base))


def pci_tree(root: str, functions: dict) -> str:
    """A fake ``<root>/bus/pci/devices`` with ``{address: (vendor, class)}``."""
    for address, (vendor, pci_class) in functions.items():
        path = os.path.join(root, "bus", "pci", "devices", address)
        os.makedirs(path)
        with open(os.path.join(path, "vendor"), "w") as f:
            f.write(f"0x{vendor:04x}\n")
        with open(os.path.join(path, "class"), "w") as f:
            f.write(f"0x{pci_class:06x}\n")
    return root


HOST_BRIDGE = ("0000:00:00.0", (0x1022, 0x060000))
ASPEED_VGA = ("0000:02:00.0", (0x1A03, 0x030000))


class SelectBackendTests(SynchronousTestCase):
    def sysfs(self, *functions) -> str:
        return pci_tree(self.mktemp(), dict([HOST_BRIDGE, ASPEED_VGA, *functions]))

    def select(self, root: str, tools=(), libraries=(), platform="linux", run=None):
        fake = FakeTools(on_path=tools)
        return select_backend(
            "auto",
            sysfs_root=root,
            which=fake.which,
            platform=platform,
            run=run or fake.run_sync,
            find_library=lambda name: f"lib{name}.so.1" if name in libraries else None,
        )

    def test_nvidia_gpu(self) -> None:
        root = self.sysfs(("0000:01:00.0", (0x10DE, 0x030200)), ("0000:01:00.1", (0x10DE, 0x040300)))
        self.assertEqual(
            self.select(root, tools=["nvidia-smi"]),
            ("cuda", "PCI vendor 0x10de (NVIDIA) found at 0000:01:00.0"),
        )

    def test_nvidia_with_nvml_but_no_nvidia_smi(self) -> None:
        root = self.sysfs(("0000:01:00.0", (0x10DE, 0x030000)))
        self.assertEqual(self.select(root, libraries=["nvidia-ml"])[0], "cuda")

    def test_leftover_nvidia_smi_on_an_amd_box_picks_rocm(self) -> None:
        root = self.sysfs(("0000:c1:00.0", (0x1002, 0x038000)))
        self.assertEqual(
            self.select(root, tools=["nvidia-smi", "amd-smi"]),
            ("rocm", "PCI vendor 0x1002 (AMD) found at 0000:c1:00.0"),
        )

    def test_amd_box_without_rocm_never_picks_cuda(self) -> None:
        root = self.sysfs(("0000:c1:00.0", (0x1002, 0x038000)))
        name, reason = self.select(root, tools=["nvidia-smi"], libraries=["nvidia-ml"])
        self.assertEqual(name, "cpu")
        self.assertEqual(
            reason,
            "PCI vendor 0x1002 (AMD) found at 0000:c1:00.0 but neither amd-smi nor "
            "rocm-smi is on PATH; using cpu",
        )

    def test_amd_box_without_rocm_but_with_vulkan(self) -> None:
        root = self.sysfs(("0000:c1:00.0", (0x1002, 0x030000)))
        name, reason = self.select(root, tools=["vulkaninfo", "nvidia-smi"])
        self.assertEqual(name, "vulkan")
        self.assertTrue(reason.endswith("; vulkaninfo is installed"), reason)

    def test_mi300_processing_accelerator(self) -> None:
        root = self.sysfs(("0000:05:00.0", (0x1002, 0x120000)))
        self.assertEqual(self.select(root, tools=["rocm-smi"])[0], "rocm")

    def test_nvidia_preferred_over_amd(self) -> None:
        root = self.sysfs(("0000:c1:00.0", (0x1002, 0x030000)), ("0000:01:00.0", (0x10DE, 0x030000)))
        self.assertEqual(self.select(root, tools=["nvidia-smi", "amd-smi"])[0], "cuda")

    def test_intel_gpu_needs_oneapi(self) -> None:
        root = self.sysfs(("0000:00:02.0", (0x8086, 0x030000)))
        self.assertEqual(
            self.select(root, tools=["sycl-ls"]), ("sycl", "PCI vendor 0x8086 (Intel) found at 0000:00:02.0")
        )
        name, reason = self.select(root, tools=["vulkaninfo"])
        self.assertEqual(name, "cpu")
        self.assertIn("sycl-ls is not on PATH", reason)

    def test_intel_npu_and_nvidia_audio_are_not_gpus(self) -> None:
        root = self.sysfs(("0000:00:0b.0", (0x8086, 0x120000)), ("0000:01:00.1", (0x10DE, 0x040300)))
        self.assertEqual(
            self.select(root, tools=["sycl-ls", "nvidia-smi", "vulkaninfo"]),
            ("cpu", "no GPU or accelerator on the PCI bus"),
        )

    def test_macos(self) -> None:
        self.assertEqual(self.select(self.mktemp(), platform="darwin"), ("metal", "macOS: Metal"))

    def test_without_sysfs_a_tool_must_answer_with_a_device(self) -> None:
        missing = self.mktemp()
        answers = {
            ("nvidia-smi", "-L"): (
                9,
                "NVIDIA-SMI has failed because it couldn't communicate with the driver",
                "",
            ),
            ("amd-smi", "list"): (0, "GPU: 0\n    BDF: 0000:c1:00.0\n", ""),
        }
        fake = FakeTools(answers)
        name, reason = select_backend(
            "auto",
            sysfs_root=missing,
            which=fake.which,
            platform="linux",
            run=fake.run_sync,
            find_library=lambda n: None,
        )
        self.assertEqual(name, "rocm")
        self.assertEqual(reason, f"no PCI information under {missing}; `amd-smi list` lists a device")
        self.assertEqual(fake.calls, [("nvidia-smi", "-L"), ("amd-smi", "list")])

    def test_without_sysfs_or_tools(self) -> None:
        missing = self.mktemp()
        self.assertEqual(
            self.select(missing), ("cpu", f"no PCI information under {missing} and no GPU tool answers")
        )

    def test_configured_backend_is_kept(self) -> None:
        self.assertEqual(
            select_backend("vulkan", sysfs_root=self.mktemp()), ("vulkan", "configured as backend: vulkan")
        )
        self.assertRaises(ConfigError, select_backend, "opencl")

    def test_scan_pci(self) -> None:
        root = self.sysfs(("0000:01:00.0", (0x10DE, 0x030200)))
        os.makedirs(os.path.join(root, "bus", "pci", "devices", "0000:03:00.0"))  # no vendor file
        found = scan_pci(root)
        assert found is not None
        self.assertEqual(
            [(f.address, f.vendor_name) for f in found],
            [("0000:01:00.0", "NVIDIA"), ("0000:02:00.0", "0x1a03")],
        )
        self.assertIsNone(scan_pci(self.mktemp()))

    def test_is_accelerator(self) -> None:
        self.assertTrue(is_accelerator(0x10DE, 0x030000))
        self.assertTrue(is_accelerator(0x1002, 0x120000))
        self.assertFalse(is_accelerator(0x8086, 0x120000))
        self.assertFalse(is_accelerator(0x10DE, 0x068000))  # NVSwitch bridge


class FilterDevicesTests(SynchronousTestCase):
    devices = [DeviceRef("cuda", 0, "gpu:0", uuid="GPU-a"), DeviceRef("cuda", 1, "gpu:1", uuid="GPU-b")]

    def test_no_allow_list_keeps_everything(self) -> None:
        self.assertEqual(filter_devices(self.devices, None), self.devices)
        self.assertEqual(filter_devices(iter(self.devices), []), self.devices)

    def test_allow_list_by_name_or_uuid_in_discovery_order(self) -> None:
        self.assertEqual(filter_devices(self.devices, ["gpu:1"]), self.devices[1:])
        self.assertEqual(filter_devices(self.devices, ["gpu:1", "GPU-a", "gpu:0"]), self.devices)

    def test_absent_device_is_a_one_line_config_error(self) -> None:
        e = self.assertRaises(ConfigError, filter_devices, self.devices, ["gpu:0", "gpu:3"])
        self.assertEqual(str(e), 'devices: "gpu:3" is not present (found: gpu:0, gpu:1)')
        e = self.assertRaises(ConfigError, filter_devices, [], ["cpu:1"])
        self.assertEqual(str(e), 'devices: "cpu:1" is not present (found: none)')
