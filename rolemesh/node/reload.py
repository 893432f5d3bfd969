"""Reload the configuration without a restart (SIGHUP, ``POST /v1/node/reload``).

A reload re-reads the base and override files the agent started with and
validates them exactly as start-up does.  An invalid file changes nothing:
the agent keeps serving with what it has and the one-line error is logged
and answered.  A valid one is compared with the running configuration
(:func:`plan`, pure) and applied at once where it can be:

- the folders of ``models_dir`` are listed again (by ``load_config``,
  :mod:`rolemesh.config.models_dir`): a GGUF file that appeared is a model added,
  one that went is a model removed;
- models added are servable at once (and preloaded if they say so);
- models removed leave ``/v1/models`` once idle: while requests for them
  run or wait they are still listed (marked ``leaving``; :func:`leaving`)
  and finish, new ones get 404; their child stops once its device has no
  request running or waiting;
- a model whose llama-server command changed restarts on its next use, once
  the requests in flight on its device are done;
- API keys rotate for the next request; the dispatcher gets a fresh
  registration (new models, roles, token, advertised URL);
- the other live keys (:data:`LIVE_KEYS`) take effect for what comes next.

Keys bound to things made once at start-up -- the listening socket, the
backend and its devices, the log set-up (:data:`RESTART_KEYS`) -- keep their
running value; the answer and the log name them as "needs a restart".

Parts that watch their own files (TLS certificates, ...) register with
:meth:`Reloader.add_self_reloading` and are asked to reload on every valid
reload, changed config or not.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Protocol, Sequence, Tuple

import attr
from twisted.logger import Logger

from rolemesh.backends.groups import GROUP_SEPARATOR
from rolemesh.base.errors import ConfigError
from rolemesh.children.restart_policy import same_command
from rolemesh.config.file import ModelConfig, NodeConfig, load_config

log = Logger(namespace="rolemesh.reload")

#: Top-level fields a reload applies while running.
LIVE_KEYS = frozenset({
    "models",
    "models_dir",  # rescanned by every reload (load_config): what it finds is applied as models are
    "preload",
    "api_keys",
    "dispatcher_token",
    "advertise_url",
    "max_pending_requests_per_device",
    "request_timeout_s",
    "shutdown_grace_s",
    "idle_unload_s",
    "require_auth_off_loopback",
    "tenants",
    "prefix_affinity",
    "prefix_memory_entries",
    "prefix_affinity_max_imbalance",
})

#: Top-level fields fixed at start-up: a change is reported, not applied.
RESTART_KEYS = tuple(
    f.name for f in attr.fields(NodeConfig) if f.name not in LIVE_KEYS
)

#: Fields whose values never appear in an answer or a log line.
SECRET_KEYS = frozenset({"api_keys", "tenants", "dispatcher_token"})

#: How :func:`plan` names a field in answers (``api_keys`` comes from four keys).
_SHOWN = {"api_keys": "api keys (api_key, api_keys, api_key_env, api_key_file)"}


def _restart_only(old: NodeConfig, new: NodeConfig) -> Tuple[str, ...]:
    """The fields that keep their running value in this reload: the
    restart keys, and ``advertise_url`` too when the listen address moved (by
    default it is derived from it; the agent still listens on the old one)."""
    listen_moved = (old.addresses, old.listen_port) != (new.addresses, new.listen_port)
    return RESTART_KEYS + (("advertise_url",) if listen_moved else ())


def check_groups(config: NodeConfig, groups: Sequence[str]) -> None:
    """Raise ConfigError for a model on a device group the node has no
    supervisor for: groups are made at start-up (pure)."""
    for i, model in enumerate(config.models):
        devices = getattr(model, "devices", ())
        if len(devices) > 1 and GROUP_SEPARATOR.join(devices) not in groups:
            raise ConfigError(
                f"models[{i}].devices: the device group {GROUP_SEPARATOR.join(devices)} is new; device groups "
                "are made at start-up, so this change needs a restart"
            )


def needs_new_child(old: ModelConfig, new: ModelConfig) -> bool:
    """True when ``new`` needs another child than ``old``: another
    llama-server command line, or other devices."""
    return not same_command(old, new)


def leaving(config: NodeConfig, pending: Iterable[ModelConfig]) -> Tuple[ModelConfig, ...]:
    """The models of ``pending`` (the records of the requests running or
    queued) that ``config`` no longer has -- a reload removed them, or their
    file left the models folder -- once each, in order: ``GET /v1/models``
    still lists them until those requests are done (pure)."""
    current = {m.model_id for m in config.models}
    out: Dict[str, ModelConfig] = {}
    for model in pending:
        if model.model_id not in current and model.model_id not in out:
            out[model.model_id] = model
    return tuple(out.values())


@attr.s(auto_attribs=True, frozen=True)
class ReloadPlan:
    """What a reload changes (model ids and top-level key names)."""

    added: Tuple[str, ...] = ()
    removed: Tuple[str, ...] = ()
    #: Models whose llama-server command changed: new child on next use.
    restarted: Tuple[str, ...] = ()
    #: Models changed otherwise (roles, preload, idle_unload_s): adopted as they run.
    updated: Tuple[str, ...] = ()
    #: Live top-level keys that changed (models excluded).
    applied: Tuple[str, ...] = ()
    #: Top-level keys that changed but keep their running value until a restart.
    needs_restart: Tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed or self.restarted or self.updated or self.applied)

    def to_json(self) -> Dict[str, Any]:
        return {
            "models": {
                "added": list(self.added),
                "removed": list(self.removed),
                "restart_on_next_use": list(self.restarted),
                "updated": list(self.updated),
            },
            "applied": list(self.applied),
            "needs_restart": list(self.needs_restart),
        }

    def summary(self) -> str:
        """One log line: what changed, without any secret value."""
        parts = []
        for label, items in (
            ("models added", self.added),
            ("models removed (leave once idle)", self.removed),
            ("models restarting on next use", self.restarted),
            ("models updated", self.updated),
            ("applied", self.applied),
        ):
            if items:
                parts.append(f"{label}: {', '.join(items)}")
        return "; ".join(parts) if parts else "nothing changed"


def plan(old: NodeConfig, new: NodeConfig) -> ReloadPlan:
    """Compare two validated configs (pure)."""
    before = {m.model_id: m for m in old.models}
    after = {m.model_id: m for m in new.models}
    added = tuple(m for m in after if m not in before)
    removed = tuple(m for m in before if m not in after)
    restarted: List[str] = []
    updated: List[str] = []
    for model_id, model in after.items():
        was = before.get(model_id)
        if was is None or was == model:
            continue
        (restarted if needs_new_child(was, model) else updated).append(model_id)
    applied: List[str] = []
    needs_restart: List[str] = []
    fixed = _restart_only(old, new)
    for field in attr.fields(NodeConfig):
        if field.name == "models" or getattr(old, field.name) == getattr(new, field.name):
            continue
        name = _SHOWN.get(field.name, field.name)
        (needs_restart if field.name in fixed else applied).append(name)
    return ReloadPlan(added, removed, tuple(restarted), tuple(updated), tuple(applied), tuple(needs_restart))


def effective(old: NodeConfig, new: NodeConfig) -> NodeConfig:
    """``new`` with every restart-only key kept at its running value: what
    the agent runs with after the reload (pure)."""
    return attr.evolve(new, **{name: getattr(old, name) for name in _restart_only(old, new)})


@attr.s(auto_attribs=True, frozen=True)
class ReloadResult:
    """The outcome of one reload: what ``POST /v1/node/reload`` answers."""

    ok: bool
    error: Optional[str] = None
    plan: ReloadPlan = ReloadPlan()
    #: One line per self-reloading part that had something to say.
    notes: Tuple[str, ...] = ()

    def to_json(self) -> Dict[str, Any]:
        body: Dict[str, Any] = {"reloaded": self.ok}
        if not self.ok:
            body["error"] = self.error
            return body
        body.update(self.plan.to_json())
        body["summary"] = self.plan.summary()
        if self.plan.needs_restart:
            keys = ", ".join(self.plan.needs_restart)
            body["message"] = f"needs a restart: {keys} (still running with the old value)"
        body["notes"] = list(self.notes)
        return body


#: A part that reloads itself: called with the running config after every
#: valid reload; returns a one-line note for the answer (or None); an
#: exception is logged and becomes a note, it does not undo the reload.
SelfReloading = Callable[[NodeConfig], Optional[str]]


# The parts a reload changes, as the Reloader sees them: they hold a Reloader
# or are built beside one (their modules import this one), so they are
# passed in, each behind what the reload asks of it.


class ReloadedService(Protocol):
    """The root service (:class:`rolemesh.service.NodeAgentService`): holds the running config."""

    config: NodeConfig


class ReloadedAPI(Protocol):
    """The API (:class:`rolemesh.api.app.NodeAPI`): keys, tenants, timeouts for the next request."""

    def use_config(self, config: NodeConfig) -> None: ...


class ReloadedNode(Protocol):
    """The node (:class:`rolemesh.node.node.Node`): models added, removed, changed
    (and its ``groups``, where it has them, for :func:`check_groups`)."""

    def reconfigure(self, config: NodeConfig) -> None: ...

    def preload(self, model: ModelConfig, device: Optional[str] = None) -> object: ...

    def preload_targets(self, model: ModelConfig) -> List[Optional[str]]: ...


class ReloadedDispatcher(Protocol):
    """The dispatcher client (:class:`rolemesh.fleet.dispatcher.DispatcherClient`): a fresh registration."""

    def reregister(self, token: Optional[str]) -> None: ...


class Reloader:
    """Re-reads the config files and applies them to the running parts.

    ``node`` (:class:`rolemesh.node.node.Node`), ``api``
    (:class:`rolemesh.api.app.NodeAPI`), ``service`` (the root service, which
    holds ``config``) and ``dispatcher`` (a DispatcherClient or None) are the
    parts changed.  ``check`` raises ConfigError for what only start-up
    knows (a preload device that is not on this node, ...).
    """

    def __init__(
        self,
        config_path: Optional[str],
        override_path: Optional[str],
        *,
        node: ReloadedNode,
        api: ReloadedAPI,
        service: ReloadedService,
        dispatcher: Optional[ReloadedDispatcher] = None,
        check: Callable[[NodeConfig], None] = lambda config: None,
        load: Callable[..., NodeConfig] = load_config,
        overrides: Optional[Mapping[str, Any]] = None,
    ) -> None:
        self.config_path = config_path
        self.override_path = override_path
        self.node = node
        self.api = api
        self.service = service
        self.dispatcher = dispatcher
        self._check = check
        self._load = load
        #: What the command line set over the files (``--log-format``).
        self._overrides = dict(overrides or {})
        self._self_reloading: List[Tuple[str, SelfReloading]] = []

    # -- the hook point for things that reload themselves ------------------------

    def add_self_reloading(self, name: str, reload_yourself: SelfReloading) -> None:
        """Ask ``reload_yourself(config)`` to reload on every valid reload
        (e.g. TLS certificates and keys re-read from their files)."""
        self._self_reloading.append((name, reload_yourself))

    def _reload_self_reloading(self, config: NodeConfig) -> Tuple[str, ...]:
        notes = []
        for name, reload_yourself in self._self_reloading:
            try:
                note = reload_yourself(config)
            except Exception as e:  # one failing part must not undo the rest
                log.failure("config reload: {name} could not reload", name=name)
                notes.append(f"{name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            else:
                if note:
                    notes.append(f"{name}: {note}")
        return tuple(notes)

    # -- reloading -------------------------------------------------------------------

    def reload(self, why: str = "requested") -> ReloadResult:
        """Re-read, validate, apply; never raises for a bad file."""
        if self.config_path is None:
            error = "reload: the agent was not started from a config file"
            log.error("config reload ({why}) failed: {error}", why=why, error=error)
            return ReloadResult(False, error)
        old: NodeConfig = self.service.config
        try:
            new = attr.evolve(self._load(self.config_path, self.override_path), **self._overrides)
            running = effective(old, new)
            self._check(running)
            check_groups(running, list(getattr(self.node, "groups", {})))
        except ConfigError as e:
            log.error("config reload ({why}) failed, still running the previous configuration: {error}",
                      why=why, error=str(e))
            return ReloadResult(False, str(e))
        changes = plan(old, new)
        self._apply(old, running, changes)
        notes = self._reload_self_reloading(running)
        log.info("config reloaded ({why}): {summary}", why=why, summary=changes.summary())
        if changes.needs_restart:
            log.warn("config reload: {keys} changed but needs a restart; still running with the old value",
                     keys=", ".join(changes.needs_restart))
        for note in notes:
            log.info("config reload: {note}", note=note)
        return ReloadResult(True, plan=changes, notes=notes)

    def _apply(self, old: NodeConfig, config: NodeConfig, changes: ReloadPlan) -> None:
        if not changes.changed:
            return
        self.service.config = config
        self.api.use_config(config)
        self.node.reconfigure(config)
        for model_id in changes.added:
            self._preload_added(config, model_id)
        if self.dispatcher is not None:
            self.dispatcher.reregister(config.dispatcher_token)

    def _preload_added(self, config: NodeConfig, model_id: str) -> None:
        model = config.model(model_id)
        devices: Sequence[Optional[str]] = [d for m, d in config.preload if m == model_id]
        if model.preload and None not in devices:
            devices = [*devices, *self.node.preload_targets(model)]  # as at start-up: min_replicas of them
        for device in devices:
            self.node.preload(model, device)
