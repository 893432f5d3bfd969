"""The configuration: what the operator wrote, read and checked before
anything runs.

:mod:`~rolemesh.config.file` holds the config file's keys, records
(``NodeConfig``, ``ModelConfig``, ``TenantConfig``) and validation
(``load_config``); :mod:`~rolemesh.config.tls` the TLS files and their
reload; :mod:`~rolemesh.config.models_dir` a folder of GGUF files as
models; :mod:`~rolemesh.config.template_names` llama.cpp's built-in chat
template names; :mod:`~rolemesh.config.vertex_ai` Google Vertex AI's
``AIP_*`` variables.

May import only :mod:`rolemesh.base` (contract ``config-knows-no-node``).
Applying a changed config to the running node is :mod:`rolemesh.node.reload`.
"""
