"""The API keys: which one a request's ``Authorization`` header carries."""

from __future__ import annotations

import hmac
from typing import List, Optional, Sequence, Tuple

from rolemesh import errors
from rolemesh.interfaces import RouteRequest


class ApiKeys:
    """The keys a request must carry one of (``Authorization: Bearer <key>``);
    with none configured every request passes.  One object for the whole
    API: a reload changes its keys (:meth:`use`) for every route at once."""

    def __init__(self, keys: Sequence[str] = ()) -> None:
        self._keys: List[bytes] = []
        self.use(keys)

    def use(self, keys: Sequence[str]) -> None:
        """Check against ``keys`` from the next request on."""
        self._keys = [k.encode("utf-8") for k in keys]

    def error(self, header: Optional[bytes]) -> Optional[errors.ApiError]:
        """401 unless ``header`` (the raw Authorization value) carries a configured key."""
        return self.index(header)[0]

    def index(self, header: Optional[bytes]) -> Tuple[Optional[errors.ApiError], Optional[int]]:
        """(401 or None, the index of the key ``header`` carries: None without keys)."""
        if not self._keys:
            return None, None
        scheme, _, token = (header or b"").partition(b" ")
        presented = token.strip()
        found = -1
        for i, key in enumerate(self._keys):  # compare with every key: time does not leak which
            if hmac.compare_digest(presented, key):
                found = i
        if scheme.lower() != b"bearer" or found < 0:
            return errors.ApiError(
                401, "missing or invalid API key (send Authorization: Bearer <key>)",
                "invalid_request_error", "invalid_api_key",
            ), None
        return None, found

    def authorize(self, request: RouteRequest) -> None:
        """Raise the 401 unless ``request`` carries a key (or the listener checked it from the head)."""
        if getattr(request, "key_checked", False):  # the listener checked it from the head (refuse_head)
            return
        error = self.error(request.getHeader(b"authorization"))
        if error is not None:
            raise error
