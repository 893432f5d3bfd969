"""Which model a request's ``model`` names: an id, an alias, a LoRA
adapter's id (its base model), a role (preferring a loaded model); no name
at all (llama.cpp's native clients send none): ``default_model``, else the
only model; a name that names nothing: 404 listing the models, or with
``unknown_models: default``, ``default_model`` (each such name logged once).
Pure but for that log line: the node hands in the config and what is loaded.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Set, Tuple

from twisted.logger import Logger

from rolemesh.base import errors
from rolemesh.config.file import ModelConfig, NodeConfig

log = Logger(namespace="rolemesh.node")

#: Names served with default_model that are remembered (each logged once) at most.
MAX_REMEMBERED = 256


def resolve(config: NodeConfig, name: str, loaded_on: Callable[[str], List[str]]) -> ModelConfig:
    """``model_id`` or alias; else a LoRA adapter's id (its base model:
    placed, queued and switched as the base, :mod:`rolemesh.children.adapters`);
    else a role (preferring a loaded model); else 404."""
    for model in config.models:
        if name in model.names:
            return model
    for model in config.models:
        if any(adapter.id == name for adapter in model.lora_adapters):
            return model
    serving = [m for m in config.models if name in m.roles]
    if not serving:
        raise errors.model_not_found(name, config.models)
    loaded = [m for m in serving if loaded_on(m.model_id)]
    return (loaded or serving)[0]


class ModelNames:
    """:func:`resolve` for requests, with the defaults of a request that
    names no model, or one this node does not serve."""

    def __init__(self, config: Callable[[], NodeConfig], loaded_on: Callable[[str], List[str]]) -> None:
        self._config = config
        self._loaded_on = loaded_on
        #: Names already served with default_model (logged once each).
        self._defaulted: Set[str] = set()

    def resolve(self, name: str) -> ModelConfig:
        return resolve(self._config(), name, self._loaded_on)

    def for_request(self, name: Optional[str]) -> Tuple[ModelConfig, str]:
        """The model a request's ``model`` (None: it sent none) names, and
        the name it is served under (the request's own, or ``default_model``)."""
        config = self._config()
        if name is None:
            if config.default_model is not None:
                return self.resolve(config.default_model), config.default_model
            if len(config.models) == 1:
                return config.models[0], config.models[0].model_id
            raise errors.ApiError(400, f'the request names no "model"; this node serves several '
                                       f'({errors.model_list(config.models)}): name one, or set default_model',
                                  "invalid_request_error", "missing_model")
        try:
            return self.resolve(name), name
        except errors.ApiError:
            if config.unknown_models != "default" or config.default_model is None:
                raise
        if name not in self._defaulted:
            if len(self._defaulted) < MAX_REMEMBERED:
                self._defaulted.add(name)
            log.info("model {name!r} is not served here: its requests go to default_model {default} "
                     "(unknown_models: default)", name=name[:256], default=config.default_model)
        return self.resolve(config.default_model), config.default_model
