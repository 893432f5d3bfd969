"""Memory-aware placement and device groups, through the node: real
supervisors on a recording reactor, fake children, facts of a GGUF header
built in the test (the estimate itself is tested in test_estimate)."""

from __future__ import annotations

import io
import itertools
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import attr
from twisted.internet import defer
from twisted.trial.unittest import SkipTest, SynchronousTestCase

from rolemesh.backends.cpu import CpuBackend, cpu_mask, cpu_range
from rolemesh.backends.cuda import CudaBackend
from rolemesh.backends.groups import group_name, groups_of, pin_child
from rolemesh.backends.rocm import RocmBackend
from rolemesh.backends.sycl import SyclBackend
from rolemesh.backends.vulkan import VulkanBackend
from rolemesh.base import errors
from rolemesh.base.devices import DeviceMetrics, DeviceRef
from rolemesh.base.errors import ConfigError
from rolemesh.children.state import READY, STOPPED, STOPPING
from rolemesh.children.supervisor import DeviceSupervisor
from rolemesh.cli import check_report, memory_report
from rolemesh.node.node import Lease, Node
from rolemesh.scheduling.estimate import AdapterFacts, GGUFFacts
from rolemesh.service import check_service_config
from tests.fixtures.fakes import FakeBackend, FakeProbe, GroupSignals, ProcessReactor, make_config
from tests.fixtures.tiny_gguf import write_tiny_gguf, write_tiny_lora

GIB = 1 << 30

#: A 7B-ish llama: 32 layers of 200 MiB, 8 KV heads of 128 (128 KiB of f16
#: KV cache per cell).
FACTS = GGUFFacts("llama", 32, 4096, (32,) * 32, (8,) * 32, 128, 128, 32000, 32768, n_ff=14336,
                  layer_bytes=(200 << 20,) * 32, output_bytes=250 << 20, other_bytes=250 << 20)

MODELS: List[Dict[str, Any]] = [
    {"model_id": "a", "ctx_size": 4096},
    {"model_id": "b", "ctx_size": 4096},
    {"model_id": "big", "ctx_size": 1 << 20},  # 128 GiB of KV cache
    {"model_id": "G", "ctx_size": 4096, "devices": ["gpu:0", "gpu:1"]},
    {"model_id": "wide", "ctx_size": 160000, "devices": ["gpu:0", "gpu:1"]},  # ~20 GiB of KV: only the pair
    {"model_id": "only1", "devices": ["gpu:1"], "ctx_size": 4096},
]


class Harness:
    """A node with gpu:0, gpu:1, gpu:2 (16 GiB each) and the group the models name."""

    def __init__(self, models: Sequence[Dict[str, Any]] = MODELS, facts: Optional[Dict[str, Any]] = None,
                 read_facts: Any = None, read_adapter: Any = None, **top: Any) -> None:
        top.setdefault("llama_server_probe_interval_s", 0.5)
        top.setdefault("llama_server_stop_timeout_s", 5.0)
        self.config = make_config(models, **top)
        self.reactor = ProcessReactor()
        self.probe = FakeProbe()
        self.signals = GroupSignals(self.reactor)
        self.backend = FakeBackend(count=3)
        ports = itertools.count(20000)
        refs = {r.name: r for r in self.backend.refs}

        def supervisor(ref: Any, members: Sequence[Any] = ()) -> DeviceSupervisor:
            return DeviceSupervisor(ref, self.backend, self.config, "/opt/llama/llama-server", reactor=self.reactor,
                                    probe=self.probe, pick_port=lambda: next(ports), signal_group=self.signals,
                                    environ={"PATH": "/usr/bin"}, members=members)

        supervisors = [supervisor(r) for r in self.backend.refs]
        for group in groups_of(self.config.models):
            members = [refs[n] for n in group]
            supervisors.append(supervisor(members[0], members))
        if facts is None:
            facts = {m.path: FACTS for m in self.config.models}
        self.node = Node(self.config, self.backend, self.backend.refs, supervisors, reactor=self.reactor,
                         facts=facts, read_facts=read_facts, read_adapter=read_adapter)

    def model(self, model_id: str) -> Any:
        return self.config.model(model_id)

    def live(self, visible: str) -> List[Any]:
        return [p for p in self.reactor.processes if not p.ended and p.env.get("FAKE_VISIBLE_DEVICES") == visible]

    def acquire(self, model_id: str, device: Optional[str] = None) -> List[Any]:
        results: List[Any] = []
        self.node.acquire(self.model(model_id), device=device).addBoth(results.append)
        return results

    def answer(self, *names: str) -> None:
        self.probe.ready |= set(names)
        self.reactor.advance(self.config.llama_server_probe_interval_s)

    def lease(self, model_id: str, device: Optional[str] = None) -> Lease:
        results = self.acquire(model_id, device)
        self.answer(model_id)
        assert results and isinstance(results[0], Lease), results
        return results[0]


