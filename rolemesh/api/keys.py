"""The API keys: which one a request carries, as ``Authorization: Bearer
<key>`` (OpenAI's clients) or ``x-api-key: <key>`` (Anthropic's), as
llama-server itself takes them."""

from __future__ import annotations

import hmac
from typing import List, Optional, Sequence, Tuple

from rolemesh.base import errors
from rolemesh.base.interfaces import RouteRequest


class ApiKeys:
    """The keys a request must carry one of (``Authorization: Bearer <key>``
    or ``x-api-key: <key>``); with none configured every request passes.  One object for the whole
    API: a reload changes its keys (:meth:`use`) for every route at once."""

    def __init__(self, keys: Sequence[str] = ()) -> None:
        self._keys: List[bytes] = []
        self.use(keys)

    def use(self, keys: Sequence[str]) -> None:
        """Check against ``keys`` from the next request on."""
        self._keys = [k.encode("utf-8") for k in keys]

    def error(self, header: Optional[bytes], api_key: Optional[bytes] = None) -> Optional[errors.ApiError]:
        """401 unless ``header`` (the raw Authorization value) or ``api_key``
        (the raw x-api-key value) carries a configured key."""
        return self.index(header, api_key)[0]

    def index(self, header: Optional[bytes], api_key: Optional[bytes] = None
              ) -> Tuple[Optional[errors.ApiError], Optional[int]]:
        """(401 or None, the index of the key presented: None without keys).
        Either header may carry it (a client that sends both passes if one matches)."""
        if not self._keys:
            return None, None
        presented = []
        if header is not None:
            scheme, _, token = header.partition(b" ")
            if scheme.lower() == b"bearer":
                presented.append(token.strip())
        if api_key is not None:
            presented.append(api_key.strip())
        found = -1
        for candidate in presented:
            for i, key in enumerate(self._keys):  # compare with every key: time does not leak which
                if hmac.compare_digest(candidate, key):
                    found = i
        if found < 0:
            return errors.ApiError(
                401, "missing or invalid API key (send Authorization: Bearer <key> or x-api-key: <key>)",
                "authentication_error", "invalid_api_key",  # llama-server's type, and Anthropic's
            ), None
        return None, found

    def authorize(self, request: RouteRequest) -> None:
        """Raise the 401 unless ``request`` carries a key (or the listener checked it from the head)."""
        if getattr(request, "key_checked", False):  # the listener checked it from the head (refuse_head)
            return
        error = self.error(request.getHeader(b"authorization"), request.getHeader(b"x-api-key"))
        if error is not None:
            raise error
