"""Error types the agent raises on purpose.

``ConfigError`` is a user's mistake in configuration: the CLI prints its one
line and exits 2.  ``ApiError`` is a request that cannot be served: the API
layer renders it with its status, in the shape of the API the route speaks
(:func:`error_body`): Anthropic's on the Messages routes, OpenAI's elsewhere.
"""

from __future__ import annotations

import json
from typing import Any, List, Optional, Sequence, Tuple

import attr


class ConfigError(Exception):
    """A configuration mistake; ``str()`` is the whole one-line message."""


@attr.s(auto_attribs=True, frozen=True, auto_exc=True)
class ApiError(Exception):
    """A request failure with its HTTP status and OpenAI error fields."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: Optional[str] = None
    retry_after: Optional[int] = None

    def __str__(self) -> str:
        return f"{self.status} {self.code or self.type}: {self.message}"

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict:
        """The body in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``),
        the type by status (:data:`ANTHROPIC_TYPES`), so each SDK raises its class for it."""
        kind = ANTHROPIC_TYPES.get(self.status) or ("api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def json(self, path: bytes = b"") -> bytes:
        """The body as sent on ``path`` (the request target; it picks the shape)."""
        return json.dumps(error_body(self, path)).encode("utf-8")


#: Where the node's own errors take Anthropic's shape: the Messages API
#: (``/v1/messages``, ``/v1/messages/count_tokens``, with or without a query).
ANTHROPIC_PATHS = (b"/v1/messages",)

#: Anthropic's error type for each status it documents (others: ``api_error``
#: from 500 up, ``invalid_request_error`` below).  503 is the node's
#: "overloaded" (loading, draining, backing off): the SDK's
#: ServiceUnavailableError / InternalServerError, retried like Anthropic's 529.
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def speaks_anthropic(path: bytes) -> bool:
    """Whether an answer on ``path`` (a request target) takes Anthropic's error shape."""
    for prefix in ANTHROPIC_PATHS:
        if path.startswith(prefix) and path[len(prefix):len(prefix) + 1] in (b"", b"/", b"?"):
            return True
    return False


def error_body(error: ApiError, path: bytes = b"") -> dict:
    """``error``'s JSON body in the shape of the API ``path`` belongs to."""
    return error.anthropic_body() if speaks_anthropic(path) else error.body()


def answer_headers(error: ApiError) -> List[Tuple[bytes, bytes]]:
    """The headers an answer with ``error`` carries beside its JSON body."""
    headers = []
    if error.retry_after is not None:
        headers.append((b"retry-after", str(error.retry_after).encode()))
    if error.status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="rolemesh-node"'))
    return headers


def model_list(models: Sequence[Any], most: int = 20) -> str:
    """The model ids of ``models`` for a message: the first ``most``, and how many more."""
    ids = [m.model_id for m in models]
    shown = ", ".join(ids[:most]) or "none"
    return shown + (f" and {len(ids) - most} more" if len(ids) > most else "")


def model_not_found(name: str, models: Sequence[Any] = ()) -> ApiError:
    served = f" (models here: {model_list(models)})" if models else ""
    return ApiError(
        404,
        f"The model {name!r} does not exist on this node{served}",
        "invalid_request_error",
        "model_not_found",
    )


def model_load_failed(message: str, retry_after: int = 5) -> ApiError:
    return ApiError(503, message, "server_error", "model_load_failed", retry_after)


def model_load_timeout(message: str, retry_after: int = 5) -> ApiError:
    return ApiError(503, message, "server_error", "model_load_timeout", retry_after)


def shutting_down() -> ApiError:
    return ApiError(503, "the node is shutting down", "server_error", "shutting_down", 5)


def queue_full(where: str, limit: int) -> ApiError:
    return ApiError(429, f"{where} already has {limit} requests pending; retry shortly",
                    "rate_limit_error", "queue_full", retry_after=1)


def queue_timeout(where: str, seconds: float) -> ApiError:
    return ApiError(503, f"waited {seconds:g}s in the queue of {where} without a turn (queue_timeout_s); "
                         "retry shortly", "server_error", "queue_timeout", retry_after=5)


def upstream_error(message: str) -> ApiError:
    return ApiError(502, message, "server_error", "upstream_error")


def model_too_large(model_id: str, needed: str, available: str) -> ApiError:
    """The model's memory estimate exceeds what any eligible device (or
    device group) can ever hold: 400, nothing is spawned."""
    return ApiError(
        400,
        f"model {model_id!r} needs an estimated {needed}, but {available}; "
        "lower ctx_size or gpu_layers, use a quantized cache (cache-type-k/v), or span a device group",
        "invalid_request_error",
        "model_too_large",
    )