class TooLargeTests(SynchronousTestCase):
    def test_a_model_no_device_can_ever_hold_is_refused_at_once_and_nothing_spawns(self) -> None:
        h = Harness()
        results = h.acquire("big")
        self.assertEqual(len(results), 1, "answered at once, not queued")
        error = results[0].value
        self.assertIsInstance(error, errors.ApiError)
        self.assertEqual((error.status, error.code), (400, "model_too_large"))
        self.assertIn("'big' needs an estimated 13", error.message)  # 128 GiB KV + 7 GiB weights
        self.assertIn("has 16.00 GiB in total", error.message)
        self.assertIn("gpu:", error.message)
        self.assertEqual(h.reactor.processes, [], "nothing spawned")
        self.assertTrue(all(b.pending == 0 for b in h.node.scheduler.devices.values()))

    def test_the_group_is_the_largest_thing_a_group_model_may_use(self) -> None:
        h = Harness(models=[{"model_id": "G", "ctx_size": 1 << 20, "devices": ["gpu:0", "gpu:1"]}])
        error = h.acquire("G")[0].value
        self.assertEqual(error.code, "model_too_large")
        self.assertIn("device group it may use, gpu:0+gpu:1, has 32.00 GiB in total", error.message)

    def test_the_reserve_counts(self) -> None:
        fits = Harness(models=[{"model_id": "a", "ctx_size": 4096}])
        self.assertIsNone(fits.node.too_large(fits.model("a")))
        reserved = Harness(models=[{"model_id": "a", "ctx_size": 4096}], device_memory_reserve_bytes=12 * GIB)
        problem = reserved.node.too_large(reserved.model("a"))
        self.assertIsNotNone(problem)
        self.assertIn("reserve 12.00 GiB", problem.message)

    def test_unknown_size_is_never_refused(self) -> None:
        h = Harness(facts={})
        self.assertIsNone(h.node.too_large(h.model("big")))
        h.acquire("big")
        self.assertEqual(len(h.reactor.processes), 1)

    def test_inventory_shows_estimates_and_where_each_model_fits(self) -> None:
        h = Harness()
        models = {m["model_id"]: m for m in h.node.inventory()["models"]}
        self.assertEqual(models["a"]["fits_on"], ["gpu:0", "gpu:1", "gpu:2"])
        self.assertEqual(models["big"]["fits_on"], [])
        self.assertEqual(models["wide"]["fits_on"], ["gpu:0+gpu:1"])
        self.assertEqual(models["only1"]["devices"], ["gpu:1"])
        estimate = models["a"]["memory_estimate"]
        self.assertEqual(estimate["total_bytes"], sum(estimate[k] for k in (
            "weights_bytes", "kv_cache_bytes", "compute_bytes", "reserve_bytes")))
        self.assertEqual(estimate["kv_cache_bytes"], 32 * 2 * 8 * 128 * 4096 * 2)


