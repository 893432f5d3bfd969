"""The interfaces the agent's parts meet at.  Every provider (fakes in the
tests included) is checked with ``zope.interface.verify.verifyObject``.

The ``I...Reactor`` names at the end are the exception: they name, for the
type checker, the sets of Twisted reactor interfaces a part needs from the
reactor it is given.  No reactor declares them; the real reactor provides
every one of their bases (``tests/test_reactor.py`` checks that).
"""

from __future__ import annotations

from twisted.internet.interfaces import (
    IReactorCore,
    IReactorPluggableNameResolver,
    IReactorProcess,
    IReactorTCP,
    IReactorThreads,
    IReactorTime,
)
from zope.interface import Attribute, Interface


class IDeviceBackend(Interface):
    """Discovers devices of one kind, samples their metrics, and says how a
    llama-server child is pinned to one of them.

    The scheduler and supervisor never branch on the backend: everything
    backend-specific goes through this interface.
    """

    name = Attribute("The backend's name: 'cuda', 'rocm', 'metal', 'sycl', 'vulkan' or 'cpu'.")

    def discover():
        """Return the list of :class:`~rolemesh.devices.DeviceRef` present.

        Called once at start-up, before the reactor serves anything, so it may
        block briefly.  Raises :class:`~rolemesh.backends.BackendUnavailable`
        with a one-line reason when the backend is not present on this host.
        """

    def sample(devices):
        """Sample metrics for ``devices`` (a sequence of DeviceRef).

        Returns a Deferred firing with a list of
        :class:`~rolemesh.devices.DeviceMetrics`, one per device, in order.
        Never blocks the reactor thread.  May fail; the caller then marks the
        previous samples stale.
        """

    def child_environment(device, base_environment):
        """Return the environment for a child pinned to ``device``: a new dict,
        ``base_environment`` plus the pin (e.g. ``CUDA_VISIBLE_DEVICES``)."""

    def child_arguments(device):
        """Return a mapping of llama-server flag -> value that the device wants
        unless the model sets the flag itself (e.g. ``cpu-range``, ``threads``)."""


class IHTTPClientReactor(IReactorTime, IReactorTCP, IReactorPluggableNameResolver):
    """What an HTTP client on the reactor needs: ``Agent`` and the connection
    pool schedule timeouts, ``HostnameEndpoint`` resolves names and connects."""


class IBackendReactor(IReactorTime, IReactorProcess, IReactorThreads):
    """What a device backend needs: it spawns the vendor tools and bounds them
    in time, and runs blocking library calls (NVML) on the thread pool."""


class IAgentReactor(IHTTPClientReactor, IBackendReactor, IReactorCore):
    """Everything the agent asks of the reactor it runs on; what the service
    tree is built with and hands on to its parts."""
