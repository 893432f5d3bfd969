"""HTTP in and out, with no agent logic.

In: the listener (:mod:`~rolemesh.http.listener`: ``EndpointListener``,
``GuardedSite``, ``AddressListeners``), the strict llhttp channel for the
fast routes (:mod:`~rolemesh.http.fast_channel`: ``FastChannel``), the
request head's rules (:mod:`~rolemesh.http.request_head`) and the lingering
close after a refusal (:mod:`~rolemesh.http.lingering`).  Out: the relay to
the children (:mod:`~rolemesh.http.proxy`: ``Proxy``), its lean client
(:mod:`~rolemesh.http.child_client`: ``ChildAgent``), the quiet treq
clients of the control traffic (:mod:`~rolemesh.http.control_client`) and
the prompt-cache tally the relay reads from the bytes
(:mod:`~rolemesh.http.prompt_cache`).

May import :mod:`rolemesh.event_loop` and :mod:`rolemesh.base`.  What the
routes do is :mod:`rolemesh.api`.
"""
