"""The cpu backend on fake /proc and sysfs trees: one device, N core groups, NUMA nodes, pinning
arguments and utilization from /proc/stat deltas."""

from __future__ import annotations

import os
import shutil

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from rolemesh.backends import BackendUnavailable
from rolemesh.backends.cpu import (
    CpuBackend,
    cpu_mask,
    cpu_range,
    numa_groups,
    parse_cpu_list,
    parse_cpuinfo,
    parse_meminfo,
    parse_proc_stat,
    split_cores,
)
from rolemesh.base.errors import ConfigError
from rolemesh.base.interfaces import IDeviceBackend
from tests.fixtures.backend_fakes import FIXTURES, fixture

MEMTOTAL = parse_meminfo(fixture("proc/meminfo"))["MemTotal"]
MEMAVAILABLE = parse_meminfo(fixture("proc/meminfo"))["MemAvailable"]


def fake_proc(test: SynchronousTestCase) -> str:
    """A writable copy of tests/fixtures/backends/proc."""
    root = test.mktemp()
    shutil.copytree(os.path.join(FIXTURES, "proc"), root)
    return root


def fake_numa(test: SynchronousTestCase, nodes: dict) -> str:
    """A sysfs root with ``devices/system/node/node<N>/cpulist`` per ``{N: "0-3"}``."""
    root = test.mktemp()
    base = os.path.join(root, "devices", "system", "node")
    os.makedirs(base)
    for name in ("online", "possible", "has_cpu"):
        with open(os.path.join(base, name), "w") as f:
            f.write("0-1\n")
    for node, cpulist in nodes.items():
        os.makedirs(os.path.join(base, f"node{node}"))
        with open(os.path.join(base, f"node{node}", "cpulist"), "w") as f:
            f.write(cpulist + "\n")
    return root


class ParserTests(SynchronousTestCase):
    def test_meminfo(self) -> None:
        mem = parse_meminfo(fixture("proc/meminfo"))
        self.assertEqual(mem["MemTotal"], 24683652 * 1024)
        self.assertEqual(mem["MemAvailable"], 24072892 * 1024)
        self.assertEqual(parse_meminfo("HugePages_Total:       0\nbogus\n"), {"HugePages_Total": 0})

    def test_proc_stat(self) -> None:
        stat = parse_proc_stat(fixture("proc/stat"))
        self.assertEqual(sorted(stat), [-1, 0, 1])
        self.assertEqual(stat[0], (5000 + 2500 + 100, 48100))
        self.assertEqual(parse_proc_stat("cpu0 x y\ncpu1 1 2\nintr 5\n"), {})

    def test_cpuinfo(self) -> None:
        self.assertEqual(parse_cpuinfo(fixture("proc/cpuinfo")), ("AuthenticAMD", "AMD EPYC"))
        self.assertEqual(parse_cpuinfo("processor : 0\nCPU implementer : 0x41\n"), (None, None))

    def test_cpu_list(self) -> None:
        self.assertEqual(parse_cpu_list("0-3,8,10-11\n"), (0, 1, 2, 3, 8, 10, 11))
        self.assertEqual(parse_cpu_list("\n"), ())

    def test_range_and_mask(self) -> None:
        self.assertEqual(cpu_range((4, 5, 6)), "4-6")
        self.assertIsNone(cpu_range((4, 6)))
        self.assertIsNone(cpu_range(()))
        self.assertEqual(cpu_mask((4, 6, 7)), "d0")

    def test_numa_groups(self) -> None:
        self.assertEqual(
            numa_groups({1: (4, 5, 6, 7), 0: (0, 1, 2, 3)}, [0, 1, 2, 3, 4, 6, 7]), [(0, 1, 2, 3), (4, 6, 7)]
        )
        self.assertEqual(numa_groups({0: (0, 1), 1: ()}, [0, 1]), [(0, 1)])  # memory-only node
        self.assertEqual(numa_groups({}, [2, 3]), [(2, 3)])

    @given(st.lists(st.integers(0, 511), min_size=1, max_size=64, unique=True), st.integers(1, 64))
    def test_split_cores_partitions_evenly(self, cores, groups) -> None:
        cores = sorted(cores)
        if groups > len(cores):
            self.assertRaises(BackendUnavailable, split_cores, cores, groups)
            return
        parts = split_cores(cores, groups)
        self.assertEqual(len(parts), groups)
        self.assertEqual([c for part in parts for c in part], cores)
        sizes = {len(part) for part in parts}
        self.assertLessEqual(max(sizes) - min(sizes), 1)

    @given(st.sets(st.integers(0, 255), min_size=1, max_size=40))
    def test_cpu_list_mask_and_range_agree(self, cpus) -> None:
        text = ",".join(str(c) for c in sorted(cpus))
        self.assertEqual(parse_cpu_list(text), tuple(sorted(cpus)))
        mask = int(cpu_mask(tuple(cpus)), 16)
        self.assertEqual({i for i in range(256) if mask >> i & 1}, cpus)
        rng = cpu_range(tuple(cpus))
        if rng is not None:
            lo, hi = (int(x) for x in rng.split("-"))
            self.assertEqual(set(range(lo, hi + 1)), cpus)

    def test_bad_cpu_devices(self) -> None:
        for value in (0, -1, "many", True, 2.5j):
            self.assertRaises(ConfigError, CpuBackend, cpu_devices=value)
        self.assertRaises(ConfigError, split_cores, [0, 1], 0)


