"""Device backends: one module per kind of hardware, each an
:class:`~rolemesh.base.interfaces.IDeviceBackend` provider."""

from __future__ import annotations


class BackendUnavailable(Exception):
    """The configured backend is not present on this host; ``str()`` says why."""
