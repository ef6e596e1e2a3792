"""Overload benchmark: does the pro tier keep its latency while the free tier floods the system at several times
its capacity, and is every request answered (completed, or refused with a reason)?

    .venv/bin/python bench/overload.py                       # starts its own system, ~4 minutes on 2 CPU cores
    .venv/bin/python bench/overload.py --max-num-seqs 16 --free-x 4 --pro-frac 0.2 --duration 60
    .venv/bin/python bench/overload.py --base-url http://127.0.0.1:8000 --api-key sk-... --admin-key ...

Without ``--base-url`` it starts embedded NATS + Postgres in a temp dir, applies migrations, creates a tenant with
no rate limits, and runs one worker (SmolLM2-135M from the model cache) and one gateway with
``allow_tier_header`` and an admin key; everything is stopped by PID at the end and the temp dir removed.

Load, as in ``vllm bench serve``: streaming chat requests (``stream_options.include_usage``, ``ignore_eos``, fixed
``max_tokens``, short prompts), open loop with Poisson arrivals (fixed seed); the tier is set per request with
``X-Switchyard-Tier``. Phases: (0) capacity: a burst of 2 x max_num_seqs requests, capacity = completed / wall
(skipped with ``--capacity``); (1) idle: pro alone at a low rate; (2) overload: the free queue is bounded through
the admin API, then free at ``--free-x`` x capacity plus pro at ``--pro-frac`` x capacity for ``--duration`` s,
then every request is awaited (bounded). TTFT = send to first chunk with content; TPOT = (latency - TTFT) /
(output tokens - 1). Outcomes: completed (200, [DONE], usage with max_tokens completion tokens), 429 queue_full,
503 queue_timeout, "other" = any other error answer with an OpenAI error body (HTTP or in-stream), and "lost" =
sent - completed - 429 - 503 - other: exceptions, streams cut short, wrong token counts, unanswered at the end.
Targets: pro TTFT p95 under the flood <= 2x idle; no other errors; nothing lost.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402
from tests.support import system as support  # noqa: E402
from tests.support.system import free_port  # noqa: E402

MODEL = "smollm2"
PROMPTS = ["Say hello.", "Name a color.", "Count to five.", "What is 2+2?", "Tell me a fact.", "Pick a number."]


@dataclass
class Result:
    tier: str
    phase: str
    outcome: str = "lost:unanswered"  # completed | queue_full | queue_timeout | other:<why> | lost:<why>
    status: int | None = None
    ttft: float | None = None
    latency: float | None = None
    tokens: int = 0


async def one(http: httpx.AsyncClient, tier: str, phase: str, args, rng: random.Random, results: list) -> None:
    res = Result(tier, phase)
    results.append(res)
    body = {"model": MODEL, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": args.max_tokens, "ignore_eos": True,
            "temperature": 0}
    t0 = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Switchyard-Tier": tier}) as r:
            res.status = r.status_code
            if r.status_code != 200:
                raw = await r.aread()
                try:
                    code = json.loads(raw)["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    res.outcome = f"lost:http{r.status_code}-no-error-body"
                    return
                if (r.status_code, code) in {(429, "queue_full"), (503, "queue_timeout")}:
                    res.outcome = code
                else:
                    res.outcome = f"other:{r.status_code}:{code}"
                return
            done, usage, error = False, None, None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    error = obj["error"].get("code") or obj["error"].get("type")
                    continue
                for choice in obj.get("choices") or []:
                    if choice["delta"].get("content") and res.ttft is None:
                        res.ttft = time.perf_counter() - t0
                usage = obj.get("usage") or usage
            res.latency = time.perf_counter() - t0
            res.tokens = usage["completion_tokens"] if usage else 0
            if error is not None:
                res.outcome = f"other:stream:{error}"
            elif not done or usage is None:
                res.outcome = "lost:stream-cut-short"
            elif res.tokens != args.max_tokens:
                res.outcome = f"lost:{res.tokens}-tokens"
            else:
                res.outcome = "completed"
    except Exception as exc:  # connection reset, client timeout, bad JSON: the client got no reason
        res.outcome = f"lost:{type(exc).__name__}:{'before' if res.status is None else 'after'}-headers"


async def poisson(http, tier: str, phase: str, rate: float, duration: float, max_count: int, seed: int, args,
                  results: list) -> list[asyncio.Task]:
    """Open loop: start a request at each Poisson arrival, never waiting for earlier ones."""
    rng, tasks = random.Random(seed), []
    start = next_at = time.perf_counter()
    while len(tasks) < max_count:
        next_at += rng.expovariate(rate)
        if next_at - start > duration:
            break
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        tasks.append(asyncio.create_task(one(http, tier, phase, args, rng, results)))
    return tasks


async def drain(tasks: list[asyncio.Task], timeout: float) -> None:
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for t in pending:  # their Result stays "lost:unanswered"
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * len(values) + 0.5) - 1))]  # nearest rank


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def summarize(results: list[Result], phase: str, tier: str) -> dict:
    rs = [r for r in results if r.phase == phase and r.tier == tier]
    count = lambda pred: sum(1 for r in rs if pred(r.outcome))  # noqa: E731
    ok = [r for r in rs if r.outcome == "completed"]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [(r.latency - r.ttft) / (r.tokens - 1) for r in ok if r.ttft is not None and r.tokens > 1]
    s = {"phase": phase, "tier": tier, "sent": len(rs), "accepted": sum(1 for r in rs if r.status == 200),
         "429 queue_full": count(lambda o: o == "queue_full"),
         "503 queue_timeout": count(lambda o: o == "queue_timeout"),
         "completed": len(ok), "other err": count(lambda o: o.startswith("other:")),
         "TTFT p50": pct(ttfts, 50), "TTFT p95": pct(ttfts, 95), "TPOT p50": pct(tpots, 50)}
    s["lost"] = s["sent"] - s["completed"] - s["429 queue_full"] - s["503 queue_timeout"] - s["other err"]
    s["why"] = sorted({r.outcome for r in rs if r.outcome.startswith(("other:", "lost:"))})
    return s


COLS = ("phase", "tier", "sent", "accepted", "429 queue_full", "503 queue_timeout", "completed", "other err", "lost",
        "TTFT p50", "TTFT p95", "TPOT p50")


def table(rows: list[dict]) -> str:
    head = [c + (" ms" if c.startswith(("TTFT", "TPOT")) else "") for c in COLS]
    return markdown_table(head, [[ms(s[c]) if c.startswith(("TTFT", "TPOT")) else s[c] for c in COLS] for s in rows])


async def admin(http: httpx.AsyncClient, args, method: str, path: str, **kw):
    r = await http.request(method, path, headers={"Authorization": f"Bearer {args.admin_key}"}, **kw)
    r.raise_for_status()
    return r.json()


async def sample_queues(http, args, peaks: dict, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            for row in (await admin(http, args, "GET", "/admin/tiers"))["data"]:
                if row["model"] == MODEL:
                    peaks[row["tier"]] = max(peaks.get(row["tier"], 0), row["queued"])
        except httpx.HTTPError:
            pass
        await asyncio.sleep(1.0)


async def run_load(args) -> dict:
    # Idle connections are dropped before uvicorn's 5 s keep-alive timeout does it, so a request never races a
    # server-side close (that would be a client artefact, not the system's).
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=args.base_url, limits=limits,
                                 headers={"Authorization": f"Bearer {args.api_key}"},
                                 timeout=httpx.Timeout(args.free_max_wait + 120, connect=10)) as http:
        results: list[Result] = []
        out: dict = {"load_start": os.getloadavg()}
        warm = [asyncio.create_task(one(http, "pro", "warmup", args, random.Random(0), results)) for _ in range(2)]
        await drain(warm, 120)
        cap = args.capacity
        if not cap:
            t0 = time.perf_counter()
            burst = [asyncio.create_task(one(http, "pro", "capacity", args, random.Random(1), results))
                     for _ in range(2 * args.max_num_seqs)]
            await drain(burst, 180)
            done = sum(1 for r in results if r.phase == "capacity" and r.outcome == "completed")
            cap = done / (time.perf_counter() - t0)
            print(f"capacity: {done} requests x {args.max_tokens} tokens in {time.perf_counter() - t0:.1f} s -> "
                  f"{cap:.2f} req/s ({cap * args.max_tokens:.0f} output tok/s)", flush=True)
        out["capacity"] = cap
        print(f"idle: pro alone at {args.idle_rate} req/s, up to {args.idle_requests} requests", flush=True)
        idle = await poisson(http, "pro", "idle", args.idle_rate, 3 * args.idle_requests / args.idle_rate,
                             args.idle_requests, args.seed, args, results)
        await drain(idle, 120)
        originals = {r["tier"]: r for r in (await admin(http, args, "GET", "/admin/tiers"))["data"]
                     if r["model"] == MODEL}
        await admin(http, args, "PUT", "/admin/tiers/free",
                    json={"max_queued": args.free_max_queued, "max_wait_s": args.free_max_wait})
        await asyncio.sleep(1.5)  # policy caches (gateway, worker) refresh within a second
        out["policies"] = {r["tier"]: {k: r[k] for k in ("max_queued", "max_wait_s", "weight")}
                           for r in (await admin(http, args, "GET", "/admin/tiers"))["data"] if r["model"] == MODEL}
        print("tier policies for the overload phase:", json.dumps(out["policies"]), flush=True)
        free_rate, pro_rate = args.free_x * cap, args.pro_frac * cap
        out["rates"] = (free_rate, pro_rate)
        print(f"overload: free {free_rate:.2f} req/s + pro {pro_rate:.2f} req/s for {args.duration:.0f} s", flush=True)
        peaks: dict = {}
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_queues(http, args, peaks, stop))
        t0, out["overload_since"] = time.perf_counter(), time.time()
        gens = await asyncio.gather(
            poisson(http, "free", "overload", free_rate, args.duration, int(free_rate * args.duration * 2) + 10,
                    args.seed + 1, args, results),
            poisson(http, "pro", "overload", pro_rate, args.duration, int(pro_rate * args.duration * 2) + 10,
                    args.seed + 2, args, results))
        await drain([t for g in gens for t in g], args.free_max_wait + 90)
        out["overload_wall"] = time.perf_counter() - t0
        stop.set()
        await sampler
        out["peak_queued"] = peaks
        if args.restore:
            for tier, row in originals.items():
                await admin(http, args, "PUT", f"/admin/tiers/{tier}",
                            json={k: row[k] for k in ("max_queued", "max_wait_s", "weight")})
        out["load_end"] = os.getloadavg()
        out["rows"] = [summarize(results, "idle", "pro"), summarize(results, "overload", "pro"),
                       summarize(results, "overload", "free")]
        tokens = sum(r.tokens for r in results if r.phase == "overload" and r.outcome == "completed")
        out["overload_tok_s"] = tokens / out["overload_wall"]
        return out



async def make_key(database_url: str) -> str:
    from switchyard.migrations import apply_migrations

    await apply_migrations(database_url)
    # No per-key rate limits: this measures the queues, not the limiter.
    return await support.make_key(database_url, "bench-overload", rpm_limit=2**31 - 1, tpm_limit=2**31 - 1)


async def usage_rows(database_url: str, since: float) -> tuple[list, list]:
    """Usage rows per (tier, finish_reason), all phases; and the worker's own queue / first-token times, overload."""
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        counts = [tuple(r) for r in await conn.fetch(
            "SELECT tier, finish_reason, count(*) FROM requests GROUP BY 1, 2 ORDER BY 1, 2")]
        q = ", ".join(f"round(percentile_cont({f}) WITHIN GROUP (ORDER BY {c})::numeric)::int"
                      for c in ("queue_ms", "first_token_ms") for f in (0.5, 0.95))
        times = [tuple(r) for r in await conn.fetch(
            f"SELECT tier, count(*), {q} FROM requests WHERE created_at >= to_timestamp($1) GROUP BY 1 ORDER BY 1",
            since)]
        return counts, times
    finally:
        await conn.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", help="use a running gateway (needs --api-key and --admin-key)")
    p.add_argument("--api-key")
    p.add_argument("--admin-key")
    p.add_argument("--model", help="model directory (default: the cache's smollm2)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--capacity", type=float, help="req/s the worker sustains (default: measured)")
    p.add_argument("--idle-rate", type=float, default=0.5)
    p.add_argument("--idle-requests", type=int, default=20)
    p.add_argument("--free-x", type=float, default=4.0, help="free rate as a multiple of capacity")
    p.add_argument("--pro-frac", type=float, default=0.2, help="pro rate as a fraction of capacity")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--free-max-queued", type=int, default=16)
    p.add_argument("--free-max-wait", type=float, default=15.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-restore", dest="restore", action="store_false", help="keep the tier limits afterwards")
    p.add_argument("--results", type=Path, default=RESULTS, help="'-' to skip")
    args = p.parse_args()
    command = command_line()
    system, work, database_url = None, None, None
    try:
        if not args.base_url:
            from switchyard.deploy.system import LocalSystem
            from switchyard.shared.config import GatewayConfig, SwitchyardConfig, WorkerConfig

            model = Path(args.model or SwitchyardConfig().model_cache_dir / MODEL)
            if not (model / "config.json").exists():
                sys.exit(f"no model at {model}: run `switchyard models pull {MODEL}` or pass --model")
            work = Path(tempfile.mkdtemp(prefix="switchyard-overload-"))
            os.chmod(work, 0o755)  # Postgres runs as nobody under root and must enter it
            args.admin_key = secrets.token_urlsafe(16)
            config = SwitchyardConfig(
                data_dir=work,
                gateway=GatewayConfig(port=free_port(), allow_tier_header=True, admin_key=args.admin_key),
                worker=WorkerConfig(model=str(model), served_model_name=MODEL, max_num_seqs=args.max_num_seqs))
            system = LocalSystem(config, log_dir=work, log_level="WARNING", ephemeral=True)
            system.start_servers()
            database_url = config.database_url
            args.api_key = asyncio.run(make_key(database_url))
            system.start_worker()
            system.start_gateway()
            args.base_url = system.url()
            t0 = time.monotonic()
            system.wait_until_ready(MODEL, timeout_s=300)
            print(f"system up in {time.monotonic() - t0:.1f} s at {args.base_url} (work dir {work})", flush=True)
        elif not (args.api_key and args.admin_key):
            p.error("--base-url needs --api-key and --admin-key")
        out = asyncio.run(run_load(args))
        if database_url:
            time.sleep(2)  # the usage writer is asynchronous
            out["usage"], out["server_times"] = asyncio.run(usage_rows(database_url, out["overload_since"]))
        if system and any(s["other err"] or s["lost"] for s in out["rows"]):
            for svc in system.services:
                print(f"--- {svc.name} log tail ---\n{svc.log_tail(30)}")
    finally:
        if system:
            system.stop()
        if work:
            shutil.rmtree(work, ignore_errors=True)
    report(args, out, command)
    return 0


def report(args, out: dict, command: str) -> None:
    idle, pro, free = out["rows"]
    ratio = pro["TTFT p95"] / idle["TTFT p95"] if pro["TTFT p95"] and idle["TTFT p95"] else None
    checks = [f"pro TTFT p95 under flood / idle = {ratio:.2f}x (target <= 2x): "
              f"{'MET' if ratio and ratio <= 2 else 'NOT MET'}" if ratio else "pro TTFT ratio: n/a",
              f"other errors (5xx other than queue_timeout, other codes) = {sum(s['other err'] for s in out['rows'])}"
              f" (target 0)", f"lost = {sum(s['lost'] for s in out['rows'])} (target 0)"]
    whys = {f"{s['phase']}/{s['tier']}": s["why"] for s in out["rows"] if s["why"]}
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    free_rate, pro_rate = out["rates"]
    lines = [
        f"## Overload: pro under a free-tier flood ({datetime.date.today().isoformat()})", "",
        f"`{command}`", "",
        f"Machine: {os.cpu_count()} CPU cores ({cpu}), no GPU; load average {out['load_start'][0]:.2f} at the start, "
        f"{out['load_end'][0]:.2f} at the end (shared with other work). One worker (SmolLM2-135M, "
        f"max_num_seqs={args.max_num_seqs}), one gateway, embedded NATS + Postgres unless a base URL was given.",
        f"Requests: streaming chat, short prompts, max_tokens={args.max_tokens}, ignore_eos, Poisson arrivals "
        f"(seed {args.seed}). Capacity {out['capacity']:.2f} req/s "
        f"({'given' if args.capacity else 'measured: burst of ' + str(2 * args.max_num_seqs)}). Idle: pro at "
        f"{args.idle_rate} req/s. Overload ({args.duration:.0f} s): free {free_rate:.2f} req/s "
        f"({args.free_x:g}x capacity) "
        f"+ pro {pro_rate:.2f} req/s ({args.pro_frac:g}x); output {out['overload_tok_s']:.0f} tok/s over "
        f"{out['overload_wall']:.0f} s including drain.",
        f"Tier policies during overload: {json.dumps(out['policies'])}; "
        f"peak queued seen: {json.dumps(out['peak_queued'])}.",
        "", table(out["rows"]), "",
        *(f"- {c}" for c in checks),
    ]
    if whys:
        lines.append(f"- other/lost outcomes: {json.dumps(whys)}")
    if "usage" in out:
        lines.append(f"- Postgres `requests` rows (tier, finish_reason, count), all phases: {out['usage']}")
        lines.append("- worker-side times in the overload phase, from `requests` (tier, n, queue_ms p50/p95, "
                     f"first_token_ms p50/p95; from the gateway's accept): {out['server_times']}")
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    append_section(text, args.results)


if __name__ == "__main__":
    sys.exit(main())
