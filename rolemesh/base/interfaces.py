"""The interfaces the agent's parts meet at.  Every provider (fakes in the
tests included) is checked with ``zope.interface.verify.verifyObject``.

The ``I...Reactor`` names at the end are the exception: they name, for the
type checker, the sets of Twisted reactor interfaces a part needs from the
reactor it is given.  No reactor declares them; the real reactor provides
every one of their bases (``tests/event_loop/test_reactor.py`` checks that).

The ``typing.Protocol`` classes after them are not interfaces either: they
describe, for the type checker only, parts that share no declared interface:
the requests the API answers, which come from two places (Klein's
``twisted.web`` requests and the fast channel's), what the proxy sends
its requests with, and what a lower part reads of the higher one that
builds it (the fast channel of its site), so that it need not import it.
"""

from __future__ import annotations

from typing import Callable, List, Mapping, Optional, Protocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import (
    IProducer,
    IReactorCore,
    IReactorPluggableNameResolver,
    IReactorProcess,
    IReactorTCP,
    IReactorThreads,
    IReactorTime,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer, IResponse
from zope.interface import Attribute, Interface

from rolemesh.base.errors import ApiError


class IDeviceBackend(Interface):
    """Discovers devices of one kind, samples their metrics, and says how a
    llama-server child is pinned to one of them.

    The scheduler and supervisor never branch on the backend: everything
    backend-specific goes through this interface.
    """

    name = Attribute("The backend's name: 'cuda', 'rocm', 'metal', 'sycl', 'vulkan' or 'cpu'.")

    def discover():
        """Return the list of :class:`~rolemesh.base.devices.DeviceRef` present.

        Called once at start-up, before the reactor serves anything, so it may
        block briefly.  Raises :class:`~rolemesh.backends.BackendUnavailable`
        with a one-line reason when the backend is not present on this host.
        """

    def sample(devices):
        """Sample metrics for ``devices`` (a sequence of DeviceRef).

        Returns a Deferred firing with a list of
        :class:`~rolemesh.base.devices.DeviceMetrics`, one per device, in order.
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


class ReadableBody(Protocol):
    """A request's body, whole: ``request.content``."""

    def read(self) -> bytes: ...


class EditableHeaders(Protocol):
    """Response headers as the proxy edits them: ``twisted.web``'s
    ``Headers`` and the fast channel's ``ResponseHeaders`` both are."""

    def setRawHeaders(self, name: bytes, values: List[bytes], /) -> None: ...

    def removeHeader(self, name: bytes, /) -> None: ...


class HeadPolicy(Protocol):
    """What the listener asks of a request head before it reads the body
    (:class:`~rolemesh.api.app.NodeAPI` answers): the key, and whether the route
    exists."""

    def refuse_head(self, method: bytes, path: bytes, headers: Mapping[bytes, bytes], /) -> Optional[ApiError]:
        """The answer to give instead of serving the request, or None.
        ``path`` has no query; ``headers`` are ``{lower-case name: value}``."""

    def cors_origin(self, origin: bytes, /) -> Optional[bytes]:
        """The ``Access-Control-Allow-Origin`` value for a request from
        ``origin`` (its ``Origin`` header), or None: not allowed."""


class ChannelSite(Protocol):
    """What a :class:`~rolemesh.http.fast_channel.FastChannel` reads of the site
    that builds it (:class:`~rolemesh.http.listener.GuardedSite`, whose module
    imports the channel's): the clock, the head policy, the limits, the
    ``Date`` header, and the count of open connections it gives back when
    it closes."""

    open_connections: int

    @property
    def reactor(self) -> IReactorTime: ...

    @property
    def head_policy(self) -> Optional[HeadPolicy]: ...

    @property
    def max_body_bytes(self) -> Optional[int]: ...

    @property
    def request_read_timeout(self) -> Optional[float]: ...

    @property
    def timeOut(self) -> Optional[float]:  # noqa: N802 - twisted.web's name
        """The idle timeout (twisted.web's ``HTTPFactory.timeOut``)."""

    @property
    def http_date(self) -> Callable[[], bytes]:
        """The current ``Date`` header value, cached per second."""


class RouteRequest(Protocol):
    """What the API's routes and their error answers use of a request: part
    of ``IRequest``, and all that :class:`~rolemesh.http.fast_channel.FastRequest`
    needs to be for them."""

    @property
    def path(self) -> bytes: ...

    @property
    def content(self) -> Optional[ReadableBody]:
        """The body (None on a ``twisted.web`` request only before its body
        began or after it was finished)."""

    def getHeader(self, name: bytes, /) -> Optional[bytes]: ...

    def setHeader(self, name: bytes, value: bytes, /) -> None: ...

    def setResponseCode(self, code: int, message: Optional[bytes] = None, /) -> None: ...


class ProxiedRequest(RouteRequest, Protocol):
    """A request the proxy relays an answer to: ``twisted.web``'s ``Request``
    (the Klein routes) or :class:`~rolemesh.http.fast_channel.FastRequest` (the
    fast path).  More than ``IRequest`` declares: the status set so far, the
    finish notification, the producer and the connection
    (``rolemesh/http/listener.py`` has the type checker check both kinds)."""

    @property
    def code(self) -> int: ...

    @property
    def responseHeaders(self) -> EditableHeaders: ...

    def write(self, data: bytes, /) -> None: ...

    def notifyFinish(self) -> Deferred[None]: ...

    def registerProducer(self, producer: IProducer, streaming: bool, /) -> None: ...

    def unregisterProducer(self) -> None: ...

    def loseConnection(self) -> None: ...


class ChildRequester(Protocol):
    """What the proxy sends its requests to children with: ``IAgent.request``,
    as :class:`~rolemesh.http.child_client.ChildAgent` (which does not declare
    ``IAgent``) has it."""

    def request(self, method: bytes, uri: bytes, headers: Optional[Headers] = None,
                bodyProducer: Optional[IBodyProducer] = None, /) -> Deferred[IResponse]: ...
