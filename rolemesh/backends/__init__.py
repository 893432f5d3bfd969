"""Device backends: one module per kind of hardware, each an
:class:`~rolemesh.base.interfaces.IDeviceBackend` provider (``CpuBackend``,
``CudaBackend``, ``RocmBackend``, ``VulkanBackend``, ``SyclBackend``,
``MetalBackend``), which one a host has (:mod:`~rolemesh.backends.detect`)
and device groups (:mod:`~rolemesh.backends.groups`).

They know nothing of serving (contract ``backends-serve-nothing``): they
may import :mod:`rolemesh.config`, :mod:`rolemesh.event_loop` and
:mod:`rolemesh.base`."""

from __future__ import annotations


class BackendUnavailable(Exception):
    """The configured backend is not present on this host; ``str()`` says why."""
