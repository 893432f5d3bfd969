"""One llama-server child per device, kept alive.

The supervisor (:mod:`~rolemesh.children.supervisor`: ``DeviceSupervisor``)
and the parts it owns: one spawn (``ChildAttempt``), the process and its
exec wrapper (:mod:`~rolemesh.children.process`,
:mod:`~rolemesh.children.wrapper`), probes and health, the restart policy,
failures and their diagnosis, waiters, pid files, the device state enum;
and what a child is started with: llama-server's argv
(:mod:`~rolemesh.children.llama_args`) and build, chat templates, LoRA
adapters, read-ahead of a model's file.  The children's own telemetry
(``/metrics``, ``/slots``) is :mod:`~rolemesh.children.telemetry`.

May import :mod:`rolemesh.scheduling`, :mod:`rolemesh.backends`,
:mod:`rolemesh.http`, :mod:`rolemesh.config`, :mod:`rolemesh.event_loop`
and :mod:`rolemesh.base`.
"""
