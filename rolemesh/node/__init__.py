"""The whole node: its devices' children, queues and placement as one.

``Node`` (:mod:`~rolemesh.node.node`) is the composition; its parts are
admission (``Admission``), leases (``LeaseStarts``), drain, the device
timers, the metrics tick (``DeviceSampler``) and the views the API reads
(``NodeViews``); beside them the typed events feed
(:mod:`~rolemesh.node.feed`: ``NodeFeed``), reload and the adoption of a
new config by the running children (:mod:`~rolemesh.node.reload`,
:mod:`~rolemesh.node.adoption`), which model a request names
(:mod:`~rolemesh.node.names`) and the bodies the node sends the dispatcher
and shows at ``/v1/node/registration`` (:mod:`~rolemesh.node.payloads`).

May import :mod:`rolemesh.children` and every layer below it.
"""
