"""The system tax: the whole system (gateway, NATS, SSE, an ``openai`` client) against the in-process engine, on
the same requests at the same concurrency, as ``vllm bench serve`` measures a server.

    .venv/bin/python bench/serve.py                          # concurrency 1, 8, 32; ~10 min on 2 CPU cores
    .venv/bin/python bench/serve.py --concurrency 32 --requests 64
    .venv/bin/python bench/serve.py --threads 1              # torch threads, on both sides

Workload: bench/engine.py's (SmolLM2-135M, random-text prompts of uniform 16-512 tokens, outputs of uniform 16-256,
greedy, ``ignore_eos``, fixed seed), sent as legacy completions so both sides tokenize the same text the same way.
Closed loop: ``--concurrency C`` requests in flight at once, each new one sent as one ends. Both sides use the
worker's settings (``--dtype auto`` as the worker resolves it, ``max_num_seqs``, torch threads).

- engine: a fresh process drives ``Engine.step()`` directly: what the model can do with nothing around it.
- system: ``LocalSystem`` (embedded NATS and Postgres, one gateway, one worker) and the official ``openai`` client,
  streaming with ``stream_options.include_usage``; output tokens are the usage's ``completion_tokens``.

Metrics: output tok/s = output tokens / wall; TTFT = send to first chunk with text; TPOT = (latency - TTFT) /
(output tokens - 1); ITL = the gaps between chunks with text. Tax = system tok/s over engine tok/s (target >= 90%).
The worker's idle gap = seconds between back-to-back engine steps over seconds in steps (its heartbeat's counters):
what publishing and admission cost the device. Printed, and appended to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.engine import machine, pct, workload  # noqa: E402
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402

MODEL = "smollm2"
DEFAULT_REQUESTS = {1: 8, 8: 32, 32: 64}  # per concurrency: enough to pass the ramp up and down a few times


# -- the in-process engine ------------------------------------------------------------------------------
def engine_side(model_dir: str, args, plan: list[tuple[int, int]]) -> list[dict]:
    """In a fresh process: for each (concurrency, number of requests), drive the engine closed loop."""
    import torch

    from switchyard.shared.messages import GenerateRequest, SamplingParams
    from switchyard.workers import model_store
    from switchyard.workers.engine.engine import Engine, EngineConfig

    torch.set_num_threads(args.threads)
    model, tok = model_store.load(Path(model_dir), args.dtype, "cpu")
    reqs = workload(tok, args)
    engine = Engine(model, tok, EngineConfig(max_num_seqs=args.max_num_seqs))
    engine.runner.warmup()
    out = []
    for concurrency, num in [(2, 2)] + plan:  # the first: a warm-up, dropped
        todo = list(range(num))
        recs, t0 = {}, time.perf_counter()
        while todo or engine.has_unfinished_requests():
            while todo and sum(r["end"] is None for r in recs.values()) < concurrency:
                i = todo.pop(0)
                now = time.time()
                rid = f"c{concurrency}-{i}"
                recs[rid] = dict(sent=time.perf_counter(), chunks=[], out=0, end=None)
                engine.add_request(GenerateRequest(
                    rid, MODEL, "pro", SamplingParams(max_tokens=reqs[i]["max_tokens"], temperature=0,
                                                      ignore_eos=True),
                    created_at=now, deadline_at=now + 3600, prompt=reqs[i]["prompt"]))
            deltas = engine.step()
            t = time.perf_counter()
            for d in deltas:
                r = recs[d.request_id]
                if d.text:
                    r["chunks"].append(t)
                if d.finish_reason:
                    r["end"], r["out"] = t, d.usage.completion_tokens
        out.append(summarize("engine", concurrency, list(recs.values()), time.perf_counter() - t0))
    return out[1:]


# -- the whole system ---------------------------------------------------------------------------------------
async def one(client, req: dict, recs: list, model: str = MODEL) -> None:
    rec = dict(sent=time.perf_counter(), chunks=[], out=0, end=None, error=None)
    recs.append(rec)
    try:
        stream = await client.completions.create(
            model=model, prompt=req["prompt"], max_tokens=req["max_tokens"], temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                rec["chunks"].append(time.perf_counter())
            if chunk.usage is not None:
                rec["out"] = chunk.usage.completion_tokens
        rec["end"] = time.perf_counter()
    except Exception as exc:  # counted and shown, never silently dropped
        rec["error"] = repr(exc)


def process_cpu(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named process and its descendants (Postgres runs a process per connection), a
    descendant that is named itself counted under its own name only."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)  # ppid, cpu
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)

    def tree(pid: int) -> float:
        return stats.get(pid, (0, 0.0))[1] + sum(tree(c) for c in children.get(pid, []) if c not in named)

    named = set(pids.values())

    return {name: tree(pid) for name, pid in pids.items()}


async def system_load(base_url: str, api_key: str, reqs: list[dict], plan: list[tuple[int, int]],
                      nats_url: str, heartbeat_s: float, pids: dict[str, int]) -> list[dict]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=900)
    out = []
    for concurrency, num in [(2, 2)] + plan:
        before = await worker_counters(nats_url, heartbeat_s)
        recs: list = []
        todo = list(range(num))

        async def loop():
            while todo:
                await one(client, reqs[todo.pop(0)], recs)

        cpu0, t0 = process_cpu(pids), time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        cpu = {name: (t - cpu0[name]) / wall for name, t in process_cpu(pids).items()}
        after = await worker_counters(nats_url, heartbeat_s)
        steps, busy, gap = (a - b for a, b in zip(after, before))
        out.append(summarize("system", concurrency, recs, wall, steps=steps, busy_s=busy, gap_s=gap, cpu=cpu))
    await client.close()
    return out[1:]


async def worker_counters(nats_url: str, heartbeat_s: float) -> tuple[int, float, float]:
    """The worker's (steps, seconds in steps, seconds between back-to-back steps) after a fresh heartbeat."""
    import nats

    from switchyard.shared.jetstream import live_workers

    await asyncio.sleep(heartbeat_s * 1.5)  # nothing runs between levels: the next beat has the final counts
    nc = await nats.connect(nats_url)
    try:
        infos = await live_workers(nc.jetstream())
    finally:
        await nc.close()
    (info,) = infos  # one worker
    return info.num_steps, info.step_s, info.gap_s


