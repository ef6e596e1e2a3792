"""What the soak (bench/soak.py) reads of the running system at the end of each window: every process's resident
memory and open files, the JetStream streams, the Postgres tables, the data directory; and, at the end, the
ledger: each request's outcome as its client saw it against the billing rows in Postgres."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench.soak_load import Outcome


@dataclass
class Sample:
    at: float  # s into the soak
    processes: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (PSS bytes, open fds), tree summed
    streams: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # name -> (messages, bytes, consumers)
    # name -> (rows, bytes on disk); "(connections)": Postgres's client connections (the services' pools), 0 bytes
    tables: dict[str, tuple[int, int]] = field(default_factory=dict)
    data_dir_bytes: int = 0
    # process -> structure -> entries held per tenant, key, address or conversation (switchyard:tenant_state_entries)
    tenant_state: dict[str, dict[str, int]] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)  # name -> pid: a process restarted by a fault gets a new one


def process_usage(pid: int) -> tuple[int, int]:
    """(memory, open fds) of ``pid`` and every process below it (Postgres runs one per connection). Memory is the
    proportional set size: resident pages shared by several processes (Postgres's shared buffers) count once."""
    memory = fds = 0
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                memory += p.memory_full_info().pss
                fds += p.num_fds()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
    except psutil.NoSuchProcess:
        pass
    return memory, fds


# Postgres's shared memory: the main segment (shared buffers, an anonymous shared mapping shown as /dev/zero), the
# small System V segment, and dynamic shared memory under /dev/shm. Its size is fixed by configuration
# (shared_buffers), and it fills as pages are first read: counted apart so that its filling is not read as a leak.
SHARED_SEGMENT_PREFIXES = ("/dev/zero", "/SYSV", "/dev/shm/")


def split_shared_memory(pid: int) -> tuple[int, int]:
    """(memory outside shared segments, memory in them) of ``pid`` and every process below it, both as PSS."""
    private = shared = 0
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                for m in p.memory_maps(grouped=True):
                    if m.path.startswith(SHARED_SEGMENT_PREFIXES):
                        shared += m.pss
                    else:
                        private += m.pss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
    except psutil.NoSuchProcess:
        pass
    return private, shared


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


async def jetstream_state(nats_url: str) -> dict[str, tuple[int, int, int]]:
    from switchyard.shared import nats_client

    nc = await nats_client.connect(nats_url, "soak-probe", reconnect_forever=False)
    try:
        return {info.config.name: (info.state.messages, info.state.bytes, info.state.consumer_count)
                for info in await nc.jetstream(timeout=5).streams_info()}
    finally:
        await nc.close()


async def table_state(database_url: str) -> dict[str, tuple[int, int]]:
    import asyncpg

    conn = await asyncpg.connect(database_url, timeout=10)
    try:
        names = [r["relname"] for r in await conn.fetch("SELECT relname FROM pg_stat_user_tables ORDER BY relname")]
        tables = {name: (await conn.fetchval(f'SELECT count(*) FROM "{name}"'),
                         await conn.fetchval("SELECT pg_total_relation_size($1::regclass)", name))
                  for name in names}
        tables["(connections)"] = (await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"), 0)
        return tables
    finally:
        await conn.close()


def tenant_state_of(metrics_text: str) -> dict[str, int]:
    """``switchyard:tenant_state_entries`` by structure, out of a Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.labels["structure"]: int(s.value) for family in text_string_to_metric_families(metrics_text)
            if family.name == "switchyard:tenant_state_entries" for s in family.samples}


async def tenant_state(gateways: dict[str, str], nats_url: str) -> dict[str, dict[str, int]]:
    """Each gateway's (``gateways``: name -> base URL) and each live worker's tenant state."""
    import httpx

    from switchyard.shared import nats_client
    from switchyard.shared.jetstream import live_workers

    endpoints = {name: f"{url}/metrics" for name, url in gateways.items()}
    nc = await nats_client.connect(nats_url, "soak-probe", reconnect_forever=False)
    try:
        endpoints |= {f"worker pid {w.pid}": w.metrics_url for w in await live_workers(nc.jetstream(timeout=5))
                      if w.metrics_url}
    finally:
        await nc.close()
    out = {}
    async with httpx.AsyncClient(timeout=10) as http:
        for name, url in endpoints.items():
            try:
                out[name] = tenant_state_of((await http.get(url)).text)
            except httpx.HTTPError:
                continue  # a process restarting
    return out


async def sample(at: float, pids: dict[str, int], nats_url: str, database_url: str, data_dir: Path,
                 gateways: dict[str, str]) -> Sample:
    """One window's figures; a server that cannot be read right now (a fault) leaves its part empty."""
    out = Sample(at, {name: process_usage(pid) for name, pid in pids.items()}, data_dir_bytes=dir_bytes(data_dir),
                 pids=dict(pids))
    if "postgres" in pids:
        private, shared = split_shared_memory(pids["postgres"])
        out.processes["postgres, outside shared memory"] = (private, out.processes["postgres"][1])
        out.processes["postgres, shared memory (shared_buffers)"] = (shared, 0)
    try:
        out.streams = await jetstream_state(nats_url)
        out.tenant_state = await tenant_state(gateways, nats_url)
    except Exception:  # noqa: BLE001 - NATS restarting
        pass
    try:
        out.tables = await table_state(database_url)
    except Exception:  # noqa: BLE001 - Postgres stopped
        pass
    return out


@dataclass
class LedgerCheck:
    """The ledger against the billing rows: every figure but ``billed_ok`` should be 0."""

    completed: int = 0
    billed_ok: int = 0  # completed requests with exactly their row, tokens as the client was told
    unbilled: list[str] = field(default_factory=list)  # completed, no row
    misbilled: list[str] = field(default_factory=list)  # completed, its row's completion tokens differ
    billed_refused: list[str] = field(default_factory=list)  # refused (never accepted), yet a row
    failed_billed: int = 0  # ran, then answered with an error, billed once for what ran (no row: it ran no token)
    unknown_rows: list[str] = field(default_factory=list)  # rows no client request names
    twice: int = 0  # request ids with more than one usage record on the USAGE stream
    seats_held: list[str] = field(default_factory=list)  # "kind request-id" of open_requests rows left at the end

    @property
    def exact(self) -> bool:
        return not (self.unbilled or self.misbilled or self.billed_refused or self.twice)


async def prompt_tokens_by_time(database_url: str, model: str) -> list[tuple[float, int, int]]:
    """Every request of ``model`` that ran: (accepted at, epoch s; prompt tokens; of them found cached), so that a
    report can show what a fault cost in prefill recomputed (a worker's death takes its prefix cache with it)."""
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT extract(epoch FROM created_at) AS at, prompt_tokens, cached_tokens "
                                "FROM requests WHERE model = $1", model)
    finally:
        await conn.close()
    return [(float(r["at"]), r["prompt_tokens"], r["cached_tokens"]) for r in rows]


async def check_ledger(ledger: list[Outcome], database_url: str, nats_url: str, usage_duplicates: int,
                       also_named: Iterable[str] = ()) -> LedgerCheck:
    """Once the billing writer has written every usage record: compare. ``unknown_rows`` are reported, not failed:
    a gateway SIGKILLed after publishing a request, before its client heard of it, leaves a request the worker
    serves and bills (its tokens were served) that no client can name. ``also_named``: request ids sent besides
    the ledger's (the soak's probes)."""
    import asyncpg

    from tests.support.system import wait_usage_written

    await wait_usage_written(nats_url, timeout_s=120)
    conn = await asyncpg.connect(database_url)
    try:
        found = await conn.fetch("SELECT request_id, completion_tokens, finish_reason, tier, created_at FROM requests")
        open_ids = [r["request_id"] for r in await conn.fetch("SELECT request_id FROM open_requests")]
        rows = {r["request_id"]: r["completion_tokens"] for r in found}
    finally:
        await conn.close()
    check, named = LedgerCheck(twice=usage_duplicates), set(also_named)
    for out in ledger:
        named.update(out.request_ids)
        if out.status == "completed":
            check.completed += 1
            billed = [rows.get(rid) for rid in out.request_ids]
            if not out.request_ids or any(b is None for b in billed):
                check.unbilled.append(",".join(out.request_ids) or f"{out.kind} without an id")
            elif out.completion_tokens is not None and sum(billed) != out.completion_tokens:
                check.misbilled.append(",".join(out.request_ids))
            else:
                check.billed_ok += 1
        elif out.status == "refused":
            check.billed_refused += [rid for rid in out.request_ids if rid in rows]
        elif out.status == "failed":
            check.failed_billed += sum(rid in rows for rid in out.request_ids)
    kinds = {rid: out.kind for out in ledger for rid in out.request_ids}
    check.seats_held = [f"{kinds.get(rid, '?')} {rid}" for rid in open_ids]
    unknown = set(rows) - named
    check.unknown_rows = [f"{r['request_id']} ({r['tier']}, {r['finish_reason']}, {r['completion_tokens']} tokens, "
                          f"{r['created_at']:%H:%M:%S})" for r in found if r["request_id"] in unknown]
    return check
