"""CPU of one ``GET /metrics`` render, in-process: cached vs generate_latest.

``NodeMetrics.render`` (what the route serves) keeps each family's and live
part's text until what it shows changes; ``render_uncached`` makes the same
bytes afresh with prometheus_client's ``generate_latest``.  This builds the
metrics as the unit tests do (a real Node and supervisors on a fake clock,
one device, two models, a ready child with telemetry, a dispatcher client,
``--requests`` requests counted over a few endpoints and statuses) and
times, with ``time.process_time`` over ``--scrapes`` renders each:

* nothing changed between scrapes;
* the clock moved (1 ms) between scrapes, as it always has on the real
  reactor: the ages are rendered again;
* one request counted between scrapes (and the clock moved);
* a lease taken and released between scrapes (the scheduler's books);
* the uncached render.

The HTTP side of a scrape is not in it (``bench/relay_ceiling.py`` C measures
a whole scrape of a real agent from outside).

    python bench/metrics_scrape.py [--scrapes 1000] [--requests 300]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def build(requests: int) -> Any:
    """The metrics harness: one device, models ``a`` and ``b``, ``a`` ready with telemetry."""
    from treq.testing import StubTreq

    from rolemesh.children.telemetry import TelemetrySampler
    from tests.api.test_metrics import Harness
    from tests.children.test_telemetry import FakeChild, child_metrics, child_slots

    h = Harness(count=1)
    child = FakeChild()
    stub = StubTreq(child)
    h.node.telemetry = TelemetrySampler(h.node.supervisors, reactor=h.reactor, get=stub.get)
    d = h.node.acquire(h.config.model("a"))
    h.ready("a")
    d.addCallback(lambda lease: lease.release())
    for busy, decoded in ((2, 4), (1, 9)):
        child.metrics = child_metrics(processing=busy, predicted=50 * decoded)
        child.slots = child_slots(busy=busy, total=2, decoded=decoded)
        h.node.telemetry.sample()
        stub.flush()
        h.reactor.advance(1)
    h.root.dispatcher = SimpleNamespace(state="registered", last_success=h.reactor.seconds(), heartbeats_ok=3,
                                        heartbeats_failed=0, registrations_ok=1, registrations_failed=0)
    rnd = random.Random(1)
    for _ in range(requests):
        h.metrics.observe("request", endpoint=rnd.choice(["chat/completions", "completions"]),
                          model=rnd.choice("ab"), status=rnd.choice([200, 200, 200, 429, 499]),
                          duration=rnd.random() * 5, ttfb=rnd.random() / 2)
        h.metrics.observe("queue_wait", device="gpu:0", seconds=rnd.random() / 100, tenant="default")
    return h


def per_scrape(scrapes: int, render: Callable[[], bytes], between: Optional[Callable[[], Any]] = None) -> float:
    """CPU seconds per scrape (and whatever comes between two)."""
    start = time.process_time()
    for _ in range(scrapes):
        if between is not None:
            between()
        render()
    return (time.process_time() - start) / scrapes


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=1000, help="renders per figure (default 1000)")
    parser.add_argument("--requests", type=int, default=300, help="requests counted before (default 300)")
    args = parser.parse_args(argv)
    h = build(args.requests)
    m = h.metrics
    text = m.render()
    if text != m.render_uncached():
        raise SystemExit("the cached render differs from the uncached one")
    lines = text.count(b"\n")
    print(f"{len(text):,} bytes, {lines:,} lines; CPU per render (and the change before it), "
          f"mean of {args.scrapes}:")

    def tick() -> None:
        h.reactor.advance(0.001)

    def request() -> None:
        tick()
        m.observe("request", endpoint="chat/completions", model="a", status=200, duration=0.3, ttfb=0.1)

    def lease() -> None:
        tick()
        h.node.acquire(h.config.model("a")).addCallback(lambda held: held.release())

    rows = [
        ("nothing changed", per_scrape(args.scrapes, m.render)),
        ("the clock moved 1 ms", per_scrape(args.scrapes, m.render, tick)),
        ("one request counted", per_scrape(args.scrapes, m.render, request)),
        ("a lease taken and released", per_scrape(args.scrapes, m.render, lease)),
        ("uncached (generate_latest)", per_scrape(max(1, args.scrapes // 5), m.render_uncached, tick)),
    ]
    for what, seconds in rows:
        print(f"  {what:28} {seconds * 1e6:8.1f} us")
    if m.render() != m.render_uncached():
        raise SystemExit("the cached render differs from the uncached one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
