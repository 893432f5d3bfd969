"""What a request head must be, beyond what the HTTP parser checks (pure).

The listener parses with llhttp (through ``httptools``: Node.js's parser,
maintained and fuzzed by others), which already refuses a bare LF, a lone
CR, a NUL or other control byte in the head, a header name that is not a
token, obs-fold, a ``Content-Length`` that is not ``1*DIGIT`` or appears
twice, ``Transfer-Encoding`` together with ``Content-Length`` or not ending
in ``chunked``, chunk sizes that are not hex digits.  RFC 9112 asks for
more than a parser can know: the rules here (one ``Host``, a known
expectation, a supported version, bounded heads), each a 4xx or 5xx answer
that closes the connection.  ``docs/security.md`` lists them all, with
their RFC sections.
"""

from __future__ import annotations

from typing import Optional

from rolemesh.errors import ApiError

#: Most header lines a request may have (twisted.web allows 500).
MAX_HEADERS = 100
#: Longest request head, request line included (twisted.web's own limit).
MAX_HEAD_BYTES = 16384
#: The versions served; any other is a 505.
VERSIONS = ("1.1", "1.0")


def malformed(reason: str) -> ApiError:
    """The answer to bytes that are no valid HTTP/1.1 request."""
    return ApiError(400, f"malformed HTTP request: {reason}", "invalid_request_error", "bad_request")


def head_too_large() -> ApiError:
    return ApiError(431, f"the request head has more than {MAX_HEADERS} header lines or "
                         f"{MAX_HEAD_BYTES} bytes", "invalid_request_error", "headers_too_large")


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than {limit} bytes (max_request_body_bytes)",
                    "invalid_request_error", "request_too_large")


def unknown_method() -> ApiError:
    """llhttp knows every registered method; after any other, where the
    request ends cannot be known: a 400 and a close (twisted.web's Klein
    would say 405)."""
    return malformed("unknown HTTP method")


def head_error(version: str, hosts: int, expect: Optional[bytes]) -> Optional[ApiError]:
    """Why a parsed head cannot be served, or None.

    ``hosts`` is how many ``Host`` lines it had, ``expect`` its ``Expect``
    value (None without one)."""
    if version not in VERSIONS:
        return ApiError(505, f"HTTP/{version} is not supported (HTTP/1.1 is)", "invalid_request_error",
                        "http_version_not_supported")
    if hosts != 1 and (version == "1.1" or hosts > 1):  # RFC 9112 §3.2
        return malformed("an HTTP/1.1 request needs exactly one Host header" if version == "1.1" else
                         "more than one Host header")
    if expect is not None and expect.lower() != b"100-continue":  # RFC 9110 §10.1.1
        return ApiError(417, "the only expectation served is 100-continue", "invalid_request_error",
                        "expectation_failed")
    return None


__all__ = ["MAX_HEADERS", "MAX_HEAD_BYTES", "VERSIONS", "body_too_large", "head_error", "head_too_large",
           "malformed", "unknown_method"]
