"""How the API answers: JSON bodies, errors in OpenAI's shape
(``{"error": {"message", "type", "code"}}``) with their status and headers,
the request body's checks, and the error handlers Klein runs (the fast path
does the same through :meth:`ErrorAnswers.fast_error`).  Nothing a client
sends produces a traceback.
"""

from __future__ import annotations

import json
from typing import AbstractSet, Any, Callable, Dict, Optional, Union, cast

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from werkzeug.exceptions import HTTPException

from rolemesh.api.keys import ApiKeys
from rolemesh.base import errors
from rolemesh.base.interfaces import RouteRequest

#: The API's log namespace, whichever of its modules logs.
log = Logger(namespace="rolemesh.api")

#: Longest model name accepted; longer ones are a client bug, not a lookup.
MAX_MODEL_NAME = 256


def json_answer(request: RouteRequest, status: int, body: Any) -> bytes:
    """``body`` as the JSON answer, with ``status``."""
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    return json.dumps(body).encode("utf-8")


def error_answer(request: RouteRequest, error: errors.ApiError) -> bytes:
    """``error`` as the answer: its status, its headers (Retry-After,
    WWW-Authenticate) and its JSON body in the shape of the route's API
    (Anthropic's on ``/v1/messages*``, OpenAI's elsewhere)."""
    for name, value in errors.answer_headers(error):
        request.setHeader(name, value)
    return json_answer(request, error.status, errors.error_body(error, getattr(request, "path", b"") or b""))


def bad_request(message: str, code: str = "invalid_request") -> errors.ApiError:
    return errors.ApiError(400, message, "invalid_request_error", code)


def request_body(request: RouteRequest, limit: int) -> bytes:
    """The request's body; 413 when the listener did not keep it (larger than ``limit``)."""
    if getattr(request, "body_too_large", False):  # the listener did not keep it
        raise errors.ApiError(413, f"request body is larger than {limit} bytes (max_request_body_bytes)",
                              "invalid_request_error", "request_too_large")
    return request.content.read()  # type: ignore[union-attr]  # None only before the body began


def parse_body(body: bytes, limit: int, model_required: bool = True) -> Dict[str, Any]:
    """Check a proxied request body and return it parsed (pure: no I/O).
    ``model_required`` False: a body without ``model`` passes (the node
    picks one: :meth:`rolemesh.node.node.Node.resolve_request`)."""
    if len(body) > limit:
        raise errors.ApiError(
            413,
            f"request body is {len(body)} bytes; the limit is {limit} (max_request_body_bytes)",
            "invalid_request_error",
            "request_too_large",
        )
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("request body is not UTF-8") from None
    try:
        payload = json.loads(text)
    except ValueError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    except RecursionError:  # "[[[[..." nested past the parser's depth limit
        raise bad_request("request body is not valid JSON: nested too deeply") from None
    if not isinstance(payload, dict):
        raise bad_request("request body must be a JSON object")
    model = payload.get("model")
    if model is None:
        if not model_required:
            return payload
        raise bad_request('request body has no "model"', "missing_model")
    if not isinstance(model, str) or not model:
        raise bad_request('"model" must be a non-empty string', "invalid_model")
    if len(model) > MAX_MODEL_NAME:
        raise bad_request(f'"model" is longer than {MAX_MODEL_NAME} characters', "invalid_model")
    return payload


def _parameters(value: bytes) -> Dict[bytes, bytes]:
    """``; name=value`` parameters of a header value (quotes taken off), by lower-case name."""
    out: Dict[bytes, bytes] = {}
    for item in value.split(b";")[1:]:
        name, _, found = item.partition(b"=")
        found = found.strip()
        if len(found) >= 2 and found[:1] == found[-1:] == b'"':
            found = found[1:-1]
        out[name.strip().lower()] = found
    return out


def form_model(content_type: bytes, body: bytes, limit: int) -> Optional[str]:
    """The ``model`` field of a ``multipart/form-data`` body (an audio
    upload), or None when it has none; 400 for a body that is not such a
    form.  Pure: reads the parts' heads only, never copies a file part."""
    if len(body) > limit:
        raise errors.ApiError(413, f"request body is {len(body)} bytes; the limit is {limit} "
                                   "(max_request_body_bytes)", "invalid_request_error", "request_too_large")
    if content_type.split(b";")[0].strip().lower() != b"multipart/form-data":
        raise bad_request('expected a multipart/form-data body (the file, and "model" among its fields)',
                          "invalid_body")
    boundary = _parameters(content_type).get(b"boundary")
    if not boundary:
        raise bad_request("the multipart/form-data Content-Type has no boundary", "invalid_body")
    delimiter = b"--" + boundary
    at = body.find(delimiter)
    while at >= 0:
        start = at + len(delimiter)
        if body[start:start + 2] == b"--":
            return None  # the closing delimiter
        head_end = body.find(b"\r\n\r\n", start)
        if head_end < 0:
            break
        following = body.find(b"\r\n" + delimiter, head_end)
        head = body[start:head_end]
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-disposition" and _parameters(value).get(b"name") == b"model":
                raw = body[head_end + 4:following if following >= 0 else len(body)]
                try:
                    model = raw.decode("utf-8").strip()
                except UnicodeDecodeError:
                    raise bad_request('the form field "model" is not UTF-8', "invalid_model") from None
                if not model or len(model) > MAX_MODEL_NAME:
                    raise bad_request(f'the form field "model" must be 1 to {MAX_MODEL_NAME} characters',
                                      "invalid_model")
                return model
        if following < 0:
            break
        at = following + 2
    raise bad_request("the multipart/form-data body is cut short (no closing boundary)", "invalid_body")


