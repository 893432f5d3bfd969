"""Choosing and building the device backend, and applying the ``devices`` allow-list.

``backend: auto`` trusts hardware before software: the PCI functions under
``/sys/bus/pci/devices`` say which GPUs are really in the box, so a leftover
``nvidia-smi`` on an AMD host cannot make it pick ``cuda``.  A vendor's GPU
counts once that vendor's tooling is installed (an Intel iGPU without oneAPI
is no reason to fail); with an NVIDIA or AMD GPU but none of its vendor's
tools, ``vulkaninfo`` will do.  Only where PCI cannot be read at all (no sysfs) are the tools asked
directly, and only an answer that lists a device counts.  Otherwise: ``cpu``.
The reason string says which rule decided; ``--check`` prints it.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import sys
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import attr

from rolemesh.backends.commands import (
    PCI_VENDORS,
    Result,
    ToolError,
    checked,
    run_sync,
)
from rolemesh.base.devices import DeviceRef
from rolemesh.base.errors import ConfigError
from rolemesh.base.interfaces import IBackendReactor, IDeviceBackend
from rolemesh.config.file import BACKEND_NAMES, CpuDevices

#: PCI vendor id -> the backend its GPUs want, in the order auto-detection prefers them.
VENDOR_BACKENDS = ((0x10DE, "cuda"), (0x1002, "rocm"), (0x8086, "sycl"))

#: The tools whose presence shows a backend's software is installed.
BACKEND_TOOLS: Dict[str, Tuple[str, ...]] = {
    "cuda": ("nvidia-smi",),
    "rocm": ("amd-smi", "rocm-smi"),
    "sycl": ("sycl-ls",),
    "vulkan": ("vulkaninfo",),
}

#: Where no sysfs can be read: the command per backend that must answer with a device.
PROBES: Tuple[Tuple[str, Tuple[str, ...], str], ...] = (
    ("cuda", ("nvidia-smi", "-L"), "GPU "),
    ("rocm", ("amd-smi", "list"), "GPU"),
    ("rocm", ("rocm-smi", "--showid"), "GPU"),
    ("sycl", ("sycl-ls",), "level_zero:gpu"),
)


@attr.s(auto_attribs=True, frozen=True)
class PciFunction:
    """One PCI function that is a GPU or accelerator: address, vendor id, class code."""

    address: str
    vendor: int
    pci_class: int

    @property
    def vendor_name(self) -> str:
        """The vendor's name, or its id in hex when unknown."""
        return PCI_VENDORS.get(self.vendor, f"0x{self.vendor:04x}")


def is_accelerator(vendor: int, pci_class: int) -> bool:
    """Display controllers (class 0x03), and processing accelerators (0x12) except Intel's NPUs."""
    base = pci_class >> 16
    if base == 0x03:
        return True
    return base == 0x12 and vendor != 0x8086


def _read_hex(path: str) -> Optional[int]:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().strip(), 16)
    except (OSError, ValueError):
        return None


def scan_pci(sysfs_root: str = "/sys") -> Optional[List[PciFunction]]:
    """The GPU/accelerator PCI functions under ``<sysfs_root>/bus/pci/devices``; None if unreadable."""
    base = os.path.join(sysfs_root, "bus", "pci", "devices")
    try:
        addresses = sorted(os.listdir(base))
    except OSError:
        return None
    if not addresses:
        return None
    found = []
    for address in addresses:
        vendor = _read_hex(os.path.join(base, address, "vendor"))
        pci_class = _read_hex(os.path.join(base, address, "class"))
        if vendor is None or pci_class is None or not is_accelerator(vendor, pci_class):
            continue
        found.append(PciFunction(address=address, vendor=vendor, pci_class=pci_class))
    return found


Lookup = Callable[[str], Optional[str]]


def _installed(backend: str, which: Lookup, find_library: Lookup) -> bool:
    if backend == "cuda":
        return bool(which("nvidia-smi") or find_library("nvidia-ml"))
    return any(which(tool) for tool in BACKEND_TOOLS.get(backend, ()))


def _tools_text(backend: str) -> str:
    tools = BACKEND_TOOLS[backend]
    if backend == "cuda":
        return "neither nvidia-smi nor libnvidia-ml is installed"
    if len(tools) == 1:
        return f"{tools[0]} is not on PATH"
    return "neither " + " nor ".join(tools) + " is on PATH"