# -- numbers ------------------------------------------------------------------------------------------------
def summarize(side: str, concurrency: int, recs: list[dict], wall: float, **extra) -> dict:
    ok = [r for r in recs if r["end"] is not None and r["chunks"]]
    out_tokens = sum(r["out"] for r in ok)
    ttft = [r["chunks"][0] - r["sent"] for r in ok]
    tpot = [(r["end"] - r["chunks"][0]) / (r["out"] - 1) for r in ok if r["out"] > 1]
    itl = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    errors = sorted({r.get("error") or "incomplete" for r in recs if r not in ok})
    return dict(side=side, concurrency=concurrency, reqs=len(ok), failed=len(recs) - len(ok), errors=errors,
                out_tokens=out_tokens, wall=wall, tok_s=out_tokens / wall,
                ttft=(pct(ttft, 50), pct(ttft, 99)), tpot=(pct(tpot, 50), pct(tpot, 99)),
                itl=(pct(itl, 50), pct(itl, 99)), **extra)


def report(engine_rows: list[dict], system_rows: list[dict], args, command: str, lscpu: str) -> str:
    ms = lambda x: "-" if x is None else f"{x * 1e3:.0f}"  # noqa: E731
    rows = []
    for e, s in zip(engine_rows, system_rows):
        for r in (e, s):
            tax = f"{s['tok_s'] / e['tok_s']:.0%}" if r is s else ""
            gap = f"{r['gap_s'] / r['busy_s']:.1%}" if r.get("busy_s") else ""
            rows.append([r["concurrency"], r["side"], r["reqs"], r["failed"], r["out_tokens"], f"{r['wall']:.1f}",
                         f"{r['tok_s']:.1f}", *(ms(x) for k in ("ttft", "tpot", "itl") for x in r[k]), tax, gap])
    table = markdown_table(["conc", "side", "reqs", "failed", "out tok", "wall s", "out tok/s", "TTFT p50", "TTFT p99",
                            "TPOT p50", "TPOT p99", "ITL p50", "ITL p99", "system / engine", "worker idle gap"],
                           rows)
    cpu = markdown_table(["conc", *system_rows[0]["cpu"]],
                         [[r["concurrency"], *(f"{v:.0%}" for v in r["cpu"].values())] for r in system_rows])
    errors = sorted({x for r in system_rows + engine_rows for x in r["errors"]})
    lines = [
        f"## serve: system vs in-process engine ({datetime.date.today()})",
        "", f"Command: `{command}`", "",
        f"Machine: {machine()}; torch threads {args.threads}, dtype {args.dtype} (the worker's rule), max_num_seqs "
        f"{args.max_num_seqs}. `lscpu`: {lscpu}", "",
        table, "",
        "Times in ms. Closed loop at each concurrency; the system side is gateway + NATS + SSE + the `openai` "
        "client, all on the same cores as the worker. Worker idle gap: time between back-to-back engine steps "
        "over time in steps (from the worker's heartbeat counters).",
        "", "Where the system side's CPU went (CPU seconds over wall seconds; 100% = one core):", "", cpu,
    ]
    if errors:
        lines += ["", "Failures: " + "; ".join(errors)]
    return "\n".join(lines)


