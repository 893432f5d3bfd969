"""Error types the agent raises on purpose.

``ConfigError`` is a user's mistake in configuration: the CLI prints its one
line and exits 2.  ``ApiError`` is a request that cannot be served: the API
layer renders it in OpenAI's error shape with its status.
"""

from __future__ import annotations

import json
from typing import List, Optional, Tuple

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

    def json(self) -> bytes:
        """The body as sent."""
        return json.dumps(self.body()).encode("utf-8")


def answer_headers(error: ApiError) -> List[Tuple[bytes, bytes]]:
    """The headers an answer with ``error`` carries beside its JSON body."""
    headers = []
    if error.retry_after is not None:
        headers.append((b"retry-after", str(error.retry_after).encode()))
    if error.status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="rolemesh-node"'))
    return headers


def model_not_found(name: str) -> ApiError:
    return ApiError(
        404,
        f"The model {name!r} does not exist on this node",
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
