"""JSON Schemas of the dispatcher protocol payloads, shipped with the package."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

#: Schemas this package ships: ``load_schema(name)`` accepts these names.
SCHEMA_NAMES = ("registration", "heartbeat", "events")


def load_schema(name: str) -> dict[str, Any]:
    """Return the parsed JSON Schema ``name`` (one of SCHEMA_NAMES).

    Read through :mod:`importlib.resources` so it works from a wheel or a zip,
    not only from a source checkout.
    """
    if name not in SCHEMA_NAMES:
        raise ValueError(f"unknown schema {name!r}; expected one of {', '.join(SCHEMA_NAMES)}")
    text = resources.files(__name__).joinpath(f"{name}.schema.json").read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema
