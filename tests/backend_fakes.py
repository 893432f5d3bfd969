"""Fakes for the device backends' tests: recorded tool answers, a process-spawning clock, and a
pynvml stand-in.  Nothing here touches the real PATH, processes or NVIDIA driver."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from twisted.internet import error
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock

from rolemesh.backends.commands import Result, ToolNotFound

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "backends")


def fixture(name: str) -> str:
    """The text of one recorded tool output under tests/fixtures/backends."""
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as f:
        return f.read()


Answer = Union[Result, Exception]


class FakeTools:
    """Recorded answers per argv; stands in for run_sync, run_async and shutil.which."""

    def __init__(self, answers: Optional[Dict[Tuple[str, ...], Answer]] = None, on_path: Sequence[str] = ()):
        self.answers: Dict[Tuple[str, ...], Answer] = dict(answers or {})
        self.on_path = set(on_path) | {argv[0] for argv in self.answers}
        self.calls: List[Tuple[str, ...]] = []
        self.envs: List[Optional[Dict[str, str]]] = []

    def which(self, tool: str) -> Optional[str]:
        return f"/usr/bin/{tool}" if tool in self.on_path else None

    def _answer(self, argv: Sequence[str]) -> Result:
        key = tuple(argv)
        self.calls.append(key)
        if key[0] not in self.on_path:
            raise ToolNotFound(f"{key[0]}: not found on PATH")
        answer = self.answers.get(key)
        if answer is None:
            raise AssertionError(f"unexpected command: {key}")
        if isinstance(answer, Exception):
            raise answer
        return answer

    def run_sync(self, argv: Sequence[str], timeout: float = 10.0, **kwargs: Any) -> Result:
        self.envs.append(kwargs.get("env"))
        return self._answer(argv)

    def run_async(self, reactor: Any, argv: Sequence[str], timeout: float = 10.0) -> "Deferred[Result]":
        try:
            return succeed(self._answer(argv))
        except Exception as e:
            return fail(e)

    def options(self) -> Dict[str, Any]:
        """Constructor keywords for a CommandBackend that uses these fakes."""
        return {"run_sync": self.run_sync, "run_async": self.run_async, "which": self.which}


def ok(text: str) -> Result:
    """A run that exited 0 with ``text`` on stdout."""
    return (0, text, "")


class FakeProcessTransport:
    """What spawnProcess hands back: records signals and the stdin close."""

    def __init__(self) -> None:
        self.signals: List[str] = []
        self.stdin_closed = False
        self.ended = False
        self.pid = 4242

    def closeStdin(self) -> None:
        self.stdin_closed = True

    def signalProcess(self, signal: str) -> None:
        if self.ended:
            raise error.ProcessExitedAlready()
        self.signals.append(signal)


class ProcessClock(Clock):
    """A Clock that also 'spawns' processes: the test drives each protocol by hand."""

    def __init__(self, spawn_error: Optional[Exception] = None) -> None:
        super().__init__()
        self.spawned: List[SimpleNamespace] = []
        self.spawn_error = spawn_error

    def spawnProcess(
        self,
        protocol: Any,
        executable: str,
        args: Sequence[str] = (),
        env: Any = None,
        path: Any = None,
        uid: Any = None,
        gid: Any = None,
        usePTY: Any = 0,
        childFDs: Any = None,
    ) -> FakeProcessTransport:
        if self.spawn_error is not None:
            raise self.spawn_error
        transport = FakeProcessTransport()
        protocol.makeConnection(transport)
        self.spawned.append(
            SimpleNamespace(
                protocol=protocol, executable=executable, args=list(args), env=env, transport=transport
            )
        )
        return transport


class FakeNVMLError(Exception):
    """pynvml.NVMLError's stand-in."""


