"""LoRA adapters served as models of their own (issue 28), as pure functions.

A model's ``lora_adapters`` are all loaded by its one child, none applied
(``--lora a,b --lora-init-without-apply``: :mod:`rolemesh.children.llama_args`), so
each adapter's index in the child is its place in the list.  A request
names an adapter by its ``id`` and is placed, queued and switched as the
base model (:meth:`rolemesh.node.node.Node.resolve` gives the base's record);
the agent then sets llama-server's per-request ``lora`` field: the
adapter's scale for it, 0 for every other adapter -- and 0 for all of them
on a request for the bare base model, since this llama-server applies an
adapter left out of the field at its start-up scale (1).  Switching
adapters costs nothing and requests for different adapters share the
child's slots.

Requests for models without adapters never come here: their body is
relayed byte for byte.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional

from rolemesh.config.file import LoraAdapter, ModelConfig


def adapter_named(model: ModelConfig, name: str) -> Optional[LoraAdapter]:
    """The adapter of ``model`` whose id is ``name``; None for the base."""
    for adapter in model.lora_adapters:
        if adapter.id == name:
            return adapter
    return None


def lora_field(model: ModelConfig, name: str) -> List[Dict[str, Any]]:
    """llama-server's ``lora`` for a request that named ``name``: every
    adapter by its index in the child, at its scale if it is the one named,
    else 0."""
    return [{"id": index, "scale": adapter.scale if adapter.id == name else 0.0}
            for index, adapter in enumerate(model.lora_adapters)]


def with_lora(payload: Mapping[str, Any], model: ModelConfig, name: Optional[str] = None) -> bytes:
    """The body to relay for ``payload`` (parsed, naming ``model`` or one of
    its adapters in ``model``, or served as ``name``: a default the request
    did not name): ``lora`` set by the agent (a client's own ``lora`` is
    replaced: the adapter ids are how a client picks one)."""
    body = dict(payload)
    body["lora"] = lora_field(model, name if name is not None else str(payload.get("model")))
    return json.dumps(body).encode("utf-8")


def instances_with_lora(payload: Mapping[str, Any], model: ModelConfig, name: str) -> bytes:
    """A ``/predict`` body (rolemesh/config/vertex_ai.py) with :func:`with_lora`'s
    ``lora`` set in each instance: each is a request of its own to the child."""
    lora = lora_field(model, name)
    body = dict(payload)
    body["instances"] = [dict(i, lora=lora) if isinstance(i, dict) else i for i in payload.get("instances") or ()]
    return json.dumps(body).encode("utf-8")


def adapter_entries(base_entry: Mapping[str, Any], model: ModelConfig) -> List[Dict[str, Any]]:
    """``GET /v1/models`` entries of ``model``'s adapters, next to its own
    ``base_entry``: where the base is loaded (one child serves them all),
    the base's id and the adapter's scale; no memory estimate of their own
    (the base's child holds them)."""
    shared = {k: v for k, v in base_entry.items()
              if k in ("object", "created", "owned_by", "loaded_on", "loading_on", "load_progress", "devices",
                       "fits_on", "leaving")}
    return [{"id": adapter.id, **shared, "roles": [], "base_model": model.model_id,
             "lora": {"scale": adapter.scale}} for adapter in model.lora_adapters]


def adapter_served_models(base_entry: Mapping[str, Any], model: ModelConfig) -> List[Dict[str, Any]]:
    """The registration's ``served_models`` entries of ``model``'s adapters,
    next to its own ``base_entry``: each adapter id a model a dispatcher may
    route to, with the base's capabilities and devices, ``base_model``
    naming the base (one child serves them all: route an adapter where its
    base is loaded), no alias or roles of its own (a role resolves to the
    base), and no memory estimate of its own (the base's child holds it)."""
    shared = {k: v for k, v in base_entry.items() if k in ("capabilities", "devices", "fits_on")}
    return [{"model_id": adapter.id, "alias": None, "roles": [], **shared, "base_model": model.model_id}
            for adapter in model.lora_adapters]