class CpuBackendTests(SynchronousTestCase):
    def backend(self, cpu_devices=None, cores=(0, 1), sysfs=None) -> CpuBackend:
        self.clock = Clock()
        self.clock.advance(1000)
        self.proc = fake_proc(self)
        backend = CpuBackend(
            cpu_devices=cpu_devices,
            reactor=self.clock,
            allowed_cores=lambda: list(cores),
            sysfs_root=sysfs or self.mktemp(),
            proc_root=self.proc,
        )
        self.assertTrue(verifyObject(IDeviceBackend, backend))
        return backend

    def test_default_is_the_whole_host(self) -> None:
        backend = self.backend()
        (device,) = backend.discover()
        self.assertEqual((device.name, device.index, device.cpus), ("cpu:0", 0, ()))
        self.assertEqual(device.memory_total_bytes, MEMTOTAL)
        self.assertEqual((device.vendor, device.model), ("AuthenticAMD", "AMD EPYC"))
        self.assertEqual(backend.child_arguments(device), {"device": "none"})  # a GPU build offloads nothing

    def test_two_devices_on_two_cores(self) -> None:
        backend = self.backend(cpu_devices=2)
        devices = backend.discover()
        self.assertEqual([(d.name, d.cpus) for d in devices], [("cpu:0", (0,)), ("cpu:1", (1,))])
        self.assertEqual(backend.child_arguments(devices[0]), {"device": "none", "cpu-range": "0-0", "threads": 1})
        self.assertEqual(backend.child_arguments(devices[1]), {"device": "none", "cpu-range": "1-1", "threads": 1})
        self.assertEqual({d.memory_total_bytes for d in devices}, {MEMTOTAL})

    def test_cpu_devices_as_text_is_refused_like_the_config_key(self) -> None:
        # One check (rolemesh.config.file.check_cpu_devices) for the key and the
        # backend: the config never passed text, so the backend takes none.
        e = self.assertRaises(ConfigError, self.backend, cpu_devices="2")
        self.assertEqual(str(e), 'cpu_devices: expected "numa" or a positive integer, got "2"')

    def test_more_groups_than_cores(self) -> None:
        e = self.assertRaises(BackendUnavailable, self.backend(cpu_devices=3).discover)
        self.assertEqual(str(e), "cpu_devices: 3 groups asked for, but only 2 cores are available")

    def test_uneven_groups_keep_their_affinity(self) -> None:
        devices = self.backend(cpu_devices=2, cores=(2, 3, 5, 6, 7)).discover()
        self.assertEqual([d.cpus for d in devices], [(2, 3, 5), (6, 7)])
        backend = self.backend(cpu_devices=2, cores=(2, 3, 5, 6, 7))
        self.assertEqual(backend.child_arguments(devices[0]), {"device": "none", "cpu-mask": "2c", "threads": 3})

    def test_numa_nodes(self) -> None:
        sysfs = fake_numa(self, {0: "0-3", 1: "4-7", 2: ""})
        devices = self.backend("numa", cores=(0, 1, 2, 3, 4, 6, 7), sysfs=sysfs).discover()
        self.assertEqual([(d.name, d.cpus) for d in devices], [("cpu:0", (0, 1, 2, 3)), ("cpu:1", (4, 6, 7))])
        backend = self.backend("numa", sysfs=sysfs)
        self.assertEqual(backend.child_arguments(devices[0]), {"device": "none", "cpu-range": "0-3", "threads": 4})
        self.assertEqual(backend.child_arguments(devices[1]), {"device": "none", "cpu-mask": "d0", "threads": 3})

    def test_numa_without_sysfs_is_one_pinned_group(self) -> None:
        devices = self.backend("numa", cores=(0, 1)).discover()
        self.assertEqual([d.cpus for d in devices], [(0, 1)])

    def test_sample_memory_and_utilization_per_group(self) -> None:
        backend = self.backend(cpu_devices=2)
        devices = backend.discover()
        shutil.copy(os.path.join(self.proc, "stat.later"), os.path.join(self.proc, "stat"))
        self.clock.advance(5)
        first, second = self.successResultOf(backend.sample(devices))
        self.assertEqual((first.device, first.utilization_pct), ("cpu:0", 100.0))
        self.assertEqual((second.device, second.utilization_pct), ("cpu:1", 0.0))
        self.assertEqual(first.sampled_at, 1005)
        self.assertEqual(first.memory_total_bytes, MEMTOTAL)
        self.assertEqual(first.memory_free_bytes, MEMAVAILABLE)
        self.assertEqual(first.memory_used_bytes, MEMTOTAL - MEMAVAILABLE)
        self.assertFalse(first.stale)

    def test_sample_whole_host_uses_the_aggregate_line(self) -> None:
        backend = self.backend()
        devices = backend.discover()
        shutil.copy(os.path.join(self.proc, "stat.later"), os.path.join(self.proc, "stat"))
        (metrics,) = self.successResultOf(backend.sample(devices))
        self.assertEqual(metrics.utilization_pct, 66.7)

    def test_no_change_since_last_sample_is_unknown_utilization(self) -> None:
        backend = self.backend()
        devices = backend.discover()
        (metrics,) = self.successResultOf(backend.sample(devices))
        self.assertIsNone(metrics.utilization_pct)

    def test_without_proc(self) -> None:
        self.clock = Clock()
        backend = CpuBackend(reactor=self.clock, proc_root=self.mktemp(), allowed_cores=lambda: [0])
        (device,) = backend.discover()
        self.assertEqual(device.name, "cpu:0")
        (metrics,) = self.successResultOf(backend.sample([device]))
        self.assertIsNone(metrics.memory_free_bytes)


class RealHostTests(SynchronousTestCase):
    """The real /proc and affinity of the machine running the tests (Linux only)."""

    def setUp(self) -> None:
        if not os.path.exists("/proc/meminfo") or not hasattr(os, "sched_getaffinity"):
            self.skipTest("needs Linux /proc")

    def test_memory_total_is_meminfo(self) -> None:
        with open("/proc/meminfo") as f:
            total = parse_meminfo(f.read())["MemTotal"]
        (device,) = CpuBackend(reactor=Clock()).discover()
        self.assertEqual(device.memory_total_bytes, total)

    def test_two_devices_each_pinned_to_its_own_cores(self) -> None:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            self.skipTest("needs two cores")
        backend = CpuBackend(cpu_devices=2, reactor=Clock())
        devices = backend.discover()
        self.assertEqual([d.name for d in devices], ["cpu:0", "cpu:1"])
        self.assertFalse(set(devices[0].cpus) & set(devices[1].cpus))
        self.assertEqual(sorted(devices[0].cpus + devices[1].cpus), cores)
        for device in devices:
            self.assertEqual(backend.child_arguments(device)["threads"], len(device.cpus))