class FakeNvml:
    """Enough of pynvml for the cuda backend.  ``gpus`` are dicts: name, uuid, total, used, free,
    util, temp, power_mw (None = the call raises NVMLError), optionally ``mig`` (a list of the same)."""

    NVMLError = FakeNVMLError
    NVML_TEMPERATURE_GPU = 0
    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(
        self,
        gpus: List[Dict[str, Any]],
        v2: bool = True,
        v2_fails: bool = False,
        init_error: Optional[Exception] = None,
    ) -> None:
        self.gpus = gpus
        if v2:
            self.nvmlMemory_v2 = 0x02000028
        self.v2_fails = v2_fails
        self.init_error = init_error
        self.memory_calls: List[Any] = []
        self.initialised = False
        self.shut_down = False

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def _info(self, handle: Tuple[Any, ...]) -> Dict[str, Any]:
        if handle[0] == "gpu":
            return self.gpus[handle[1]]
        return self.gpus[handle[1]]["mig"][handle[2]]

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Tuple[Any, ...]:
        if self.gpus[i].get("lost"):
            raise FakeNVMLError("GPU is lost")
        return ("gpu", i)

    def nvmlDeviceGetHandleByUUID(self, uuid: Any) -> Tuple[Any, ...]:
        for i, gpu in enumerate(self.gpus):
            if gpu["uuid"] == uuid:
                return ("gpu", i)
            for j, mig in enumerate(gpu.get("mig") or []):
                if mig["uuid"] == uuid:
                    return ("mig", i, j)
        raise FakeNVMLError("Not Found")

    def nvmlDeviceGetName(self, handle: Tuple[Any, ...]) -> bytes:
        return self._info(handle)["name"].encode()  # old bindings answer bytes

    def nvmlDeviceGetUUID(self, handle: Tuple[Any, ...]) -> str:
        return self._info(handle)["uuid"]

    def nvmlDeviceGetMemoryInfo(self, handle: Tuple[Any, ...], version: Any = None) -> SimpleNamespace:
        self.memory_calls.append(version)
        if version is not None and self.v2_fails:
            raise FakeNVMLError("Function Not Found")
        info = self._info(handle)
        if info.get("memory_error"):
            raise FakeNVMLError(info["memory_error"])
        recorded = info.get("memory_v1" if version is None else "memory_v2")
        if recorded:  # a recorded GPU (record_nvidia.py): each call's own answer
            return SimpleNamespace(**recorded)
        return SimpleNamespace(total=info["total"], used=info["used"], free=info["free"])

    def _value(self, handle: Tuple[Any, ...], key: str) -> Any:
        value = self._info(handle).get(key)
        if value is None:
            raise FakeNVMLError("Not Supported")
        return value

    def nvmlDeviceGetUtilizationRates(self, handle: Tuple[Any, ...]) -> SimpleNamespace:
        return SimpleNamespace(gpu=self._value(handle, "util"), memory=0)

    def nvmlDeviceGetTemperature(self, handle: Tuple[Any, ...], sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._value(handle, "temp")

    def nvmlDeviceGetPowerUsage(self, handle: Tuple[Any, ...]) -> int:
        return self._value(handle, "power_mw")

    def nvmlDeviceGetMigMode(self, handle: Tuple[Any, ...]) -> List[int]:
        if handle[0] != "gpu":
            raise FakeNVMLError("Not Supported")
        return [1, 1] if "mig" in self._info(handle) else [0, 0]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Tuple[Any, ...]) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Tuple[Any, ...], j: int) -> Tuple[Any, ...]:
        migs = self._info(handle).get("mig") or []
        if j >= len(migs):
            raise FakeNVMLError("Not Found")
        return ("mig", handle[1], j)


def recorded_nvml(name: str, **kw: Any) -> FakeNvml:
    """A FakeNvml answering what a real host answered (``nvml_<host>.json``,
    written by ``tests/fixtures/record_nvidia.py``)."""
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as f:
        return FakeNvml(json.load(f)["gpus"], **kw)


def h100(i: int, **overrides: Any) -> Dict[str, Any]:
    """One fake H100's NVML answers."""
    gpu = {
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd",
        "total": 85520809984,
        "used": 1293942784,
        "free": 83666599936,
        "util": 17,
        "temp": 34,
        "power_mw": 71520,
    }
    gpu.update(overrides)
    return gpu