def lscpu_summary() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unavailable"
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    name, num_cpus = fields.get("Model name", "?").strip(), fields.get("CPU(s)", "?").strip()
    return f"{name}, {num_cpus} CPUs, flags {' '.join(wanted)}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, help="requests per concurrency (default: 8 at 1, 32 at 8, 64 at 32)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=64, help="size of the workload the requests are drawn from")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 512))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 256))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", type=Path, default=RESULTS, help="'-' to skip")
    args = p.parse_args()
    command = command_line()
    lscpu = lscpu_summary()
    print(f"lscpu: {lscpu}", flush=True)
    plan = [(c, args.requests or DEFAULT_REQUESTS.get(c, 2 * c)) for c in args.concurrency]
    args.num_requests = max(args.num_requests, *(n for _, n in plan))

    from switchyard.deploy.system import LocalSystem
    from switchyard.shared.config import GatewayConfig, SwitchyardConfig, WorkerConfig
    from switchyard.workers import model_store
    from tests.support import system as support

    model_dir = model_store.pull(MODEL, SwitchyardConfig().model_cache_dir)
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # its own process: nothing else warm or loaded
        engine_rows = pool.apply(engine_side, (str(model_dir), args, plan))
    for r in engine_rows:
        print(f"engine c={r['concurrency']}: {r['tok_s']:.1f} tok/s", flush=True)

    work = Path(tempfile.mkdtemp(prefix="switchyard-serve-"))
    os.chmod(work, 0o755)  # Postgres runs as nobody under root and must enter it
    heartbeat_s = 0.5
    config = SwitchyardConfig(
        data_dir=work, gateway=GatewayConfig(port=support.free_port()),
        worker=WorkerConfig(model=str(model_dir), served_model_name=MODEL, max_num_seqs=args.max_num_seqs,
                            dtype=args.dtype, torch_threads=args.threads, heartbeat_s=heartbeat_s))
    system = LocalSystem(config, log_dir=work, log_level="WARNING", ephemeral=True)
    try:
        system.start_servers()
        api_key = asyncio.run(support.make_key(config.database_url, "bench-serve", rpm_limit=2**31 - 1,
                                               tpm_limit=2**31 - 1))
        system.start_worker()
        system.start_gateway()
        system.wait_until_ready(MODEL, timeout_s=300)
        from transformers import AutoTokenizer

        reqs = workload(AutoTokenizer.from_pretrained(model_dir), args)
        pids = system.pids()
        pids["bench client"] = os.getpid()
        system_rows = asyncio.run(system_load(system.url(), api_key, reqs, plan, config.nats_url, heartbeat_s, pids))
    finally:
        system.stop()
        shutil.rmtree(work, ignore_errors=True)
    for r in system_rows:
        print(f"system c={r['concurrency']}: {r['tok_s']:.1f} tok/s", flush=True)
    text = report(engine_rows, system_rows, args, command, lscpu)
    print(text)
    append_section(text, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