class Utf8Guard(Resource):
    """In front of the Klein routes: answers a URL path or Host header that
    is not UTF-8 (or a Host that is no IDNA name) with a JSON 400 (Klein
    answers those itself in plain text, and logs each as an error); sets
    ``Access-Control-Allow-Origin`` for an allowed ``Origin``, and answers a
    CORS preflight (``OPTIONS``) on any path, before any route."""

    isLeaf = True

    def __init__(self, inner: IResource, cors_origin: Optional[Callable[[bytes], Optional[bytes]]] = None,
                 preflight: Optional[Callable[[IRequest], bytes]] = None) -> None:
        super().__init__()
        self._inner = inner
        #: ``Access-Control-Allow-Origin`` for an ``Origin`` (the head policy's), as the fast path sets it.
        self._cors_origin = cors_origin
        #: What answers a CORS preflight (``OPTIONS``, any path), before any route.
        self._preflight = preflight

    def render(self, request: IRequest) -> Union[bytes, int]:
        origin = request.getHeader(b"origin")
        if origin is not None and self._cors_origin is not None:
            allowed = self._cors_origin(origin)
            if allowed is not None:
                request.setHeader(b"access-control-allow-origin", allowed)
                request.setHeader(b"vary", b"Origin")
        if request.method == b"OPTIONS" and self._preflight is not None:
            return self._preflight(request)
        try:
            b"/".join(request.prepath + request.postpath).decode("utf-8")
            request.getRequestHostname().decode("utf-8").encode("idna")  # werkzeug's routing needs an IDNA name
        except UnicodeError:
            return error_answer(request, errors.ApiError(400, "the URL path or Host header is not valid UTF-8",
                                                         "invalid_request_error", "invalid_url"))
        return self._inner.render(request)


class ErrorAnswers:
    """The error handlers of the Klein routes (see ``ERROR_HANDLERS`` in
    rolemesh/api/app.py), and :meth:`fast_error`, the same for the fast path.
    A request without a valid key hears 401 before it hears which routes
    exist (``open_paths`` need no key)."""

    def __init__(self, keys: ApiKeys, open_paths: AbstractSet[bytes]) -> None:
        self._keys = keys
        self._open_paths = open_paths

    def api_error(self, request: IRequest, failure: Failure) -> bytes:
        return error_answer(request, cast(errors.ApiError, failure.value))

    def _unauthorized(self, request: RouteRequest) -> Optional[bytes]:
        """Without a valid key, say 401 before saying which routes exist."""
        try:
            self._keys.authorize(request)
        except errors.ApiError as e:
            return error_answer(request, e)
        return None

    def not_found(self, request: IRequest, failure: Failure) -> bytes:
        denied = self._unauthorized(request)
        if denied is not None:
            return denied
        path = request.path.decode("utf-8", "replace")[:200]
        return error_answer(request, errors.ApiError(404, f"no route {path}", "invalid_request_error", "not_found"))

    def not_allowed(self, request: IRequest, failure: Failure) -> bytes:
        if request.path not in self._open_paths:
            denied = self._unauthorized(request)
            if denied is not None:
                return denied
        allowed = getattr(failure.value, "valid_methods", None) or []
        if allowed:
            request.setHeader(b"allow", ", ".join(allowed).encode())
        method = request.method.decode("ascii", "replace")
        return error_answer(request, errors.ApiError(405, f"method {method} not allowed here",
                                                     "invalid_request_error", "method_not_allowed"))

    def http_exception(self, request: IRequest, failure: Failure) -> bytes:
        e = cast(HTTPException, failure.value)
        new_url = getattr(e, "new_url", None)  # werkzeug's RequestRedirect (e.g. "//" merged): say where to
        if new_url:
            request.setHeader(b"location", new_url.encode("utf-8"))
        return error_answer(request, errors.ApiError(e.code or 400, e.description or e.name,
                                                     "invalid_request_error"))

    def unexpected(self, request: RouteRequest, failure: Failure) -> bytes:
        log.failure("unexpected error answering {path}", failure, path=request.path)
        return error_answer(request, errors.ApiError(500, "internal error in the node agent", "server_error",
                                                     "internal_error"))

    def fast_error(self, failure: Failure, request: RouteRequest) -> bytes:
        """A fast route's failure answered as Klein's handlers answer it; a
        cancellation (the client went) goes on failing the Deferred."""
        if failure.check(errors.ApiError):
            return error_answer(request, cast(errors.ApiError, failure.value))
        if failure.check(defer.CancelledError):
            return failure  # type: ignore[return-value]  # the cancellation goes on failing the Deferred
        return self.unexpected(request, failure)
