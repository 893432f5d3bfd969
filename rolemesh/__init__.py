"""RoleMesh Node Agent: one supervised llama-server per device behind an
OpenAI-compatible API, reporting to a RoleMesh dispatcher."""

__version__ = "0.1.0"
