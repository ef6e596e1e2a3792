"""Batch interference benchmark (issue 6): does a running 500-line batch change interactive pro-tier TTFT p95 by
less than 20%?

    .venv/bin/python bench/batch.py                           # starts its own system, ~5 minutes on 2 CPU cores
    .venv/bin/python bench/batch.py --rate 0.5 --duration 75 --lines 500 --max-num-seqs 16

Starts embedded NATS + Postgres in a temp dir (as bench/overload.py does), one worker (SmolLM2-135M,
``--max-num-seqs``) and one gateway with an admin key, and creates a pro-tier tenant with limits far above the
load. Phase A: pro alone, open-loop Poisson arrivals at ``--rate`` for ``--duration`` s (streaming chat,
max_tokens 32, ignore_eos; the request client of bench/overload.py). Phase B: a ``--lines`` batch of the same
kind of chat lines is uploaded and created with the official openai client; once it is in_progress and its lines
hold the worker's seats, the same pro load (same seed) runs again. Reported: pro TTFT p50/p95 and TPOT p50 per
phase, worker-side queue / first-token times from Postgres ``requests``, batch seats seen running (heartbeats via
``GET /admin/tiers``), batch lines completed during phase B and lines/s. Target: pro TTFT p95 B/A - 1 < 20%.
The batch is cancelled at the end; everything is stopped by PID and the temp dir removed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.overload import MODEL, PROMPTS, drain, ms, one, pct, poisson  # noqa: E402
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402
from tests.support import system as support  # noqa: E402
from tests.support.system import free_port  # noqa: E402

LIMIT = 100_000_000  # rpm / tpm: far above the load, fits Postgres integer


async def make_key(database_url: str) -> str:
    from switchyard.migrations import apply_migrations

    await apply_migrations(database_url)
    return await support.make_key(database_url, "bench-batch", rpm_limit=LIMIT, tpm_limit=LIMIT)


def cpu_snapshot(pids: list[int]) -> tuple:
    """(time, machine busy ticks, {pid: utime + stime ticks}) from /proc: to see who used the 2 cores."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    ticks = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks[pid] = int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            ticks[pid] = 0
    return time.monotonic(), sum(f) - f[3] - f[4], ticks


def cpu_use(a: tuple, b: tuple) -> tuple[float, float]:
    """Cores busy over [a, b]: the whole machine, and this benchmark's worker + gateway + client."""
    hz, dt = os.sysconf("SC_CLK_TCK"), b[0] - a[0]
    return (b[1] - a[1]) / hz / dt, sum(b[2][p] - a[2].get(p, 0) for p in b[2]) / hz / dt


def stats(results: list, phase: str) -> dict:
    rs = [r for r in results if r.phase == phase]
    ok = [r for r in rs if r.outcome == "completed"]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [(r.latency - r.ttft) / (r.tokens - 1) for r in ok if r.ttft is not None and r.tokens > 1]
    return {"sent": len(rs), "completed": len(ok), "failed": sorted({r.outcome for r in rs} - {"completed"}),
            "p50": pct(ttfts, 50), "p95": pct(ttfts, 95), "max": max(ttfts, default=None), "tpot": pct(tpots, 50)}


async def sample_running(http, admin_key: str, samples: list, stop: asyncio.Event) -> None:
    """Running requests per tier on the worker (its 3 s heartbeat) and queued per tier, once a second."""
    while not stop.is_set():
        try:
            r = await http.get("/admin/tiers", headers={"Authorization": f"Bearer {admin_key}"})
            rows = [x for x in r.json()["data"] if x["model"] == MODEL]
            samples.append({x["tier"]: (x["running"], x["queued"]) for x in rows})
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        await asyncio.sleep(1.0)


