"""One route table, two routers.

The API declares each route once, as a :class:`Route` in a table
(``ROUTES`` in rolemesh/api/app.py).  From that table :func:`klein_app` builds
the Klein routes (every request twisted.web parses) and :func:`fast_dispatch`
the fast path's ``(method, path) -> route`` map
(:class:`rolemesh.http.fast_channel.FastChannel`), so a route cannot exist in one
and not the other, and a fast route is always a Klein route with the same
method and path.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Callable, Dict, FrozenSet, Iterable, Optional, Sequence, Tuple, Type

import attr
from klein import Klein
from twisted.internet import defer
from twisted.python.failure import Failure

from rolemesh.http.fast_channel import FastRoute

#: A werkzeug path parameter (``<device>``): a path with one is no fast route.
_PARAMETER = re.compile(r"<[^>]*>")

#: What a relayed route asks of its model's child.  ``GENERATE``: a
#: generation slot, queued like chat (fair order, caps, switches).
#: ``TOKENS``: the child only (tokenize, count tokens, apply a template):
#: served at once by a ready child of the model, beside its generations,
#: with no switch under it; where none is ready, queued like ``GENERATE``
#: to load it.  ``PASSTHROUGH``: ``/upstream/<model>/<path>``, any method
#: and path to that model's child (rolemesh/api/upstream.py).
GENERATE = "generate"
TOKENS = "tokens"
PASSTHROUGH = "passthrough"
#: How a relayed route's body names its model: a JSON object's ``model``, a
#: multipart form's ``model`` field (``/v1/audio/transcriptions``), or the
#: ``model`` its ``instances`` share (Vertex AI's ``/predict``, rolemesh/config/vertex_ai.py).
JSON_BODY = "json"
FORM_BODY = "form"
INSTANCES_BODY = "instances"


@attr.s(frozen=True, slots=True, auto_attribs=True)
class Route:
    """One route of the API.

    ``handler`` is a dotted attribute path from the object serving the routes
    (``"node_routes.inventory"``), called with the request and the path's
    parameters; for a route ``relayed`` to llama-server, with the request,
    the route itself and the path's parameters.  ``relayed`` is the endpoint
    name its requests are logged and counted under; ``use`` what it needs
    of the child (:data:`GENERATE`, :data:`TOKENS`, :data:`PASSTHROUGH`),
    ``body`` how its body names the model.  ``fast``: the fast path serves
    it too (an exact path; a handler that is not relayed answers at once,
    with bytes).  ``open``: no API key needed."""

    method: str
    path: str
    handler: str
    fast: bool = False
    open: bool = False
    relayed: Optional[str] = None
    use: str = GENERATE
    body: str = JSON_BODY

    def __attrs_post_init__(self) -> None:
        if self.method != self.method.upper() or not self.method.isalpha():
            raise ValueError(f"{self.method} {self.path}: the method is one upper-case word")
        if not self.path.startswith("/"):
            raise ValueError(f"{self.method} {self.path}: the path begins with /")
        if self.fast and _PARAMETER.search(self.path):
            raise ValueError(f"{self.method} {self.path}: a fast route's path has no parameters")
        if self.use not in (GENERATE, TOKENS, PASSTHROUGH) or self.body not in (JSON_BODY, FORM_BODY, INSTANCES_BODY):
            raise ValueError(f"{self.method} {self.path}: use {self.use!r}, body {self.body!r}: unknown")

    @property
    def key(self) -> Tuple[bytes, bytes]:
        """``(method, path)`` as the fast path looks it up."""
        return self.method.encode("ascii"), self.path.encode("ascii")


def check_table(routes: Sequence[Route]) -> None:
    """ValueError unless each ``(method, path)`` is declared once."""
    seen = set()
    for route in routes:
        if (route.method, route.path) in seen:
            raise ValueError(f"{route.method} {route.path} is declared twice")
        seen.add((route.method, route.path))


def open_paths(routes: Iterable[Route]) -> FrozenSet[bytes]:
    """The paths that need no key."""
    return frozenset(route.path.encode("ascii") for route in routes if route.open)


def relayed_routes(routes: Iterable[Route]) -> Tuple[Tuple[str, str], ...]:
    """``(endpoint, path)`` of the routes relayed to llama-server."""
    return tuple((route.relayed, route.path) for route in routes if route.relayed is not None)


def _klein_handler(route: Route) -> Callable[..., Any]:
    """What Klein calls for ``route``: ``(server, request, **parameters)``."""
    get = operator.attrgetter(route.handler)
    if route.relayed is not None:
        def relayed(server: Any, request: Any, **parameters: Any) -> Any:
            # Klein's requests are twisted.web's, ProxiedRequests (see rolemesh/http/listener.py).
            return get(server)(request, route, **parameters)
        return relayed

    def handler(server: Any, request: Any, **parameters: Any) -> Any:
        return get(server)(request, **parameters)
    return handler


def _klein_error_handler(name: str) -> Callable[..., Any]:
    get = operator.attrgetter(name)

    def handler(server: Any, request: Any, failure: Failure) -> Any:
        return get(server)(request, failure)
    return handler


def klein_app(routes: Sequence[Route],
              error_handlers: Sequence[Tuple[Tuple[Type[Exception], ...], str]] = ()) -> Klein:
    """A Klein app of ``routes``, for a class attribute (Klein binds it to
    the instance, whose attributes the handlers name).  ``error_handlers``:
    ``(exception types, dotted handler name)``, tried in this order."""
    check_table(routes)
    app = Klein()
    for route in routes:
        app.route(route.path, methods=[route.method], endpoint=f"{route.method} {route.path}")(
            _klein_handler(route))
    for exceptions, name in error_handlers:
        app.handle_errors(*exceptions)(_klein_error_handler(name))
    return app


def _fast_route(route: Route, server: Any,
                fail: Callable[[Failure, Any], Optional[bytes]]) -> FastRoute:
    """``route`` as the fast path serves it, with what Klein adds (its error
    handlers) done by ``fail``."""
    handler = operator.attrgetter(route.handler)(server)
    if route.relayed is not None:
        def relayed(request: Any) -> "defer.Deferred[Optional[bytes]]":
            return handler(request, route).addErrback(fail, request)  # type: ignore[no-any-return]
        return relayed

    def at_once(request: Any) -> "defer.Deferred[Optional[bytes]]":
        try:
            body: Optional[bytes] = handler(request)
        except Exception:
            body = fail(Failure(), request)
        return defer.succeed(body)
    return at_once


def fast_dispatch(routes: Sequence[Route], server: Any,
                  fail: Callable[[Failure, Any], Optional[bytes]]) -> Dict[Tuple[bytes, bytes], FastRoute]:
    """The fast path's routes, by ``(method, path)``: the table's ``fast``
    ones, served by ``server``'s handlers; ``fail`` answers a failure as
    Klein's error handlers would."""
    check_table(routes)
    return {route.key: _fast_route(route, server, fail) for route in routes if route.fast}
