"""twistd plugin: ``twistd -n rolemesh-node --config ...``.

A lazy ServiceMaker: nothing of the agent is imported until twistd runs it.
"""

from twisted.application.service import ServiceMaker

rolemesh_node = ServiceMaker(
    "RoleMesh Node Agent",
    "rolemesh.tap",
    "One llama-server per device behind an OpenAI-compatible API.",
    "rolemesh-node",
)
