"""twistd plugins: the service, ``twistd -n rolemesh-node --config ...``, and
the agent's reactor, ``twistd --reactor rolemesh-epoll ...`` (see
:mod:`rolemesh.event_loop`).

Both are lazy: nothing of the agent is imported until twistd uses them.
"""

from twisted.application.reactors import Reactor
from twisted.application.service import ServiceMaker

rolemesh_node = ServiceMaker(
    "RoleMesh Node Agent",
    "rolemesh.tap",
    "One llama-server per device behind an OpenAI-compatible API.",
    "rolemesh-node",
)

rolemesh_epoll = Reactor(
    "rolemesh-epoll",
    "rolemesh.event_loop",
    "epoll without the per-event legacy log context (what rolemesh-node-agent runs on)",
)
