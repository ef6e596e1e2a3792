"""``switchyard top``: a live view per model and tier, refreshed in the terminal.

Queues are read from JetStream (``queue_state``, what ``tiers show`` and the gateway's gauges read); latencies and
refusals from the gateways' ``/metrics``; running requests and tokens from each worker's ``/metrics``, found through
the worker registry. Figures over time are over the last refresh (switchyard/cli/top_view.py).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from switchyard.cli.top_view import COLUMNS, Samples, merge, parse, tier_rows, window

SCRAPE_TIMEOUT_S = 2.0


async def _scrape_all(http, urls: list[str]) -> tuple[Samples, list[str]]:
    """The samples of every URL summed, and the URLs that did not answer (left out, named in the footer)."""

    async def one(url: str) -> Samples | None:
        try:
            response = await http.get(url, timeout=SCRAPE_TIMEOUT_S)
            response.raise_for_status()
            return parse(response.text)
        except Exception:  # a gateway or worker away: the view goes on with the others
            return None

    results = await asyncio.gather(*(one(u) for u in urls))
    return merge(r for r in results if r is not None), [u for u, r in zip(urls, results) if r is None]


class TopReader:
    """Reads everything one refresh needs: queues, and the gateways' and workers' samples."""

    def __init__(self, js, http, gateway_urls: list[str]) -> None:
        self._js, self._http = js, http
        self._gateways = [u.rstrip("/") + "/metrics" for u in gateway_urls]

    async def read(self) -> tuple[dict, Samples, Samples, list[str]]:
        from switchyard.domain.queues import queue_state
        from switchyard.shared.jetstream import live_workers
        from switchyard.shared.tiers import TIER_NAMES

        workers = await live_workers(self._js)
        queues = {}
        for model in sorted({w.model for w in workers}):
            for tier in TIER_NAMES:
                state = await queue_state(self._js, model, tier)
                queues[(model, tier)] = (state.depth, state.oldest_age_s)
        gateways, gateways_away = await _scrape_all(self._http, self._gateways)
        worker_samples, workers_away = await _scrape_all(self._http, [w.metrics_url for w in workers
                                                                      if w.metrics_url])
        return queues, gateways, worker_samples, gateways_away + workers_away


def cmd_top(args: argparse.Namespace) -> int:
    import httpx
    from rich.console import Console
    from rich.live import Live

    from switchyard.cli.ops import _ops_config
    from switchyard.cli.tables import rows_table
    from switchyard.deploy.up import read_run_file
    from switchyard.shared import nats_client

    config = _ops_config(args)
    nats_url = config.nats_url
    assert nats_url is not None  # _ops_config exits without one
    gateway_urls = args.gateway or [read_run_file(config.data_dir).get("gateway_url") or "http://127.0.0.1:8000"]
    console = Console(width=None if sys.stdout.isatty() else 1000)  # piped: whole rows, as print_table

    async def run() -> int:
        nc = await nats_client.connect(nats_url, "switchyard-top", reconnect_forever=False,
                                       tls_ca=config.nats_tls_ca)
        try:
            async with httpx.AsyncClient() as http:
                reader = TopReader(nc.jetstream(), http, gateway_urls)
                _, gateways, workers, _ = await reader.read()
                before_at = time.monotonic()

                async def refresh():
                    nonlocal gateways, workers, before_at
                    await asyncio.sleep(args.interval)
                    queues, gw_now, wk_now, away = await reader.read()
                    now = time.monotonic()
                    rows = tier_rows(queues, wk_now, window(gateways, gw_now), window(workers, wk_now),
                                     now - before_at)
                    gateways, workers, before_at = gw_now, wk_now, now
                    caption = f"over the last {args.interval:g} s" + (f"; not answering: {', '.join(away)}"
                                                                       if away else "")
                    return rows_table(rows, COLUMNS, caption=caption)

                if args.once:  # one window, printed: for scripts and tests
                    console.print(await refresh())
                    return 0
                with Live(console=console, auto_refresh=False) as live:
                    while True:
                        live.update(await refresh(), refresh=True)
        finally:
            await nc.close()

    try:
        return asyncio.run(run())
    except KeyboardInterrupt:
        return 0
