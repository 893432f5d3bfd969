"""The RoleMesh dispatcher client: how this node joins a fleet.

``DispatcherClient`` (:mod:`~rolemesh.fleet.dispatcher`) registers,
heartbeats and deregisters; ``DispatcherLink`` (:mod:`~rolemesh.fleet.link`)
keeps the link's state and back-off; ``DispatcherExchange``
(:mod:`~rolemesh.fleet.exchange`) is one bounded, token-free POST;
``DeltaSender`` (:mod:`~rolemesh.fleet.deltas`) sends the node's events as
coalesced deltas; :mod:`~rolemesh.fleet.protocol` names the protocol's
states and outcomes (docs/dispatcher-protocol.md).

May import :mod:`rolemesh.node` (the feed and the payloads) and every layer
below it.
"""
