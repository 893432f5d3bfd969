"""What a reload changes in the running node: which children keep serving,
which are unbooked so that the next request restarts them, and which stop
once idle because their model left the config (or may no longer run where
it is).  The node's part for :meth:`Node.reconfigure`; it reads the config
through a callable, so it always sees the one the node holds.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional, Tuple

from twisted.logger import Logger

from rolemesh.children.state import READY, STARTING
from rolemesh.children.supervisor import DeviceSupervisor
from rolemesh.config.file import ModelConfig, NodeConfig
from rolemesh.node.reload import needs_new_child
from rolemesh.scheduling.prefix import PrefixMemory
from rolemesh.scheduling.scheduler import Scheduler

log = Logger(namespace="rolemesh.config_adoption")


class ConfigAdoption:
    """Adopts a reloaded config into the children, the scheduler's books
    and the prefix memory; retires what a reload removed once it is idle."""

    def __init__(
        self,
        supervisors: Mapping[str, DeviceSupervisor],
        scheduler: Scheduler,
        prefixes: PrefixMemory,
        config: Callable[[], NodeConfig],
        lanes_for: Callable[[ModelConfig], List[str]],
        forget_placements: Callable[[], None],
        cancel_idle: Callable[[str], None],
        arm_idle: Callable[[str], None] = lambda device: None,
    ) -> None:
        self._supervisors = supervisors
        self._scheduler = scheduler
        self._prefixes = prefixes
        self._config = config
        self._lanes_for = lanes_for
        self._forget_placements = forget_placements
        self._cancel_idle = cancel_idle
        self._arm_idle = arm_idle
        #: device -> (config, model) that retire_if_removed found still wanted.
        self._kept: Dict[str, Tuple[NodeConfig, str]] = {}

    def adopt(self, config: NodeConfig, previous: Optional[NodeConfig] = None) -> None:
        """The node now holds ``config``, in place of ``previous`` (see :meth:`Node.reconfigure`)."""
        if previous is not None:
            before = {m.model_id: m for m in previous.models}
            for model in config.models:
                old = before.get(model.model_id)
                if old is not None and needs_new_child(old, model):
                    for supervisor in self._supervisors.values():
                        supervisor.policy.replaced(model)  # its failures were the old command's
        self._forget_placements()
        self._prefixes.resize(config.prefix_memory_entries if config.prefix_affinity else 0)
        scheduler = self._scheduler
        scheduler.pending_limit = config.max_pending_requests_per_device
        current = {m.model_id: m for m in config.models}
        for name, supervisor in self._supervisors.items():
            for model in config.models:
                supervisor.retarget(model)  # a switch not yet spawned starts the current command
            held = supervisor.model
            if held is None:
                continue
            new = current.get(held.model_id)
            if new is not None and not needs_new_child(held, new):
                supervisor.model = new  # same command line: the running child serves it as is
                scheduler.restore(name, held.model_id)  # and if a reload before had replaced it: current again
                if supervisor.state in (STARTING, READY):  # removed, then added back unchanged: booked again
                    scheduler.model_loaded(name, new.model_id, new.parallel)
            elif new is not None:
                scheduler.supersede(name, held.model_id)  # what it admitted finishes on it; then one restart
            elif scheduler.devices[name].model == held.model_id:
                scheduler.model_unloaded(name, held.model_id)
            if scheduler.is_idle(name) and not self.retire_if_removed(name):
                self._arm_idle(name)  # the countdown restarts with the new idle_unload_s (none: it stops)

    def retire_if_removed(self, device: str) -> bool:
        """Stop an idle device's child whose model left the config, or may no
        longer run there (a reload gave it other ``devices``); True if it did."""
        supervisor = self._supervisors[device]
        held = supervisor.loading_or_loaded
        if held is None:
            return False
        config = self._config()
        kept = self._kept.get(device)
        if kept is not None and kept[0] is config and kept[1] == held:
            return False  # already found still wanted under this config (asked after every request)
        current = next((m for m in config.models if m.model_id == held), None)
        if current is not None and device in self._lanes_for(current):
            self._kept[device] = (config, held)
            return False
        why = "removed from the configuration" if current is None else "moved to other devices"
        log.info("unloading {model} from {device}: {why}", model=held, device=device, why=why)
        self._cancel_idle(device)
        supervisor.stop()
        return True
