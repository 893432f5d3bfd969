"""Fakes for unit tests: a reactor that records spawned processes, a device
backend, and a controllable readiness probe.  Each provider passes
``verifyObject`` in ``tests.test_fakes``."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from twisted.internet import defer
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.interfaces import IProcessTransport, IReactorProcess
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from zope.interface import implementer

from rolemesh.config import ModelConfig, NodeConfig, validate
from rolemesh.devices import DeviceMetrics, DeviceRef
from rolemesh.interfaces import IDeviceBackend


@implementer(IProcessTransport)
class FakeProcess:
    """What ``spawnProcess`` returned; the test ends it with ``exit``/``kill``."""

    def __init__(self, reactor: "ProcessReactor", protocol: Any, argv: List[str], env: Dict[str, str], pid: int):
        self.reactor = reactor
        self.protocol = protocol
        self.argv = argv
        self.env = env
        self.pid: Optional[int] = pid
        self.signals: List[Any] = []
        self.ended = False
        protocol.makeConnection(self)

    # IProcessTransport
    def closeStdin(self) -> None:
        pass

    def closeStdout(self) -> None:
        pass

    def closeStderr(self) -> None:
        pass

    def closeChildFD(self, descriptor: int) -> None:
        pass

    def writeToChild(self, childFD: int, data: bytes) -> None:
        pass

    def loseConnection(self) -> None:
        pass

    def signalProcess(self, signalID: Any) -> None:
        self.signals.append(signalID)

    def write(self, data: bytes) -> None:
        pass

    def writeSequence(self, data: Sequence[bytes]) -> None:
        pass

    def getPeer(self) -> Any:
        return None

    def getHost(self) -> Any:
        return None

    # driving it
    def output(self, text: str, fd: int = 2) -> None:
        self.protocol.childDataReceived(fd, text.encode())

    def exit(self, code: int = 0, signal: Optional[int] = None) -> None:
        assert not self.ended, "process already ended"
        self.ended = True
        self.pid = None
        if code == 0 and signal is None:
            reason: Failure = Failure(ProcessDone(0))
        else:
            reason = Failure(ProcessTerminated(code if signal is None else None, signal))
        self.protocol.processEnded(reason)


@implementer(IReactorProcess)
class ProcessReactor(MemoryReactorClock):
    """A MemoryReactorClock that records spawnProcess calls."""

    def __init__(self) -> None:
        super().__init__()
        self.processes: List[FakeProcess] = []
        self._next_pid = 1000
        self.spawn_error: Optional[Exception] = None

    def spawnProcess(self, processProtocol, executable, args=(), env=None, path=None, uid=None, gid=None,
                     usePTY=0, childFDs=None):
        if self.spawn_error is not None:
            raise self.spawn_error
        self._next_pid += 1
        process = FakeProcess(self, processProtocol, list(args), dict(env or {}), self._next_pid)
        self.processes.append(process)
        return process

    @property
    def last(self) -> FakeProcess:
        return self.processes[-1]


class GroupSignals:
    """Records ``os.killpg`` calls; optionally ends the process on a signal."""

    def __init__(self, reactor: ProcessReactor) -> None:
        self.reactor = reactor
        self.calls: List[Tuple[int, int]] = []

    def __call__(self, pid: int, sig: int) -> None:
        self.calls.append((pid, sig))
        for p in self.reactor.processes:
            if p.pid == pid:
                p.signals.append(sig)


class StubbornSignals(GroupSignals):
    """Like :class:`GroupSignals`, and the children answer as llama-server
    can while it is stopped: the first SIGTERM is ignored, the second ends
    the child with status ``code`` ("Received second interrupt, terminating
    immediately": status 1), SIGKILL ends it killed.  The end comes on the
    reactor's next turn (``advance(0)``), as a real child's is reaped."""

    def __init__(self, reactor: ProcessReactor, code: int = 1) -> None:
        super().__init__(reactor)
        self.code = code
        self.terms: Dict[int, int] = {}

    def __call__(self, pid: int, sig: int) -> None:
        super().__call__(pid, sig)
        process = next((p for p in self.reactor.processes if p.pid == pid and not p.ended), None)
        if process is None:
            return
        if sig == 9:  # SIGKILL
            self.reactor.callLater(0, self._end, process, None, 9)
        elif sig == 15:  # SIGTERM
            self.terms[pid] = self.terms.get(pid, 0) + 1
            if self.terms[pid] == 2:
                self.reactor.callLater(0, self._end, process, self.code, None)

    @staticmethod
    def _end(process: FakeProcess, code: Optional[int], signal: Optional[int]) -> None:
        if not process.ended:
            process.exit(code or 0, signal=signal)


class FakeProbe:
    """A readiness probe the test answers: ``ready`` names models whose
    children answer; everything else is 'not yet'."""

    def __init__(self) -> None:
        self.ready: set = set()
        self.calls: List[Tuple[str, str]] = []
        self.hang = False
        self.pending: List[defer.Deferred] = []

    def __call__(self, base_url: str, served_name: str) -> "defer.Deferred[bool]":
        self.calls.append((base_url, served_name))
        if self.hang:
            d: defer.Deferred = defer.Deferred()
            self.pending.append(d)
            return d
        return defer.succeed(served_name in self.ready)


@implementer(IDeviceBackend)
class FakeBackend:
    """A backend with N fake devices and scripted samples."""

    name = "fake"

    def __init__(self, count: int = 1, free: int = 8 << 30) -> None:
        self.refs = [
            DeviceRef("fake", i, f"gpu:{i}", uuid=f"GPU-{i}", vendor="Fake", model="Fake GPU",
                      memory_total_bytes=16 << 30)
            for i in range(count)
        ]
        self.free = free
        self.fail_with: Optional[Exception] = None
        self.hang = False
        self.samples = 0

    def discover(self) -> List[DeviceRef]:
        return list(self.refs)

    def sample(self, devices: Sequence[DeviceRef]) -> "defer.Deferred[List[DeviceMetrics]]":
        self.samples += 1
        if self.hang:
            return defer.Deferred()
        if self.fail_with is not None:
            return defer.fail(self.fail_with)
        return defer.succeed(
            [DeviceMetrics(d.name, 0.0, d.memory_total_bytes, (16 << 30) - self.free, self.free, 10.0)
             for d in devices]
        )

    def child_environment(self, device: DeviceRef, base_environment: Mapping[str, str]) -> Dict[str, str]:
        return {**base_environment, "FAKE_VISIBLE_DEVICES": str(device.index)}

    def child_arguments(self, device: DeviceRef) -> Dict[str, Any]:
        return {}


def make_config(models: Sequence[Dict[str, Any]] = (), **top: Any) -> NodeConfig:
    """A validated NodeConfig without touching the filesystem."""
    data: Dict[str, Any] = {"node_id": "test-node", "state_dir": "/nonexistent/state", **top}
    data["models"] = [dict({"path": f"/models/{m['model_id']}.gguf"}, **m) for m in models]
    return validate(data, check_files=False, environ={})


def model(config: NodeConfig, model_id: str) -> ModelConfig:
    return config.model(model_id)


def stub_answer(treq: Any, d: "defer.Deferred[Any]") -> Tuple[Any, bytes]:
    """The response and whole body of a request sent through a
    ``treq.testing.StubTreq``: flushed until both are there."""
    treq.flush()
    results: List[Any] = []
    d.addBoth(results.append)
    assert results, "no response yet"
    response = results[0]
    if not hasattr(response, "code"):
        response.raiseException()
    bodies: List[Any] = []
    treq.content(response).addBoth(bodies.append)
    treq.flush()
    assert bodies and isinstance(bodies[0], bytes), bodies
    return response, bodies[0]
