"""``switchyard:tenant_state_entries{structure}``: the entries each in-memory structure of a process holds per
tenant, API key, client address or conversation, read when Prometheus scrapes (the gateway's ``/metrics``, a
worker's status port). docs/operating/metrics.md names every structure, and what forgets its entries.

Tenants come and go for days: a structure that gains an entry for each and never loses one grows with every tenant
ever seen. This gauge is how a soak (bench/soak.py) or an operator sees each fall back once tenants leave. Every
number is a ``len()`` of a dict or set, read by the scraping thread without a lock (the gateway's event loop, a
worker's status thread): a size read while its owner changes the structure is one of its sizes just before or
after, and the owner is never held up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily

from switchyard.shared.metrics import name

METRIC = name("tenant_state_entries")
DOCUMENTATION = ("Entries held in this process's memory per tenant, API key, client address or conversation, by "
                 "structure (docs/operating/metrics.md): each falls back once tenants leave.")

Sizes = Callable[[], Mapping[str, int]]  # structure -> its entries now


class TenantStateCollector:
    """A Prometheus collector: the sizes its owners report (``watch``), as one gauge family at each scrape."""

    def __init__(self) -> None:
        self._owners: dict[str, Sizes] = {}

    def watch(self, owner: str, sizes: Sizes) -> None:
        """Report ``sizes()`` (a short stable name per structure, unique in the process) at every scrape. Watching
        ``owner`` again replaces what it reported before (an app's middleware built again, a worker run again)."""
        self._owners[owner] = sizes

    def describe(self) -> list[GaugeMetricFamily]:
        return [_family()]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = _family()
        for sizes in list(self._owners.values()):
            for structure, entries in sizes().items():
                family.add_metric((structure,), entries)
        yield family


def _family() -> GaugeMetricFamily:
    return GaugeMetricFamily(METRIC, DOCUMENTATION, labels=("structure",))
