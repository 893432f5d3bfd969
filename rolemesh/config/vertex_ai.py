"""Google Vertex AI prediction: ``POST /predict`` and the ``AIP_*`` variables.

llama-server serves Vertex AI's prediction protocol when ``AIP_MODE`` is
``PREDICTION``: ``{"instances": [{"@requestFormat": "chatCompletions",
...}, ...]}`` at ``AIP_PREDICT_ROUTE`` answers ``{"predictions": [...]}``,
one answer per instance, run on the child's slots side by side.  The node
relays ``/predict`` by model to a child started in that mode on its own
port, so the child does the fan-out; and an agent deployed as a Vertex AI
custom container (the platform sets ``AIP_MODE``, ``AIP_HTTP_PORT``, the
routes) listens where the platform sends traffic.

The parent's ``AIP_*`` variables never reach a child as they are: its
``AIP_HTTP_PORT`` would move the child onto the agent's own port.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import attr

from rolemesh.base.errors import ApiError, ConfigError

#: The route the node serves, and the one each child is told to serve.
PREDICT_PATH = "/predict"


@attr.s(auto_attribs=True, frozen=True)
class VertexAI:
    """What the platform asked of the agent (``AIP_MODE=PREDICTION``)."""

    http_port: int


def from_environ(environ: Mapping[str, str]) -> Optional[VertexAI]:
    """The platform's settings, or None outside Vertex AI's prediction mode;
    ConfigError for what the agent cannot do (a clear line at start-up)."""
    if environ.get("AIP_MODE", "") != "PREDICTION":
        return None
    port_text = environ.get("AIP_HTTP_PORT") or "8080"
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ConfigError(f"AIP_HTTP_PORT: expected a port number 1-65535, got {port_text!r}")
    for name, served in (("AIP_PREDICT_ROUTE", PREDICT_PATH), ("AIP_HEALTH_ROUTE", "/health")):
        route = environ.get(name) or served
        if ("/" + route.lstrip("/")) != served:
            raise ConfigError(f"{name}: the agent serves {served}, not {route!r}; set the container's "
                              f"{'predictRoute' if served == PREDICT_PATH else 'healthRoute'} to {served}")
    return VertexAI(http_port=port)


def child_environment(environ: Mapping[str, str], port: int) -> Dict[str, str]:
    """A child's environment: the parent's without its ``AIP_*``, plus the
    prediction mode on the child's own ``port`` (so it serves ``/predict``)."""
    env = {k: v for k, v in environ.items() if not k.startswith("AIP_")}
    env.update({"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": str(port), "AIP_PREDICT_ROUTE": PREDICT_PATH})
    return env


def predict_model(payload: Mapping[str, Any]) -> Optional[str]:
    """The model a ``/predict`` body names: the ``model`` its instances
    (and the body itself, if it has one) share; None where none names one
    (the default model serves it).  400 where two name different models:
    one child answers them all.  A body llama-server would refuse (no
    ``instances`` list) is its child's to refuse."""
    instances = payload.get("instances")
    named = [payload["model"]] if payload.get("model") is not None else []
    if isinstance(instances, list):
        named += [i.get("model") for i in instances if isinstance(i, dict) and i.get("model") is not None]
    if any(not isinstance(name, str) or not name for name in named):
        raise ApiError(400, 'an instance\'s "model" must be a non-empty string', "invalid_request_error",
                       "invalid_model")
    names = sorted(set(named))
    if len(names) > 1:
        raise ApiError(400, f"the instances of one /predict name different models ({', '.join(names)}); "
                       "send one request per model", "invalid_request_error", "invalid_model")
    return names[0] if names else None
