"""What the node shows the world over HTTP: the routes.

``NodeAPI`` (:mod:`~rolemesh.api.app`) holds the one route table
(``ROUTES``, built into Klein's routes and the fast path's dispatch by
:mod:`~rolemesh.api.routes`); the relayed inference routes
(:mod:`~rolemesh.api.relay`: ``Relay``), the held-state routes
(:mod:`~rolemesh.api.held`, :mod:`~rolemesh.api.held_state`),
``/upstream/<model>/`` (:mod:`~rolemesh.api.upstream`), ``/v1/node/...``
and the probes (:mod:`~rolemesh.api.node_routes`), keys and error answers
(:mod:`~rolemesh.api.keys`, :mod:`~rolemesh.api.answers`), ``/ready``
(:mod:`~rolemesh.api.readiness`) and ``/metrics``
(:mod:`~rolemesh.api.metrics`: ``NodeMetrics``; its live families in
:mod:`~rolemesh.api.live_metrics`, the text in
:mod:`~rolemesh.api.exposition`).

May import :mod:`rolemesh.fleet`, :mod:`rolemesh.node` and every layer
below; the route modules reach the children only through the node
(contract ``api-through-the-node``).
"""
