"""The whole service tree of :func:`rolemesh.service.make_service` on fakes:
a recording reactor, fake children and probe, a fake backend, config files
in a temporary folder (so reloads re-read real files), no real time."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
from typing import Any, Dict, Mapping, Optional, Sequence

import yaml
from treq.testing import StubTreq
from twisted.internet import defer

from rolemesh.service import NodeAgentService, make_service
from rolemesh.supervisor import DeviceSupervisor
from tests.fakes import FakeBackend, FakeProbe, GroupSignals, ProcessReactor, stub_answer

BINARY = "/opt/llama/llama-server"


class ServiceHarness:
    """``make_service`` with fakes; ``write()`` rewrites the config file."""

    def __init__(self, config: Dict[str, Any], devices: int = 1,
                 environ: Optional[Mapping[str, str]] = None, override: Optional[Dict[str, Any]] = None) -> None:
        self.directory = tempfile.mkdtemp(prefix="rm-svc-")
        self.reactor = ProcessReactor()
        self.probe = FakeProbe()
        self.signals = GroupSignals(self.reactor)
        self.backend = FakeBackend(count=devices)
        self.config_path = os.path.join(self.directory, "agent.yaml")
        self.override_path = os.path.join(self.directory, "local.yaml") if override is not None else None
        self.write(config)
        if override is not None:
            self.write(override, override=True)
        from rolemesh.config import load_config

        ports = itertools.count(21000)

        def supervisor(device: Any, backend: Any, config: Any, binary: str, reactor: Any, pidfiles: Any,
                       **kw: Any) -> Any:
            return DeviceSupervisor(device, backend, config, binary, reactor=reactor, probe=self.probe,
                                    pick_port=lambda: next(ports), signal_group=self.signals,
                                    environ={"PATH": "/usr/bin"}, pidfiles=pidfiles, **kw)

        self.root: NodeAgentService = make_service(
            load_config(self.config_path, self.override_path),
            reactor=self.reactor,
            backend=self.backend,
            devices=self.backend.refs,
            binary=BINARY,
            supervisor_factory=supervisor,
            config_paths=(self.config_path, self.override_path),
            environ=environ or {},
        )
        assert self.root.reloader is not None
        self.api = self.root.reloader.api
        self.treq: Any = StubTreq(self.api.resource())

    def model_file(self, name: str) -> str:
        path = os.path.join(self.directory, f"{name}.gguf")
        if not os.path.exists(path):
            with open(path, "wb") as f:
                f.write(b"GGUF")
        return path

    def write(self, config: Dict[str, Any], override: bool = False) -> None:
        """Write the base (or override) file; models get a file of their own."""
        data = dict(config)
        if not override:
            data.setdefault("node_id", "svc-node")
            data.setdefault("state_dir", os.path.join(self.directory, "state"))
            data.setdefault("listen_port", 0)
        models = []
        for m in data.get("models") or []:
            m = dict(m)
            if not override:
                m.setdefault("path", self.model_file(m["model_id"]))
            models.append(m)
        if "models" in data:
            data["models"] = models
        path = self.override_path if override else self.config_path
        assert path is not None
        with open(path, "w", encoding="utf-8") as f:
            f.write(yaml.safe_dump(data))

    def write_text(self, text: str) -> None:
        with open(self.config_path, "w", encoding="utf-8") as f:
            f.write(text)

    def start(self) -> None:
        self.root._install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self.root._install_reload_signal = lambda: None  # type: ignore[method-assign]
        self.root.startService()

    def stop(self) -> "defer.Deferred[None]":
        d = self.root.stopService()
        self.reactor.advance(0)
        return d

    def cleanup(self) -> None:
        if self.root.state_lock is not None:
            self.root.state_lock.release()
        shutil.rmtree(self.directory, ignore_errors=True)

    # -- HTTP in memory ------------------------------------------------------------

    def call(self, method: str, path: str, body: Any = None, key: Optional[str] = None) -> Any:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        data = json.dumps(body).encode() if body is not None else None
        response, body = stub_answer(self.treq, self.treq.request(method, "http://node.test" + path, data=data,
                                                                 headers=headers))
        return response.code, json.loads(body) if body else None

    # -- children --------------------------------------------------------------------

    def answer(self, *served: str) -> None:
        self.probe.ready |= set(served)
        self.reactor.advance(self.root.config.llama_server_probe_interval_s)

    def live_children(self) -> Sequence[Any]:
        return [p for p in self.reactor.processes if not p.ended]