class AdapterMemoryTests(SynchronousTestCase):
    """A model's LoRA adapters count in its estimate: the inventory, /v1/models, model_too_large."""

    ADAPTER = AdapterFacts(layer_bytes=(10 << 20,) * 32, output_bytes=5 << 20, other_bytes=7 << 20)

    def harness(self, *paths: str) -> Harness:
        adapters = [{"id": f"a:{i}", "path": path} for i, path in enumerate(paths)]
        self.read: List[str] = []

        def reader(path: str) -> Optional[AdapterFacts]:
            self.read.append(path)
            return None if "broken" in path else self.ADAPTER

        return Harness(models=[{"model_id": "a", "ctx_size": 4096, "lora_adapters": adapters},
                               {"model_id": "b", "ctx_size": 4096}], read_adapter=reader)

    def test_the_adapters_on_the_device_count_in_the_estimate(self) -> None:
        h = self.harness("/models/x.gguf", "/models/y.gguf")
        models = {m["model_id"]: m["memory_estimate"] for m in h.node.inventory()["models"]}
        per_adapter = 32 * (10 << 20) + (5 << 20)  # a gpu: every layer and the head, not the embeddings'
        self.assertEqual(models["a"]["lora_bytes"], 2 * per_adapter)
        self.assertEqual(models["a"]["total_bytes"] - models["b"]["total_bytes"], 2 * per_adapter)
        self.assertEqual(models["b"]["lora_bytes"], 0)
        self.assertEqual(sorted(set(self.read)), ["/models/x.gguf", "/models/y.gguf"])
        h.node.inventory()
        self.assertEqual(len(self.read), 2, "each adapter's header is read once")

    def test_an_unreadable_adapter_is_left_out(self) -> None:
        h = self.harness("/models/x.gguf", "/models/broken.gguf")
        estimate = h.node.estimate_for(h.model("a"))
        assert estimate is not None
        self.assertEqual(estimate.lora_bytes, 32 * (10 << 20) + (5 << 20))

    def test_adapters_can_make_a_model_too_large(self) -> None:
        need = Harness(models=[{"model_id": "a", "ctx_size": 4096}]).node.estimate_for(
            make_config([{"model_id": "a", "ctx_size": 4096}]).model("a"))
        assert need is not None
        room = 16 * GIB - need.total_bytes  # what one 16 GiB device has left beside the bare model
        big = AdapterFacts(layer_bytes=(room // 32 + 1,) * 32)
        h = Harness(models=[{"model_id": "a", "ctx_size": 4096, "lora_adapters": [{"id": "a:x", "path": "/x.gguf"}]}],
                    read_adapter=lambda path: big)
        error = h.node.too_large(h.model("a"))
        assert error is not None
        self.assertEqual(error.code, "model_too_large")
        self.assertIn("LoRA adapters", error.message)


class ReloadTests(SynchronousTestCase):
    def test_a_model_a_reload_adds_or_moves_is_read_on_first_use(self) -> None:
        read: List[str] = []

        def reader(path: str) -> Optional[GGUFFacts]:
            read.append(path)
            return FACTS

        h = Harness(models=[{"model_id": "a", "ctx_size": 4096}], facts={}, read_facts=reader)
        self.assertIsNone(h.node.too_large(h.model("a")))
        self.assertEqual(read, ["/models/a.gguf"])
        h.node.too_large(h.model("a"))
        self.assertEqual(read, ["/models/a.gguf"], "read once per path")
        h.node.reconfigure(make_config([{"model_id": "a", "ctx_size": 4096, "path": "/models/a2.gguf"},
                                        {"model_id": "c", "ctx_size": 1 << 20}]))
        h.config = h.node.config
        self.assertEqual(h.acquire("c")[0].value.code, "model_too_large")
        self.assertIsNone(h.node.too_large(h.model("a")))
        self.assertEqual(read, ["/models/a.gguf", "/models/c.gguf", "/models/a2.gguf"])

    def test_a_group_a_reload_names_needs_a_restart(self) -> None:
        h = Harness(models=[{"model_id": "a"}])
        h.node.reconfigure(make_config([{"model_id": "a"}, {"model_id": "G", "devices": ["gpu:1", "gpu:2"]}]))
        h.config = h.node.config
        error = h.acquire("G")[0].value
        self.assertEqual((error.status, error.code), (503, "restart_required"))
        self.assertIn("gpu:1+gpu:2", error.message)
        self.assertEqual(h.reactor.processes, [])


class FitTests(SynchronousTestCase):
    def test_placement_prefers_a_device_whose_free_memory_holds_the_model(self) -> None:
        h = Harness()
        h.backend.free = 16 * GIB
        h.node.sample_metrics()
        h.node.scheduler.set_free_memory("gpu:0", 2 * GIB)
        h.node.scheduler.set_free_memory("gpu:1", 3 * GIB)
        h.node.scheduler.set_free_memory("gpu:2", 9 * GIB)
        self.assertEqual(h.lease("a").device, "gpu:2")
        h.node.scheduler.set_free_memory("gpu:0", 8 * GIB)
        h.node.scheduler.set_free_memory("gpu:1", 14 * GIB)
        # b fits on gpu:0 and gpu:1; it takes the one with most free memory, not a's.
        self.assertEqual(h.lease("b").device, "gpu:1")

    def test_estimates_are_worked_out_once_not_per_request(self) -> None:
        import rolemesh.scheduling.placement as placement_module  # where the estimates are worked out

        h = Harness()
        calls: List[Any] = []
        real = placement_module.estimate_on

        def counting(*args: Any, **kwargs: Any) -> Any:
            calls.append(args[1].model_id)
            return real(*args, **kwargs)

        placement_module.estimate_on = counting  # type: ignore[assignment]
        self.addCleanup(setattr, placement_module, "estimate_on", real)
        first = h.lease("a")
        after_one = len(calls)
        first.release()
        for _ in range(3):
            h.lease("a").release()
        self.assertEqual(len(calls), after_one, "later requests reuse the estimates")

    def test_a_pinned_model_runs_only_there(self) -> None:
        h = Harness()
        self.assertEqual(h.lease("only1").device, "gpu:1")
        results = h.acquire("only1", device="gpu:2")
        self.assertEqual(results[0].value.code, "device_not_eligible")

    def test_group_free_memory_is_the_members_sum(self) -> None:
        h = Harness()
        h.node.sample_metrics()
        self.assertEqual(h.node.scheduler.devices["gpu:0+gpu:1"].free_memory, 16 * GIB)


class PlacementCacheTests(SynchronousTestCase):
    """Placement is worked out once per model and kept (every request asks)
    until what it depends on changes: the config, or a device's sample."""

    def test_a_reload_that_changes_the_reserve_is_placed_anew(self) -> None:
        models = [{"model_id": "a", "ctx_size": 4096}]
        h = Harness(models=models)
        h.lease("a").release()
        h.node.reconfigure(make_config(models, device_memory_reserve_bytes=12 * GIB))
        h.config = h.node.config
        error = h.acquire("a")[0].value
        self.assertEqual(error.code, "model_too_large")
        self.assertIsNone(h.node.lease_now(h.model("a")))

    def test_totals_that_only_samples_report_are_followed(self) -> None:
        h = Harness(models=[{"model_id": "a", "ctx_size": 4096}])
        h.node.devices = [attr.evolve(d, memory_total_bytes=None) for d in h.node.devices]
        h.lease("a").release()  # no total known: never refused
        h.backend.sample = lambda devices: defer.succeed(  # type: ignore[method-assign]
            [DeviceMetrics(d.name, 0.0, 1 * GIB, 0, 1 * GIB, None) for d in devices])
        h.node.sample_metrics()
        self.assertEqual(h.acquire("a")[0].value.code, "model_too_large")


class GroupTests(SynchronousTestCase):
    def test_one_child_spans_the_group_with_a_memory_ratio_split(self) -> None:
        h = Harness()
        lease = h.lease("G")
        self.assertEqual(lease.device, "gpu:0+gpu:1")
        child = h.live("0,1")
        self.assertEqual(len(child), 1, [p.env.get("FAKE_VISIBLE_DEVICES") for p in h.reactor.processes])
        argv = child[0].argv
        self.assertEqual(argv[argv.index("--tensor-split") + 1], "0.5,0.5")
        self.assertEqual(h.node.supervisors["gpu:0+gpu:1"].state, READY)
        inventory = h.node.inventory()
        self.assertEqual([g["group"] for g in inventory["groups"]], ["gpu:0+gpu:1"])
        group = inventory["groups"][0]
        self.assertEqual((group["members"], group["model"], group["in_flight"]), (["gpu:0", "gpu:1"], "G", 1))
        self.assertEqual([d["group"] for d in inventory["devices"]], ["gpu:0+gpu:1", "gpu:0+gpu:1", None])
        self.assertEqual(h.node.loaded_on("G"), ["gpu:0+gpu:1"])

    def test_explicit_tensor_split_wins(self) -> None:
        h = Harness(models=[{"model_id": "G", "devices": ["gpu:0", "gpu:1"], "tensor_split": [3, 1]}])
        h.lease("G")
        argv = h.live("0,1")[0].argv
        self.assertEqual(argv[argv.index("--tensor-split") + 1], "3,1")

    def test_the_group_waits_for_a_member_then_its_child_is_stopped_first(self) -> None:
        h = Harness()
        lease_a = h.lease("a", device="gpu:1")
        a_child = h.live("1")[0]
        results = h.acquire("G")
        self.assertEqual(results, [])
        self.assertEqual(h.live("0,1"), [], "no group child while a member serves another model")
        lease_a.release()
        self.assertEqual(h.node.supervisors["gpu:1"].state, STOPPING)
        self.assertEqual(h.live("0,1"), [], "the member's child is stopped before the group's starts")
        a_child.exit(0)
        self.assertEqual(h.node.supervisors["gpu:1"].state, STOPPED)
        self.assertEqual(len(h.live("0,1")), 1)
        h.answer("G")
        self.assertIsInstance(results[0], Lease)

    def test_a_member_request_waits_for_the_groups_in_flight_request_then_switches(self) -> None:
        h = Harness()
        lease_g = h.lease("G")
        g_child = h.live("0,1")[0]
        results = h.acquire("b", device="gpu:1")
        self.assertEqual(results, [])
        self.assertEqual(h.live("1"), [])
        self.assertEqual(h.node.supervisors["gpu:0+gpu:1"].state, READY, "the group's request is not disturbed")
        lease_g.release()
        self.assertEqual(h.node.supervisors["gpu:0+gpu:1"].state, STOPPING)
        g_child.exit(0)
        self.assertEqual(len(h.live("1")), 1)
        h.answer("b")
        self.assertEqual(results[0].device, "gpu:1")
        # gpu:0 is free again for anything else; the group is unbooked.
        self.assertIsNone(h.node.scheduler.devices["gpu:0+gpu:1"].model)
        self.assertEqual(h.lease("a", device="gpu:0").device, "gpu:0")

    def test_a_request_cancelled_while_the_member_stops_starts_nothing(self) -> None:
        h = Harness()
        h.lease("a", device="gpu:0").release()
        d = h.node.acquire(h.model("G"))
        d.addErrback(lambda f: None)
        a_child = h.live("0")[0]
        d.cancel()
        a_child.exit(0)
        self.assertEqual(h.live("0,1"), [])
        self.assertTrue(all(b.pending == 0 for b in h.node.scheduler.devices.values()))

    def test_unloading_a_member_stops_the_group(self) -> None:
        h = Harness()
        h.lease("G").release()
        g_child = h.live("0,1")[0]
        results: List[Any] = []
        h.node.unload("gpu:1").addBoth(results.append)
        self.assertEqual(h.node.supervisors["gpu:0+gpu:1"].state, STOPPING)
        g_child.exit(0)
        self.assertEqual(results, [None])
        self.assertEqual(h.node.supervisors["gpu:0+gpu:1"].state, STOPPED)

    def test_unloading_the_group_by_name(self) -> None:
        h = Harness()
        h.lease("G").release()
        results: List[Any] = []
        h.node.unload("gpu:0+gpu:1").addBoth(results.append)
        h.live("0,1")[0].exit(0)
        self.assertEqual(results, [None])


class PinTests(SynchronousTestCase):
    """A group's child environment and flags, from each real backend's single-device pin."""

    def refs(self, backend: str, count: int = 2, memory: Sequence[Optional[int]] = (24 * GIB, 24 * GIB),
             cpus: Sequence[Tuple[int, ...]] = ()) -> List[DeviceRef]:
        return [DeviceRef(backend, i, f"{backend}:{i}", memory_total_bytes=memory[i] if i < len(memory) else None,
                          cpus=cpus[i] if i < len(cpus) else ()) for i in range(count)]

    def test_cuda(self) -> None:
        backend = CudaBackend(load_nvml=None)
        defaults, env, cpus = pin_child(backend, self.refs("cuda", memory=(24 * GIB, 48 * GIB)), {"PATH": "/bin"})
        self.assertEqual((env["CUDA_VISIBLE_DEVICES"], env["PATH"]), ("0,1", "/bin"))
        self.assertEqual(env["CUDA_DEVICE_ORDER"], "PCI_BUS_ID")
        self.assertEqual(defaults, {"tensor-split": [0.333, 0.667]})
        self.assertEqual(cpus, ())

    def test_rocm_counts_hip_devices_inside_rocr(self) -> None:
        _, env, _ = pin_child(RocmBackend(), self.refs("rocm", 3, memory=(GIB,) * 3), {})
        self.assertEqual((env["ROCR_VISIBLE_DEVICES"], env["HIP_VISIBLE_DEVICES"]), ("0,1,2", "0,1,2"))

    def test_sycl_and_vulkan(self) -> None:
        _, env, _ = pin_child(SyclBackend(), self.refs("sycl"), {})
        self.assertEqual(env["ONEAPI_DEVICE_SELECTOR"], "level_zero:0,1")
        _, env, _ = pin_child(VulkanBackend(), self.refs("vulkan"), {})
        self.assertEqual(env["GGML_VK_VISIBLE_DEVICES"], "0,1")

    def test_one_device_is_the_backends_own_pin(self) -> None:
        backend = CudaBackend(load_nvml=None)
        ref = self.refs("cuda", 1)
        self.assertEqual(pin_child(backend, ref, {"A": "1"}),
                         (backend.child_arguments(ref[0]), backend.child_environment(ref[0], {"A": "1"}), ()))

    def test_unknown_memory_leaves_the_split_to_llama_server(self) -> None:
        defaults, _, _ = pin_child(CudaBackend(load_nvml=None), self.refs("cuda", memory=(GIB, None)), {})
        self.assertNotIn("tensor-split", defaults)

    def test_cpu_devices_get_the_union_of_their_cores(self) -> None:
        backend = CpuBackend(cpu_devices=2, allowed_cores=lambda: [0, 1, 2, 3])
        refs = self.refs("cpu", cpus=[(0, 1), (2, 3)])
        defaults, env, cpus = pin_child(backend, refs, {"PATH": "/bin"})
        self.assertEqual(defaults, {"device": "none", "cpu-range": "0-3", "threads": 4})
        self.assertEqual(env, {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": ""})
        self.assertEqual(cpus, (0, 1, 2, 3))
        gappy = self.refs("cpu", cpus=[(0,), (2,)])
        self.assertEqual(pin_child(backend, gappy, {})[0], {"device": "none", "cpu-mask": "5", "threads": 2})

    def test_group_names(self) -> None:
        self.assertEqual(group_name(["cuda:0", "cuda:1"]), "cuda:0+cuda:1")
        config = make_config(MODELS)
        self.assertEqual(groups_of(config.models), [("gpu:0", "gpu:1")])


class ConfigTests(SynchronousTestCase):
    def test_devices_and_reserve(self) -> None:
        config = make_config([{"model_id": "G", "devices": ["cuda:0", "cuda:1"]}], device_memory_reserve_bytes=1 << 30)
        self.assertEqual(config.model("G").devices, ("cuda:0", "cuda:1"))
        self.assertEqual(config.device_memory_reserve_bytes, 1 << 30)
        self.assertEqual(make_config([{"model_id": "a"}]).device_memory_reserve_bytes, 0)

    def test_bad_values_are_one_line_errors(self) -> None:
        for top, models, message in [
            ({"device_memory_reserve_bytes": -1}, [], "device_memory_reserve_bytes: expected a non-negative integer"),
            ({}, [{"model_id": "G", "devices": "cuda:0"}], "models[0].devices: expected a list of strings"),
            ({}, [{"model_id": "G", "devices": ["cuda:0", "cuda:0"]}],
             'models[0].devices[1]: "cuda:0" is listed twice'),
            ({}, [{"model_id": "G", "devices": [""]}], "models[0].devices[0]: expected a non-empty string"),
        ]:
            with self.assertRaises(ConfigError) as caught:
                make_config(models, **top)
            self.assertIn(message, str(caught.exception))

    def test_a_device_the_node_lacks_is_a_startup_error(self) -> None:
        config = make_config([{"model_id": "G", "devices": ["cpu:0", "cpu:7"]}])
        with self.assertRaises(ConfigError) as caught:
            check_service_config(config, ["cpu:0", "cpu:1"])
        self.assertEqual(str(caught.exception),
                         'models[0].devices[1]: "cpu:7" is not a device of this node (cpu:0, cpu:1)')


class CheckReportTests(SynchronousTestCase):
    def test_estimates_where_each_fits_and_a_warning_for_a_model_nothing_holds(self) -> None:
        directory = self.mktemp()
        os.makedirs(directory)
        path = write_tiny_gguf(os.path.join(directory, "t.gguf"))
        config = make_config([
            {"model_id": "tiny", "path": path},
            {"model_id": "huge", "path": path, "ctx_size": 1 << 36},
            {"model_id": "pair", "path": path, "devices": ["cpu:0", "cpu:1"]},
            # 6 GiB of KV cache and 12 GiB of masks: more than the host's 16 GiB,
            # less than the 32 GiB two GPUs of 16 would have.
            {"model_id": "wide", "path": path, "devices": ["cpu:0", "cpu:1"], "ctx_size": 3 << 22},
            {"model_id": "gone", "path": os.path.join(directory, "missing.gguf")},
        ])
        refs = [DeviceRef("cpu", i, f"cpu:{i}", memory_total_bytes=16 * GIB, cpus=(i,)) for i in range(2)]
        out = io.StringIO()
        memory_report(config, "cpu", refs, out)
        lines = out.getvalue().splitlines()
        self.assertIn("device_memory_reserve_bytes: 0", lines[1])
        self.assertTrue(lines[2].startswith("tiny: 1.3 MiB (weights 0.5 MiB, KV cache 0.1 MiB"), lines[2])
        self.assertTrue(lines[2].endswith("; fits on cpu:0, cpu:1"), lines[2])
        self.assertTrue(lines[3].startswith("# WARNING: huge: needs an estimated"), lines[3])
        self.assertIn("cpu:0, has 16.00 GiB in total", lines[3])
        self.assertTrue(lines[4].startswith("pair: 1.3 MiB"), lines[4])
        self.assertTrue(lines[4].endswith("fits on cpu:0+cpu:1"), lines[4])
        # cpu devices share the host's memory: the group has it once, not twice.
        self.assertTrue(lines[5].startswith("# WARNING: wide: needs an estimated 18.00 GiB"), lines[5])
        self.assertIn("cpu:0+cpu:1, has 16.00 GiB in total", lines[5])
        self.assertTrue(lines[6].startswith("gone: no estimate ("), lines[6])

    def test_lora_adapters_are_in_the_estimate(self) -> None:
        directory = self.mktemp()
        os.makedirs(directory)
        path = write_tiny_gguf(os.path.join(directory, "t.gguf"))
        lora = write_tiny_lora(os.path.join(directory, "l.gguf"), seed=3, rank=4)
        config = make_config([
            {"model_id": "tiny", "path": path, "lora_adapters": [{"id": "tiny:l", "path": lora}]},
            {"model_id": "bad", "path": path, "lora_adapters": [{"id": "bad:l", "path": path}]},
        ])
        refs = [DeviceRef("cpu", 0, "cpu:0", memory_total_bytes=16 * GIB, cpus=(0,))]
        out = io.StringIO()
        memory_report(config, "cpu", refs, out)
        lines = out.getvalue().splitlines()
        self.assertRegex(lines[2], r"^tiny: .*, LoRA adapters 0\.\d MiB, reserve .*; fits on cpu:0$")
        self.assertTrue(lines[3].startswith("bad: no estimate ("), lines[3])
        self.assertIn("not a LoRA adapter", lines[3])


class CheckCommandTests(SynchronousTestCase):
    """``--check`` on this host's cpu backend split in two, with a group model."""

    def test_group_command_line_and_estimates(self) -> None:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if len(cores) < 2:
            raise SkipTest("cpu_devices: 2 needs two usable cores")
        directory = self.mktemp()
        os.makedirs(directory)
        path = write_tiny_gguf(os.path.join(directory, "t.gguf"))
        config = make_config([{"model_id": "pair", "path": path, "devices": ["cpu:0", "cpu:1"]},
                              {"model_id": "huge", "path": path, "ctx_size": 1 << 40}],
                             backend="cpu", cpu_devices=2, llama_server_bin=sys.executable)
        out = io.StringIO()
        check_report(config, out)
        text = out.getvalue()
        line = [x for x in text.splitlines() if x.startswith("pair @ ")]
        self.assertEqual(len(line), 1, text)
        self.assertTrue(line[0].startswith("pair @ cpu:0+cpu:1: "), line[0])
        rng = cpu_range(cores)
        pin = f"--cpu-range {rng}" if rng else f"--cpu-mask {cpu_mask(cores)}"
        self.assertIn(f"{pin} --threads {len(cores)}", line[0])
        self.assertEqual(len([x for x in text.splitlines() if x.startswith("huge @ cpu:")]), 2)
        self.assertIn("pair: 1.3 MiB", text)
        self.assertIn("fits on cpu:0+cpu:1", text)
        self.assertIn("# WARNING: huge: needs an estimated", text)


class PlacementPartTests(SynchronousTestCase):
    """rolemesh.scheduling.placement alone: the node's devices, groups and samples as plain values."""

    def setUp(self) -> None:
        self.config = make_config(MODELS)
        self.refs = FakeBackend(count=3).refs
        self.groups = {"gpu:0+gpu:1": ["gpu:0", "gpu:1"]}
        self.metrics: Dict[str, DeviceMetrics] = {}
        self.read: List[str] = []
        self.lanes = {"gpu:0", "gpu:1", "gpu:2", "gpu:0+gpu:1"}
        self.placement = self.make()

    def make(self, backend: str = "fake", facts: Optional[Dict[str, Any]] = None) -> Any:
        from rolemesh.scheduling.placement import Placement

        def reader(path: str) -> Optional[GGUFFacts]:
            self.read.append(path)
            return FACTS

        return Placement(lambda: self.config, backend, lambda: self.refs, self.groups, self.metrics, self.lanes,
                         facts=facts, read_facts=reader)

    def model(self, model_id: str) -> Any:
        return self.config.model(model_id)

    def test_lanes_are_every_device_its_pinned_device_or_its_group(self) -> None:
        self.assertEqual(self.placement.lanes_for(self.model("a")), ["gpu:0", "gpu:1", "gpu:2"])
        self.assertEqual(self.placement.lanes_for(self.model("only1")), ["gpu:1"])
        self.assertEqual(self.placement.lanes_for(self.model("G")), ["gpu:0+gpu:1"])

    def test_capacity_sums_a_groups_members_once_for_a_shared_pool_and_follows_samples(self) -> None:
        self.assertEqual(self.placement.capacity("gpu:2"), 16 * GIB)
        self.assertEqual(self.placement.capacity("gpu:0+gpu:1"), 32 * GIB)
        self.assertEqual(self.make(backend="cpu").capacity("gpu:0+gpu:1"), 16 * GIB)
        self.refs = [attr.evolve(r, memory_total_bytes=None) for r in self.refs]
        self.assertIsNone(self.placement.capacity("gpu:0"))
        self.metrics["gpu:0"] = DeviceMetrics("gpu:0", 0.0, 24 * GIB, 0, 24 * GIB, None)
        self.assertEqual(self.placement.capacity("gpu:0"), 24 * GIB)

    def test_a_header_is_read_once_per_path_and_an_unreadable_one_means_no_estimate(self) -> None:
        first = self.placement.estimate_for(self.model("a"))
        self.assertIs(self.placement.estimate_for(self.model("a"), "gpu:0"), first, "worked out once")
        self.assertEqual(self.read, ["/models/a.gguf"])
        unknown = self.make(facts={"/models/a.gguf": None})
        self.assertIsNone(unknown.estimate_for(self.model("a")))
        self.assertEqual(unknown.fits_on(self.model("a")), ["gpu:0", "gpu:1", "gpu:2"], "unknown: never refused")

    def test_fit_and_too_large(self) -> None:
        self.assertEqual(self.placement.fits_on(self.model("wide")), ["gpu:0+gpu:1"])
        self.assertIsNone(self.placement.too_large(self.model("a")))
        problem = self.placement.too_large(self.model("big"))
        assert problem is not None
        self.assertEqual((problem.status, problem.code), (400, "model_too_large"))

    def test_a_placement_is_kept_until_forgotten_and_a_refusal_is_never_kept(self) -> None:
        placed = self.placement.placement(self.model("a"), None)
        self.assertEqual(placed[0], ["gpu:0", "gpu:1", "gpu:2"])
        self.assertEqual(set(placed[1]), {"gpu:0", "gpu:1", "gpu:2"})
        self.refs = self.refs[:1]
        self.assertIs(self.placement.placement(self.model("a"), None), placed)
        self.placement.forget()
        self.assertEqual(self.placement.placement(self.model("a"), None)[0], ["gpu:0"])
        self.assertRaises(errors.ApiError, self.placement.placement, self.model("big"), None)
        self.refs = [attr.evolve(r, memory_total_bytes=1 << 40) for r in self.refs]
        self.assertEqual(self.placement.placement(self.model("big"), None)[0], ["gpu:0"], "worked out again")

    def test_a_pinned_device_must_be_one_the_model_may_use_and_a_member_means_its_group(self) -> None:
        self.assertEqual(self.placement.placement(self.model("G"), "gpu:1")[2], "gpu:0+gpu:1")
        with self.assertRaises(errors.ApiError) as caught:
            self.placement.placement(self.model("only1"), "gpu:2")
        self.assertEqual((caught.exception.status, caught.exception.code), (400, "device_not_eligible"))

    def test_a_lane_the_node_lacks_needs_a_restart(self) -> None:
        self.lanes.discard("gpu:0+gpu:1")
        with self.assertRaises(errors.ApiError) as caught:
            self.placement.placement(self.model("G"), None)
        self.assertEqual((caught.exception.status, caught.exception.code), (503, "restart_required"))