def _probe_answers(run: Callable[..., Result], argv: Sequence[str], marker: str) -> bool:
    try:
        out = checked(argv[0], run(argv, 10.0))
    except ToolError:
        return False
    return marker in out


def select_backend(
    configured: str,
    *,
    sysfs_root: str = "/sys",
    which: Callable[[str], Optional[str]] = shutil.which,
    platform: str = sys.platform,
    run: Callable[..., Result] = run_sync,
    find_library: Callable[[str], Optional[str]] = ctypes.util.find_library,
) -> Tuple[str, str]:
    """(backend name, one-line reason): ``configured`` as is, or what ``auto`` picks on this host."""
    if configured != "auto":
        if configured not in BACKEND_NAMES:
            raise ConfigError(
                f"backend: expected one of auto, {', '.join(BACKEND_NAMES)}, got {configured!r}"
            )
        return configured, f"configured as backend: {configured}"
    if platform == "darwin":
        return "metal", "macOS: Metal"
    functions = scan_pci(sysfs_root)
    if functions is None:
        for backend, argv, marker in PROBES:
            if which(argv[0]) and _probe_answers(run, argv, marker):
                return backend, f"no PCI information under {sysfs_root}; `{' '.join(argv)}` lists a device"
        return "cpu", f"no PCI information under {sysfs_root} and no GPU tool answers"
    skipped: List[str] = []
    for vendor, backend in VENDOR_BACKENDS:
        matches = [f for f in functions if f.vendor == vendor]
        if not matches:
            continue
        evidence = f"PCI vendor 0x{vendor:04x} ({PCI_VENDORS[vendor]}) found at {matches[0].address}"
        if _installed(backend, which, find_library):
            return backend, evidence
        skipped.append(f"{evidence} but {_tools_text(backend)}")
    if any(f.vendor in (0x10DE, 0x1002) for f in functions) and which("vulkaninfo"):
        return "vulkan", "; ".join(skipped) + "; vulkaninfo is installed"
    if skipped:
        return "cpu", "; ".join(skipped) + "; using cpu"
    return "cpu", "no GPU or accelerator on the PCI bus"


def make_backend(
    name: str,
    *,
    cpu_devices: Optional[CpuDevices] = None,
    reactor: Optional[IBackendReactor] = None,
    sysfs_root: str = "/sys",
    **options: Any,
) -> IDeviceBackend:
    """Build the IDeviceBackend provider called ``name`` (``options`` go to its constructor).

    ``cpu_devices`` only shapes the ``cpu`` backend; with any other backend it is ignored, so one
    config can say how to split the CPUs for the hosts where ``auto`` ends up on ``cpu``.
    """
    if name == "cpu":
        from rolemesh.backends.cpu import CpuBackend

        return CpuBackend(cpu_devices=cpu_devices, reactor=reactor, sysfs_root=sysfs_root, **options)
    if name == "cuda":
        from rolemesh.backends.cuda import CudaBackend

        return CudaBackend(reactor, **options)
    if name == "rocm":
        from rolemesh.backends.rocm import RocmBackend

        return RocmBackend(reactor, **options)
    if name == "metal":
        from rolemesh.backends.metal import MetalBackend

        return MetalBackend(reactor, **options)
    if name == "sycl":
        from rolemesh.backends.sycl import SyclBackend

        return SyclBackend(reactor, **options)
    if name == "vulkan":
        from rolemesh.backends.vulkan import VulkanBackend

        return VulkanBackend(reactor, **options)
    raise ConfigError(f"backend: expected one of {', '.join(BACKEND_NAMES)}, got {name!r}")


def filter_devices(devices: Iterable[DeviceRef], allow_list: Optional[Sequence[str]]) -> List[DeviceRef]:
    """The devices the allow-list names (by name or uuid), in discovery order; absent ones: ConfigError."""
    devices = list(devices)
    if not allow_list:
        return devices
    wanted = set()
    for entry in allow_list:
        match = next((d for d in devices if entry in (d.name, d.uuid)), None)
        if match is None:
            found = ", ".join(d.name for d in devices) or "none"
            raise ConfigError(f'devices: "{entry}" is not present (found: {found})')
        wanted.add(match.name)
    return [d for d in devices if d.name in wanted]
