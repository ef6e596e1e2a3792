"""Our engine's decode speed when other processes share its cores (issue 40, part 4): SmolLM2 driven directly,
quiet and beside busy processes, for several ways of running the step's OpenMP threads.

    .venv/bin/python bench/contention.py
    .venv/bin/python bench/contention.py --hogs 0 1 2 --streams 8 --max-tokens 64 --repeats 3

Each configuration runs in a fresh process (libgomp reads its environment once, when torch loads it):

    worker          the worker's default: torch's threads (one per core), GOMP_SPINCOUNT 10,000 (worker.omp_spin_count)
    libgomp         the same threads, libgomp's own spin (300,000 rounds: what the worker did before it bounded it)
    passive         OMP_WAIT_POLICY=passive: an idle thread sleeps at once
    one-thread      a single thread (nothing to wait for), the worker's spin
    tuned           the worker's, with --tune-threads: each step's count chosen by measurement while serving

A hog is a process spinning in a loop at the engine's own priority, started before the run and stopped after it.
Reported per configuration and number of hogs: tokens/s of all streams together (median of ``--repeats``), that
against the same configuration's quiet figure and against the best quiet figure, and the engine process's CPU
seconds per thousand tokens (threads spinning at a barrier for a sibling the kernel has set aside burn CPU that
the sibling then lacks: the cost shows here before it shows in the speed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.local import cpu_name, lscpu  # noqa: E402
from bench.results import append_section, command_line, markdown_table  # noqa: E402

WORKER_SPIN = "10000"  # worker.omp_spin_count's default (shared/config.py)
# name -> (torch threads, None: torch's; the environment; --tune-threads)
CONFIGS: dict[str, tuple[int | None, dict[str, str], bool]] = {
    "worker": (None, {"GOMP_SPINCOUNT": WORKER_SPIN}, False),
    "libgomp": (None, {}, False),
    "passive": (None, {"OMP_WAIT_POLICY": "passive"}, False),
    "one-thread": (1, {"GOMP_SPINCOUNT": WORKER_SPIN}, False),
    "tuned": (None, {"GOMP_SPINCOUNT": WORKER_SPIN}, True),
}
OPENMP_ENV = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")


def child(args) -> None:
    """One configuration's runs (in a process of its own): prints its speeds and CPU as JSON."""
    import torch

    from switchyard.workers.engine.engine import Engine, EngineConfig
    from switchyard.workers.model_store import load, pull
    from tests.support.engine_runs import run_prompts
    from tests.support.system import model_cache_dir
    from tests.support.texts import CHAT_PROMPTS

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load(pull("smollm2", model_cache_dir()), dtype=args.dtype, device="cpu")
    prompts = (CHAT_PROMPTS * (1 + args.streams // len(CHAT_PROMPTS)))[:args.streams]
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=args.streams, quantization=args.quantization,
                                                   tune_threads=args.tune_threads))
    engine.warmup()
    warm_until = time.monotonic() + args.warm_seconds  # as a worker serving for a while: the tuner has chosen
    while time.monotonic() < warm_until:
        run_prompts(engine, prompts, args.max_tokens, first_id=100_000)
    speeds, cpu_per_k = [], []
    for i in range(args.repeats):
        cpu = resource.getrusage(resource.RUSAGE_SELF)
        run = run_prompts(engine, prompts, args.max_tokens, first_id=(i + 1) * 1000)
        after = resource.getrusage(resource.RUSAGE_SELF)
        speeds.append(run.num_tokens / run.seconds)
        cpu_per_k.append((after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime) / run.num_tokens * 1000)
    print(json.dumps({"tok_s": statistics.median(speeds), "cpu_s_per_k": statistics.median(cpu_per_k),
                      "threads": torch.get_num_threads()}))


def measure(args, name: str, hogs: int) -> dict:
    threads, env, tune = CONFIGS[name]
    environment = {k: v for k, v in os.environ.items() if k not in OPENMP_ENV} | env
    command = [sys.executable, __file__, "--child", "--dtype", args.dtype, "--streams", str(args.streams),
               "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats), "--threads", str(threads or 0),
               "--warm-seconds", str(args.warm_seconds)]
    if args.quantization:
        command += ["--quantization", args.quantization]
    if tune:
        command.append("--tune-threads")
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    try:
        time.sleep(0.5 if hogs else 0)  # the hogs running before the engine loads
        done = subprocess.run(command, env=environment, cwd=ROOT, capture_output=True, text=True, check=False)
    finally:
        for hog in spinning:
            hog.kill()
            hog.wait()
    if done.returncode != 0:
        raise SystemExit(f"{name} with {hogs} hogs failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--hogs", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quantization", default=None, choices=["int8"])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warm-seconds", type=float, default=20.0,
                   help="decode this long before measuring (each configuration; the tuner first tries at 5 s)")
    p.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tune-threads", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--results", default=None, help="markdown file to append to; '-' for none")
    args = p.parse_args()
    if args.child:
        return child(args)
    report = lscpu()
    measured = {(name, hogs): measure(args, name, hogs) for name in args.configs for hogs in args.hogs}
    best_quiet = max((m["tok_s"] for (_, hogs), m in measured.items() if hogs == 0), default=None)
    rows = []
    for (name, hogs), m in measured.items():
        quiet = measured.get((name, 0))
        rows.append([name, m["threads"], hogs, f"{m['tok_s']:.1f}",
                     f"{m['tok_s'] / quiet['tok_s']:.2f}x" if quiet else "-",
                     f"{m['tok_s'] / best_quiet:.2f}x" if best_quiet else "-", f"{m['cpu_s_per_k']:.1f}"])
    table = markdown_table(["config", "threads", "hogs", "tok/s", "vs its quiet", "vs best quiet",
                            "engine CPU s / 1k tokens"], rows)
    weights = args.dtype + (f", {args.quantization} weights" if args.quantization else "")
    section = "\n".join([
        f"## Decode beside busy processes, SmolLM2 {weights}, {cpu_name(report)}", "", f"`{command_line()}`", "",
        report, "",
        f"{args.streams} streams of {args.max_tokens} tokens, the engine driven directly (median of {args.repeats});"
        " a hog is a process spinning at the engine's priority.", "", table])
    print(section)
    append_section(section, args.results or Path(__file__).with_name("RESULTS.md"))


if __name__ == "__main__":
    main()
