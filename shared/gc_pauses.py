"""Garbage-collector pauses of a gateway or worker process: how long each collection held it, by generation.

Every stream a gateway relays keeps a couple of hundred objects the cyclic collector tracks (the coroutines,
closures and tasks of its ASGI chain), and a worker some for each request it holds, so at thousands of requests a
process holds hundreds of thousands of them, and a full collection walks them all while no request moves (every
thread waits: the collector holds the GIL): a first token or a delta that arrives then waits it out. The
gateway's loop-lag probe (gateway/loop_lag.py) sees such a pause only if one of its timers falls due inside it;
this sees each one. ``freeze_startup_objects`` takes what start-up made (modules, classes, the services, a model's
modules) out of the collector's walk, so the walk is over what the requests hold.

A gateway also collects less often than Python's default (``GATEWAY_THRESHOLDS``). What a stream makes per token
dies at once, by reference count, and costs the collector nothing; what starts a collection is what lives on: the
few hundred objects of each request for as long as it runs. At Python's 700 net allocations a young collection runs
every couple of requests and walks every request still starting, older ones follow, and a full one walks them all
every few seconds; the gateway's thresholds make collections a small fraction as many, for a little more memory.
A full collection still comes every million net allocations or so, so cyclic garbage that reached the oldest generation
does not pile up for long.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from switchyard.shared.metrics import GC_PAUSE_BUCKETS, name

log = logging.getLogger("switchyard")

# (net allocations before a young collection, young ones before a middle one, middle ones before a full one).
GATEWAY_THRESHOLDS = (10_000, 10, 10)


def pause_histogram(registry: CollectorRegistry) -> Histogram:
    """The process's ``switchyard:gc_pause_seconds`` histogram, in ``registry`` (the gateway's, or a worker's)."""
    return Histogram(name("gc_pause_seconds"), "How long each of this process's garbage collections held it, by "
                     "generation (shared/gc_pauses.py); 2 is a full one.", ("generation",), buckets=GC_PAUSE_BUCKETS,
                     registry=registry)


class GcPauses:
    """Observes into ``histogram`` (label: ``generation``) each collection's length, from ``start`` to ``stop``."""

    def __init__(self, histogram: Histogram) -> None:
        self._began_at = 0.0
        self._by_generation = {g: histogram.labels(str(g)) for g in range(3)}

    def start(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # Runs inside the collector, in whichever thread triggered it: nothing here may allocate much.
        if phase == "start":
            self._began_at = time.perf_counter()
        else:
            self._by_generation[info["generation"]].observe(time.perf_counter() - self._began_at)


def freeze_startup_objects(thresholds: tuple[int, int, int] | None = None) -> int:
    """Moves every object alive now out of the collector's reach for good (``gc.freeze``): call once, after
    start-up, when what is alive is what lives as long as the process; ``thresholds``, when given, the collector's
    from now on. Returns how many were frozen."""
    gc.collect()  # start-up's own garbage, collected rather than frozen
    gc.freeze()
    if thresholds is not None:
        gc.set_threshold(*thresholds)
    frozen = gc.get_freeze_count()
    log.info("froze %d objects alive after start-up", frozen)
    return frozen


@contextlib.asynccontextmanager
async def startup_frozen() -> AsyncIterator[None]:
    """A companion of the gateway's app (gateway/app.py), the last one: entered once everything has started, it
    freezes what start-up made and sets the gateway's thresholds. Only the gateway process uses it; an app made in
    a test process does not."""
    freeze_startup_objects(GATEWAY_THRESHOLDS)
    yield
