"""Pure decisions: which device a request goes to and when it runs.

The scheduler's books and queues (:mod:`~rolemesh.scheduling.scheduler`:
``Scheduler``, ``Ticket``), fair order between tenants
(:mod:`~rolemesh.scheduling.fairqueue`), prefix affinity
(:mod:`~rolemesh.scheduling.prefix`: ``PrefixMemory``), tenants and bands
(:mod:`~rolemesh.scheduling.tenants`), lanes, capacity and fit
(:mod:`~rolemesh.scheduling.placement`: ``Placement``) and the memory a
model needs from its GGUF header (:mod:`~rolemesh.scheduling.estimate`).

No I/O and no Twisted (contract ``pure-scheduling``; the GGUF header read,
``estimate.read_facts``, is the one read of a file), so hypothesis can
hammer it.  May import :mod:`rolemesh.backends` (device groups),
:mod:`rolemesh.config` and :mod:`rolemesh.base`.
"""
