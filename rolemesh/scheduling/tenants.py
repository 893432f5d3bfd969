"""Who a request belongs to: its tenant and band, from its key and headers.

A request's tenant is the name of the API key it used (an ``api_keys``
mapping's ``name``; a bare key is named by its position, ``key0``,
``key1``, ...), or the ``X-RoleMesh-Tenant`` header where that key has
``tenant_header: true`` (a dispatcher's key) -- or where no key is
configured at all (anyone may say anything then).  Its band is
``X-RoleMesh-Priority: interactive|batch``, else the key's ``priority``,
else ``interactive``.  Everything is worked out once per config: a request
costs a dict lookup or two.
"""

from __future__ import annotations

import re
from typing import Dict, FrozenSet, List, Optional, Tuple

from rolemesh.base import errors
from rolemesh.config.file import NodeConfig, TenantConfig
from rolemesh.scheduling.fairqueue import BANDS, OTHER, Share

#: The tenant of requests on a node without API keys (and no header).
DEFAULT_TENANT = "default"
_TENANT = re.compile(rb"^[A-Za-z0-9._:-]{1,64}$")


def tenant_limit(tenant: str, limit: int) -> errors.ApiError:
    return errors.ApiError(429, f"tenant {tenant!r} already has {limit} requests queued or running "
                           "(its max_concurrent); retry shortly", "rate_limit_error", "tenant_limit", retry_after=1)


class Tenants:
    """The shares of one config's keys."""

    def __init__(self, config: NodeConfig) -> None:
        by_key = {t.key: t for t in config.tenants}
        self._by_name: Dict[str, TenantConfig] = {t.name: t for t in config.tenants}
        #: Per accepted key (by index; -1: no keys configured): its share per
        #: band, and whether it may name the tenant.
        self._keys: Dict[int, Tuple[Dict[bytes, Share], Share, bool]] = {}
        names: List[str] = []
        for i, key in enumerate(config.api_keys):
            t = by_key.get(key)
            if t is None:
                t = TenantConfig(f"key{i}", key)
            names.append(t.name)
            self._keys[i] = self._shares(t)
        if not config.api_keys:
            self._keys[-1] = self._shares(TenantConfig(DEFAULT_TENANT, "", tenant_header=True))
            names.append(DEFAULT_TENANT)
        #: The tenants metrics name (others are counted as ``other``).
        self.names: FrozenSet[str] = frozenset(names) | frozenset(self._by_name)

    @staticmethod
    def _shares(t: TenantConfig) -> Tuple[Dict[bytes, Share], Share, bool]:
        by_band = {band.encode(): Share(t.name, band, t.weight, t.max_concurrent) for band in BANDS}
        return by_band, by_band[t.priority.encode()], t.tenant_header

    def label(self, tenant: str) -> str:
        """The metrics label of ``tenant``: its name if configured, else ``other``."""
        return tenant if tenant in self.names else OTHER

    def share(self, key_index: Optional[int], tenant: Optional[bytes], priority: Optional[bytes]) -> Share:
        """The share of a request that used key ``key_index`` (None: no keys)
        with these header values; 400 for a malformed header."""
        by_band, default, may_name = self._keys[-1 if key_index is None else key_index]
        if priority is not None:
            share = by_band.get(priority.strip().lower())
            if share is None:
                raise errors.ApiError(400, "X-RoleMesh-Priority must be interactive or batch", "invalid_request_error",
                                      "invalid_priority")
        else:
            share = default
        if tenant is not None and may_name:
            if not _TENANT.fullmatch(tenant):
                raise errors.ApiError(400, "X-RoleMesh-Tenant must be 1-64 letters, digits, '.', '_', ':' or '-'",
                                      "invalid_request_error", "invalid_tenant")
            name = tenant.decode("ascii")
            named = self._by_name.get(name)
            return Share(name, share.band, named.weight if named else 1.0, named.max_concurrent if named else None)
        return share
