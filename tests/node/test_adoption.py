"""What a reload changes in the running node (rolemesh.node.adoption),
over stand-in supervisors and a real scheduler: a child whose command is
unchanged keeps serving the new record, one whose command changed is
unbooked (the next request restarts it), and a model that left the config
or its device is stopped once idle, never under a request."""

from __future__ import annotations

from typing import Any, List, Optional

from twisted.trial.unittest import SynchronousTestCase

from rolemesh.config.file import ModelConfig, NodeConfig
from rolemesh.node.adoption import ConfigAdoption
from rolemesh.scheduling.prefix import PrefixMemory
from rolemesh.scheduling.scheduler import Scheduler, superseded
from tests.fixtures.fakes import make_config


class Supervisor:
    """What the adoption reads and does of a supervisor."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.model: Optional[ModelConfig] = None
        self.state = "ready"
        self.stops = 0

    @property
    def loading_or_loaded(self) -> Optional[str]:
        return self.model.model_id if self.model is not None else None

    def stop(self) -> None:
        self.stops += 1
        self.model = None

    def retarget(self, model: ModelConfig) -> None:
        pass


class ConfigAdoptionTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.config = make_config([{"model_id": "a"}, {"model_id": "b"}], max_pending_requests_per_device=4)
        self.started: List[Any] = []
        self.scheduler = Scheduler(["gpu:0", "gpu:1"], 4, self.started.append)
        self.sups = {name: Supervisor(name) for name in ("gpu:0", "gpu:1")}
        self.prefixes = PrefixMemory(16)
        self.forgotten: List[None] = []
        self.idle_cancelled: List[str] = []
        self.idle_armed: List[str] = []
        self.lanes = {"a": ["gpu:0", "gpu:1"], "b": ["gpu:0", "gpu:1"]}
        self.adoption = ConfigAdoption(
            self.sups, self.scheduler, self.prefixes, lambda: self.config,
            lambda model: self.lanes.get(model.model_id, []), lambda: self.forgotten.append(None),
            self.idle_cancelled.append, self.idle_armed.append)
        for device, model in (("gpu:0", "a"), ("gpu:1", "b")):
            self.sups[device].model = self.config.model(model)
            self.scheduler.model_loaded(device, model)

    def adopt(self, config: NodeConfig) -> None:
        self.config = config
        self.adoption.adopt(config)

    def test_an_unchanged_command_keeps_its_child_with_the_new_record(self) -> None:
        self.adopt(make_config([{"model_id": "a", "roles": ["chat"]}, {"model_id": "b"}],
                               max_pending_requests_per_device=7, prefix_memory_entries=3))
        self.assertEqual(self.sups["gpu:0"].model.roles, ("chat",))
        self.assertEqual([s.stops for s in self.sups.values()], [0, 0])
        self.assertEqual(self.scheduler.devices["gpu:0"].model, "a")
        self.assertEqual((self.scheduler.pending_limit, self.prefixes.entries, len(self.forgotten)), (7, 3, 1))

    def test_a_changed_command_is_unbooked_and_keeps_running_until_asked(self) -> None:
        self.adopt(make_config([{"model_id": "a", "ctx_size": 512}, {"model_id": "b"}]))
        self.assertEqual(self.scheduler.devices["gpu:0"].model, superseded("a"), "the next request for a is a switch")
        self.assertEqual(self.sups["gpu:0"].stops, 0, "its child stops when the switch comes")
        self.assertEqual(self.scheduler.devices["gpu:1"].model, "b")

    def test_an_idle_device_restarts_its_countdown_with_the_new_idle_unload_s(self) -> None:
        ticket = self.scheduler.submit("b", device="gpu:1")
        self.adopt(make_config([{"model_id": "a", "idle_unload_s": 5}, {"model_id": "b"}]))
        self.assertEqual(self.idle_armed, ["gpu:0"], "gpu:1 is busy: armed when its request ends")
        self.scheduler.finish(ticket)

    def test_a_removed_model_stops_at_once_when_idle(self) -> None:
        self.adopt(make_config([{"model_id": "a"}]))
        self.assertEqual([s.stops for s in self.sups.values()], [0, 1])
        self.assertEqual(self.idle_cancelled, ["gpu:1"])

    def test_a_removed_model_under_a_request_stops_once_the_device_is_idle(self) -> None:
        ticket = self.scheduler.submit("b", device="gpu:1")
        self.assertEqual(self.started, [ticket])
        self.adopt(make_config([{"model_id": "a"}]))
        self.assertEqual(self.sups["gpu:1"].stops, 0, "never under a request")
        self.assertFalse(self.adoption.retire_if_removed("gpu:0"), "a stays")
        self.scheduler.finish(ticket)
        self.assertTrue(self.adoption.retire_if_removed("gpu:1"))
        self.assertEqual(self.sups["gpu:1"].stops, 1)

    def test_a_model_moved_to_other_devices_leaves_the_old_one(self) -> None:
        self.lanes["b"] = ["gpu:0"]
        self.assertTrue(self.adoption.retire_if_removed("gpu:1"))
        self.assertFalse(self.adoption.retire_if_removed("gpu:1"), "nothing held any more")

    def test_a_model_still_wanted_is_remembered_per_config(self) -> None:
        asked: List[str] = []
        self.adoption._lanes_for = lambda model: asked.append(model.model_id) or ["gpu:0", "gpu:1"]
        self.assertFalse(self.adoption.retire_if_removed("gpu:0"))
        self.assertFalse(self.adoption.retire_if_removed("gpu:0"))
        self.assertEqual(asked, ["a"], "asked once per config, not after every request")
        self.config = make_config([{"model_id": "a"}, {"model_id": "b"}])
        self.assertFalse(self.adoption.retire_if_removed("gpu:0"))
        self.assertEqual(asked, ["a", "a"], "a new config asks again")