async def run(args, base_url: str, api_key: str, admin_key: str) -> dict:
    from openai import AsyncOpenAI, ConflictError

    out: dict = {"load_start": os.getloadavg()}
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=100, keepalive_expiry=2.0)
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=60)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=httpx.Timeout(120, connect=10),
                                 headers={"Authorization": f"Bearer {api_key}"}) as http:
        results: list = []
        await drain([asyncio.create_task(one(http, "pro", "warmup", args, random.Random(0), results))
                     for _ in range(2)], 120)
        n_max = int(args.rate * args.duration * 2) + 10

        async def phase(name: str) -> float:
            t0, c0 = time.time(), cpu_snapshot(args.pids)
            tasks = await poisson(http, "pro", name, args.rate, args.duration, n_max, args.seed, args, results)
            await drain(tasks, 90)
            out[f"cpu_{name}"] = cpu_use(c0, cpu_snapshot(args.pids))
            return t0

        print(f"phase A: pro alone, {args.rate} req/s for {args.duration:.0f} s", flush=True)
        out["a_since"] = await phase("A")
        out["a_until"] = time.time()

        rng = random.Random(args.seed + 7)
        lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"model": MODEL, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                                      "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0}})
                 for i in range(1, args.lines + 1)]
        f = await client.files.create(file=("bench-batch.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        t0, samples, stop = time.monotonic(), [], asyncio.Event()
        sampler = asyncio.create_task(sample_running(http, admin_key, samples, stop))
        while time.monotonic() - t0 < args.settle_timeout:  # in_progress, and batch lines hold the seats
            b = await client.batches.retrieve(b.id)
            seats = samples[-1].get("batch", (0, 0))[0] if samples else 0
            if b.status == "in_progress" and seats >= args.max_num_seqs:
                break
            await asyncio.sleep(1.0)
        out["settle_s"] = time.monotonic() - t0
        print(f"batch {b.id}: {b.status} after {out['settle_s']:.0f} s, {b.request_counts.completed} lines done, "
              f"batch running {samples[-1].get('batch') if samples else '?'}", flush=True)
        out["batch_status_at_b"] = b.status
        done0, tb = b.request_counts.completed, time.monotonic()
        samples.clear()
        print(f"phase B: pro {args.rate} req/s for {args.duration:.0f} s with the batch running", flush=True)
        out["b_since"] = await phase("B")
        out["b_until"] = time.time()
        b = await client.batches.retrieve(b.id)
        out["batch_status_end_b"] = b.status
        out["batch_done"], out["batch_wall"] = b.request_counts.completed - done0, time.monotonic() - tb
        out["batch_total"], out["batch_completed_total"] = b.request_counts.total, b.request_counts.completed
        stop.set()
        await sampler
        running_batch = [s.get("batch", (0, 0))[0] for s in samples]
        running_pro = [s.get("pro", (0, 0))[0] for s in samples]
        out["batch_seats"] = (min(running_batch, default=0), sum(running_batch) / max(1, len(running_batch)),
                              max(running_batch, default=0))
        out["pro_running_max"] = max(running_pro, default=0)
        held = [s.get("batch", (0, 0))[0] + s.get("pro", (0, 0))[0] for s in samples]  # incl. engine-waiting
        out["over_seats"] = (sum(h > args.max_num_seqs for h in held), len(held), max(held, default=0))
        out["queued_max"] = {t: max((s.get(t, (0, 0))[1] for s in samples), default=0) for t in ("pro", "batch")}
        terminal = ("completed", "failed", "expired", "cancelled")
        if b.status not in terminal:
            try:
                b = await client.batches.cancel(b.id)
            except ConflictError:  # it finished in between
                b = await client.batches.retrieve(b.id)
            t1 = time.monotonic()
            while b.status not in terminal and time.monotonic() - t1 < args.cancel_timeout:
                await asyncio.sleep(1.0)
                b = await client.batches.retrieve(b.id)
        out["batch_final"] = f"{b.status} ({b.request_counts.completed}/{b.request_counts.total} lines completed)"
        out["A"], out["B"] = stats(results, "A"), stats(results, "B")
        out["load_end"] = os.getloadavg()
        await client.close()
    return out


async def server_times(database_url: str, windows: dict) -> dict:
    """Worker-side pro times per phase from `requests`: n, queue_ms p50/p95, first_token_ms p50/p95, and
    first_token_ms - queue_ms (admitted to first token) p50/p95."""
    import asyncpg

    q = ", ".join(f"round(percentile_cont({f}) WITHIN GROUP (ORDER BY {c})::numeric)::int"
                  for c in ("queue_ms", "first_token_ms", "first_token_ms - queue_ms") for f in (0.5, 0.95))
    conn = await asyncpg.connect(database_url)
    try:
        res = {}
        for name, (since, until) in windows.items():
            res[name] = tuple(await conn.fetchrow(
                f"SELECT count(*), {q} FROM requests WHERE tier = 'pro' AND created_at >= to_timestamp($1) "
                "AND created_at < to_timestamp($2)", since, until))
        res["batch_rows"] = await conn.fetchval("SELECT count(*) FROM requests WHERE tier = 'batch'")
        since, until = windows["B"]  # phase B: pro queue_ms by how many pro requests were in flight at arrival
        res["by_inflight"] = [tuple(r) for r in await conn.fetch(
            "WITH p AS (SELECT created_at, queue_ms, created_at + total_ms * interval '1 ms' AS ended FROM requests "
            "WHERE tier = 'pro' AND created_at >= to_timestamp($1) AND created_at < to_timestamp($2)), "
            "f AS (SELECT queue_ms, (SELECT count(*) FROM p q WHERE q.created_at < p.created_at "
            "AND q.ended > p.created_at) AS k FROM p) SELECT least(k, 2), count(*), "
            "round(percentile_cont(0.5) WITHIN GROUP (ORDER BY queue_ms)::numeric)::int, round(max(queue_ms))::int "
            "FROM f GROUP BY 1 ORDER BY 1", since, until)]
        return res
    finally:
        await conn.close()


def report(args, out: dict, command: str) -> str:
    a, b = out["A"], out["B"]
    change = b["p95"] / a["p95"] - 1 if a["p95"] and b["p95"] else None
    verdict = "n/a" if change is None else ("MET" if change < 0.20 else "NOT MET")
    lines = [
        f"## Batch vs interactive: pro TTFT while a {args.lines}-line batch runs ({datetime.date.today().isoformat()})",
        "", f"`{command}`", "",
        f"Machine: {os.cpu_count()} CPU cores, no GPU; load average {out['load_start'][0]:.2f} at the start, "
        f"{out['load_end'][0]:.2f} at the end. One worker (SmolLM2-135M, max_num_seqs={args.max_num_seqs}), one "
        f"gateway, embedded NATS + Postgres. Pro: streaming chat, max_tokens={args.max_tokens}, ignore_eos, Poisson "
        f"{args.rate} req/s for {args.duration:.0f} s (seed {args.seed}, same arrivals in both phases). Batch: "
        f"{args.lines} chat lines, max_tokens={args.max_tokens}, ignore_eos, via the openai client; phase B started "
        f"{out['settle_s']:.0f} s after create (status {out['batch_status_at_b']}).", ""]
    rows = []
    for name, s in (("A: pro alone", a), ("B: pro + batch", b)):
        st = out.get("server", {}).get(name[0], (0,) + (None,) * 6)
        rows.append((name, s["sent"], s["completed"], ms(s["p50"]), ms(s["p95"]), ms(s["max"]), ms(s["tpot"]),
                     f"{st[1]}/{st[2]}", f"{st[3]}/{st[4]}", f"{st[5]}/{st[6]}"))
    lines.append(markdown_table(("phase", "pro sent", "completed", "TTFT p50 ms", "TTFT p95 ms", "TTFT max ms",
                                 "TPOT p50 ms", "worker queue_ms p50/p95", "worker first_token_ms p50/p95",
                                 "admitted→first token p50/p95"), rows))
    bs = out["batch_seats"]
    lines += [
        "",
        f"- pro TTFT p95 change B/A - 1 = {'n/a' if change is None else f'{change:+.0%}'} "
        f"({ms(a['p95'])} -> {ms(b['p95'])} ms; target < +20%): {verdict}",
        f"- batch during phase B: {out['batch_done']} lines completed in {out['batch_wall']:.0f} s = "
        f"{out['batch_done'] / out['batch_wall']:.2f} lines/s "
        f"({out['batch_done'] * args.max_tokens / out['batch_wall']:.0f} output tok/s); "
        f"batch seats running min/mean/max {bs[0]}/{bs[1]:.1f}/{bs[2]} of {args.max_num_seqs}; "
        f"pro running max {out['pro_running_max']}; queued max {json.dumps(out['queued_max'])}; samples with "
        f"pro + batch held by the worker > {args.max_num_seqs} seats (preempted lines waiting in the engine): "
        f"{out['over_seats'][0]}/{out['over_seats'][1]}, max held {out['over_seats'][2]}",
        f"- phase B pro worker queue_ms by pro requests already in flight at arrival (k, n, p50, max): "
        f"{out.get('server', {}).get('by_inflight')}",
        "- CPU cores busy (machine / this benchmark's worker + gateway + client): A {:.2f}/{:.2f}, B {:.2f}/{:.2f}"
        .format(*out["cpu_A"], *out["cpu_B"]),
        f"- batch status at the end of phase B: {out['batch_status_end_b']}; after cancel: {out['batch_final']}; "
        f"`requests` rows with tier batch: {out.get('server', {}).get('batch_rows')}",
    ]
    if a["failed"] or b["failed"]:
        lines.append(f"- pro outcomes other than completed: A {a['failed']}, B {b['failed']}")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="model directory (default: the cache's smollm2)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rate", type=float, default=0.5, help="pro requests per second (Poisson)")
    p.add_argument("--duration", type=float, default=75.0, help="seconds of pro arrivals per phase")
    p.add_argument("--lines", type=int, default=500)
    p.add_argument("--batch-seqs-when-busy", type=int,
                   help="the worker's batch throttle while pro traffic is about (default: the worker's, 2 on CPU; "
                   "0: off)")
    p.add_argument("--settle-timeout", type=float, default=60.0, help="max wait for the batch to fill the seats")
    p.add_argument("--cancel-timeout", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", type=Path, default=RESULTS, help="'-' to skip")
    args = p.parse_args()
    command = command_line()
    from switchyard.deploy.system import LocalSystem
    from switchyard.shared.config import GatewayConfig, SwitchyardConfig, WorkerConfig

    model = Path(args.model or SwitchyardConfig().model_cache_dir / MODEL)
    if not (model / "config.json").exists():
        sys.exit(f"no model at {model}: run `switchyard models pull {MODEL}` or pass --model")
    work, out, admin_key = Path(tempfile.mkdtemp(prefix="switchyard-batchbench-")), None, secrets.token_urlsafe(16)
    os.chmod(work, 0o755)  # Postgres runs as nobody under root and must enter it
    worker = WorkerConfig(model=str(model), served_model_name=MODEL, max_num_seqs=args.max_num_seqs)
    if args.batch_seqs_when_busy is not None:
        worker.batch_seqs_when_busy = args.batch_seqs_when_busy
    system = LocalSystem(SwitchyardConfig(data_dir=work, gateway=GatewayConfig(port=free_port(), admin_key=admin_key),
                                          worker=worker), log_dir=work, log_level="WARNING", ephemeral=True)
    try:
        system.start_servers()
        database_url = system.config.database_url
        api_key = asyncio.run(make_key(database_url))
        worker_proc, gateway_proc = system.start_worker(), system.start_gateway()
        base_url, t0 = system.url(), time.monotonic()
        system.wait_until_ready(MODEL, timeout_s=300)
        print(f"system up in {time.monotonic() - t0:.1f} s at {base_url}", flush=True)
        args.pids = [worker_proc.pid, gateway_proc.pid, os.getpid()]
        out = asyncio.run(run(args, base_url, api_key, admin_key))
        time.sleep(2)  # the usage writer is asynchronous
        out["server"] = asyncio.run(server_times(database_url, {"A": (out["a_since"], out["a_until"]),
                                                                "B": (out["b_since"], out["b_until"])}))
    finally:
        if out is None:
            for svc in system.services:
                print(f"--- {svc.name} log tail ---\n{svc.log_tail(30)}")
        system.stop()
        shutil.rmtree(work, ignore_errors=True)
    text = report(args, out, command)
    print("\n" + text)
    append_section(text, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
