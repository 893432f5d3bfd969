"""The shared vocabulary every other package speaks.

Errors (:mod:`~rolemesh.base.errors`: ``ConfigError``, ``ApiError``), the
string enums, the one observer mechanism (:mod:`~rolemesh.base.events`:
``Events``, ``Outbox``), back-off (``Backoff``), the device records
(``DeviceRef``, ``DeviceMetrics``), the interfaces the parts meet at
(:mod:`~rolemesh.base.interfaces`: ``IDeviceBackend``, the reactor sets,
the narrow Protocols passed down instead of imported up) and the log
observers (:mod:`~rolemesh.base.logs`).

Imports nothing of the agent's: it is the bottom layer (pyproject.toml's
import-linter contracts; docs/architecture.md, "Layers").
"""
