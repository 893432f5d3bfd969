"""HTTP clients the agent uses towards its children and the dispatcher.

One place builds them so that they all are quiet: Twisted's client factory
logs "Starting factory" / "Stopping factory" for every connection, which at a
probe every 50 ms or a heartbeat every few seconds drowns the real log.
"""

from __future__ import annotations

from typing import Any, Optional

from twisted.web.client import Agent, HTTPConnectionPool


def quiet_pool(reactor: Any, persistent: bool) -> HTTPConnectionPool:
    """A connection pool whose connections do not log their life."""
    pool = HTTPConnectionPool(reactor, persistent=persistent)
    factory = getattr(pool, "_factory", None)
    if isinstance(factory, type):
        quiet: Any = type("QuietHTTP11ClientFactory", (factory,), {"noisy": False})
        pool._factory = quiet
    return pool


def quiet_agent(reactor: Any, persistent: bool, connect_timeout: Optional[float] = None,
                pool: Optional[HTTPConnectionPool] = None) -> Agent:
    """An Agent on a quiet pool (``pool`` if given)."""
    pool = pool or quiet_pool(reactor, persistent)
    return Agent(reactor, connectTimeout=connect_timeout, pool=pool)


def quiet_treq(reactor: Any, persistent: bool = False, connect_timeout: Optional[float] = None) -> Any:
    """A treq ``HTTPClient`` on a quiet Agent."""
    from treq.client import HTTPClient

    return HTTPClient(quiet_agent(reactor, persistent, connect_timeout))
