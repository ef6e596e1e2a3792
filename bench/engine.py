"""Benchmark the continuous-batching engine (workers/engine/) against HF transformers ``generate``.

    .venv/bin/python bench/engine.py --quick                      # smoke run, a few minutes
    .venv/bin/python bench/engine.py                              # full run, bf16 (20-40 min on 2 cores)
    .venv/bin/python bench/engine.py --dtype bfloat16 float32     # both dtypes, one table each
    .venv/bin/python bench/engine.py --scenarios engine_t0 single # a subset
    .venv/bin/python bench/engine.py --threads 1                  # when other processes load the machine

On a CPU without avx512_bf16/AMX torch emulates bf16: decode at batch 1 gets a little faster (half the bytes), but
prefill and batched decode get several times slower; use ``--dtype float32`` there. With other processes busy on
the cores, ``--threads 2`` on 2 cores collapses (OpenMP threads wait for a descheduled sibling): use 1.

Workload (fixed seed): SmolLM2-135M, 64 requests, prompts of uniform 16-512 random-text tokens, outputs of uniform
16-256 tokens, greedy, ``ignore_eos``. Scenarios: ``engine_t0`` (all at t=0, max_num_seqs=32), ``engine_poisson``
(Poisson arrivals; ``--rate 0`` = 60% of engine_t0's request rate), ``hf_static`` (``generate`` on static batches
of 32, left padded, each batch runs to its longest member; only each request's own tokens count), ``hf_seq``
(``generate`` batch 1 on the first 8 requests), ``single`` (one stream, prompt 32 / output 128, engine vs HF) and
``prefix`` (32 requests sharing a 400-token system prompt, prefix caching on vs off).

Metrics as in ``vllm bench serve``: output tok/s = useful output tokens / wall time; TTFT = arrival to first
token-bearing delta; TPOT = (latency - TTFT) / (output tokens - 1). Each scenario runs in a fresh process, so peak
RSS (ru_maxrss) is that scenario's own (model + KV cache + activations). Results are printed and a markdown section
is appended to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import random
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402

SCENARIOS = ("engine_t0", "engine_poisson", "hf_static", "hf_seq", "single", "prefix")
COLUMNS = ("scenario", "reqs", "out tok", "wall s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
           "peak RSS MiB", "peak KV blocks", "CPU %", "load 1m")


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def summarize(name, recs, wall, cpu0, peak_blocks=None, **extra):
    """recs: dicts with arrival, first, end (perf_counter seconds) and out (useful output tokens); cpu0: process
    CPU time at the start, for the share of a core the run got (other processes compete on a shared machine)."""
    ttft = [r["first"] - r["arrival"] for r in recs]
    tpot = [(r["end"] - r["first"]) / (r["out"] - 1) for r in recs if r["out"] > 1]
    out = sum(r["out"] for r in recs)
    return dict(scenario=name, reqs=len(recs), out_tokens=out, wall=wall, tok_s=out / wall,
                ttft_p50=pct(ttft, 50), ttft_p99=pct(ttft, 99), tpot_p50=pct(tpot, 50), tpot_p99=pct(tpot, 99),
                rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, peak_blocks=peak_blocks,
                cpu=(time.process_time() - cpu0) / wall, load1=os.getloadavg()[0], **extra)


# -- workload ---------------------------------------------------------------------------------------------
def random_text(tok, rng, n):
    """Text of about n tokens: random ids from the ordinary vocabulary, decoded, re-encoded, cut, decoded."""
    ids = [rng.randrange(1000, 40000) for _ in range(n)]
    return tok.decode(tok.encode(tok.decode(ids))[:n])


def request(tok, text, max_tokens):
    return dict(prompt=text, ids=tok.encode(text), max_tokens=max_tokens)  # ids: what the engine's tokenizer sees


def workload(tok, args):
    rng = random.Random(args.seed)
    lens = [(rng.randint(*args.prompt_len), rng.randint(*args.output_len)) for _ in range(args.num_requests)]
    return [request(tok, random_text(tok, rng, p), o) for p, o in lens]


def prefix_workload(tok, args):
    """Requests sharing a system prompt of ``--prefix-len`` tokens, each with its own ~20-token suffix."""
    rng = random.Random(args.seed + 1)
    system = random_text(tok, rng, args.prefix_len)
    return [request(tok, system + random_text(tok, rng, 20), args.prefix_output) for _ in range(args.prefix_requests)]


# -- engine ---------------------------------------------------------------------------------------------
def _timed(timers, key, fn):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            timers[key] += time.perf_counter() - t
    wrapper.__wrapped__ = fn
    return wrapper


def run_engine(name, model, tok, reqs, arrivals, args, prefix_caching=True, warm=()):
    """Serve ``reqs`` arriving at ``arrivals`` (seconds from start); ``warm`` requests run first, untimed."""
    import gc

    import switchyard.workers.engine.engine as we
    import switchyard.workers.engine.next_tokens as nt

    gc.collect()  # drop the previous run's engine (and its KV cache) first
    engine = we.Engine(model, tok, we.EngineConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, kv_cache_bytes=int(args.kv_gib * 2**30),
        enable_prefix_caching=prefix_caching, max_model_len=args.max_model_len, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype))
    engine.runner.warmup()
    # Where step time goes: wrap the parts on this instance (and next_tokens' `draw`, in this process).
    timers = defaultdict(float)
    engine.runner.begin = _timed(timers, "execute", engine.runner.begin)  # the model: both halves of a step
    engine.runner.advance = _timed(timers, "execute", engine.runner.advance)
    engine.scheduler.schedule = _timed(timers, "schedule", engine.scheduler.schedule)
    engine.scheduler.update_from_output = _timed(timers, "update", engine.scheduler.update_from_output)
    engine._deltas.on_tokens = _timed(timers, "on_tokens(detok)", engine._deltas.on_tokens)
    nt.draw = _timed(timers, "sample", getattr(nt.draw, "__wrapped__", nt.draw))
    kv = engine.scheduler.kv_cache
    if warm:
        _drive(engine, warm, [0.0] * len(warm), "w")
        timers.clear()
    hit0, query0 = kv.num_prefix_hit_tokens, kv.num_prefix_query_tokens
    cpu0 = time.process_time()
    recs, wall, peak_blocks, num_steps, step_time = _drive(engine, reqs, arrivals, "r")
    prompt_tokens = sum(len(r["ids"]) for r in reqs)
    cached = sum(r["cached"] for r in recs)
    split = {k: v / step_time for k, v in timers.items()}
    split["other"] = 1 - sum(split.values())
    return summarize(name, recs, wall, cpu0, peak_blocks, prompt_tokens=prompt_tokens,
                     prefill_computed=prompt_tokens - cached, kv_hit=kv.num_prefix_hit_tokens - hit0,
                     kv_query=kv.num_prefix_query_tokens - query0, steps=num_steps, split=split)


def _drive(engine, reqs, arrivals, tag):
    from switchyard.shared.messages import GenerateRequest, SamplingParams

    order = sorted(range(len(reqs)), key=lambda i: arrivals[i])
    recs, peak_blocks, nxt, num_steps, step_time = {}, 0, 0, 0, 0.0
    t0 = time.perf_counter()
    while True:
        now = time.perf_counter()
        while nxt < len(order) and t0 + arrivals[order[nxt]] <= now:
            i = order[nxt]
            nxt += 1
            rid = f"{tag}{i}"
            recs[rid] = dict(arrival=t0 + arrivals[i], first=None, end=None, out=0, cached=0)
            wall_now = time.time()
            engine.add_request(GenerateRequest(
                rid, "smollm2", "pro", SamplingParams(max_tokens=reqs[i]["max_tokens"], temperature=0, ignore_eos=True),
                created_at=wall_now, deadline_at=wall_now + 3600, prompt=reqs[i]["prompt"]))
        if not engine.has_unfinished_requests():
            if nxt == len(order):
                break
            time.sleep(max(0.0, t0 + arrivals[order[nxt]] - time.perf_counter()))
            continue
        ts = time.perf_counter()
        deltas = engine.step()
        t = time.perf_counter()
        step_time += t - ts
        num_steps += 1
        peak_blocks = max(peak_blocks, engine.num_blocks - engine.num_free_blocks)
        for d in deltas:
            r = recs[d.request_id]
            if d.num_tokens and r["first"] is None:
                r["first"] = t
            r["out"] += d.num_tokens
            if d.finish_reason:
                r["end"], r["cached"] = t, d.usage.cached_tokens
    return list(recs.values()), time.perf_counter() - t0, peak_blocks, num_steps, step_time


# -- HF transformers ------------------------------------------------------------------------------------
class _StepClock:
    """A generate() streamer that only timestamps each generated step (the first put() is the prompt)."""

    def __init__(self):
        self.times, self._prompt_seen = [], False

    def put(self, value):
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self):
        pass


def run_hf(name, model, tok, reqs, batch_size):
    import torch

    recs, t0, cpu0 = [], time.perf_counter(), time.process_time()
    for b in range(0, len(reqs), batch_size):
        batch = reqs[b : b + batch_size]
        enc = tok.pad({"input_ids": [r["ids"] for r in batch]}, padding_side="left", return_tensors="pt")
        m = max(r["max_tokens"] for r in batch)  # the batch runs until its longest member is done
        clock = _StepClock()
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=m, min_new_tokens=m, do_sample=False, pad_token_id=tok.pad_token_id,
                           streamer=clock)
        # Generous to HF: a request's tokens count as delivered at the step that made them (as if streamed).
        recs += [dict(arrival=t0, first=clock.times[0], end=clock.times[r["max_tokens"] - 1], out=r["max_tokens"])
                 for r in batch]
    return summarize(name, recs, time.perf_counter() - t0, cpu0)


def hf_warmup(model, tok):
    run_hf("warmup", model, tok, [dict(ids=tok.encode("Hello there, how are"), max_tokens=4)] * 2, 2)


# -- one scenario, in its own process -------------------------------------------------------------------
def run_scenario(name, args, dtype, rate):
    import torch

    from switchyard.shared.config import SwitchyardConfig
    from switchyard.workers import model_store

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_dir = model_store.pull("smollm2", args.cache_dir or SwitchyardConfig().model_cache_dir)
    t0 = time.perf_counter()
    model, tok = model_store.load(model_dir, dtype=dtype, device="cpu")
    load_s = time.perf_counter() - t0
    return [{**r, "load_s": load_s} for r in run_loaded(name, model, tok, args, rate)]


def run_loaded(name, model, tok, args, rate):
    reqs = workload(tok, args)
    if name == "engine_t0":
        return [run_engine(name, model, tok, reqs, [0.0] * len(reqs), args)]
    if name == "engine_poisson":
        rng = random.Random(args.seed + 2)
        arrivals, t = [], 0.0
        for _ in reqs:
            arrivals.append(t)
            t += rng.expovariate(rate)
        return [run_engine(f"engine_poisson@{rate:.2f}/s", model, tok, reqs, arrivals, args)]
    if name in ("hf_static", "hf_seq"):
        hf_warmup(model, tok)
        if name == "hf_static":
            return [run_hf(name, model, tok, reqs, args.max_num_seqs)]
        return [run_hf(f"hf_seq(first {args.seq_requests})", model, tok, reqs[: args.seq_requests], 1)]
    if name == "single":
        rng = random.Random(args.seed + 3)
        text = random_text(tok, rng, 32)
        one = [request(tok, text, args.single_output)]
        hf_warmup(model, tok)
        out = []
        for label, fn in (("single_engine", lambda: run_engine("single_engine", model, tok, one, [0.0], args)),
                          ("single_hf", lambda: run_hf("single_hf", model, tok, one, 1))):
            runs = [fn() for _ in range(args.repeats)]
            median = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
            median["scenario"] = f"{label} (median of {len(runs)})"
            median["decode_tok_s"] = 1 / median["tpot_p50"]
            out.append(median)
        return out
    if name == "prefix":
        preqs = prefix_workload(tok, args)
        t0 = [0.0] * len(preqs)
        # All at t=0, the ones admitted in the first request's step cannot hit its blocks yet; "_warm": one earlier
        # request with the same system prompt ran first (a server's steady state).
        return [run_engine("prefix_cache_on", model, tok, preqs, t0, args, True),
                run_engine("prefix_cache_on_warm", model, tok, preqs[1:], t0[1:], args, True, warm=preqs[:1]),
                run_engine("prefix_cache_off", model, tok, preqs, t0, args, False)]
    raise ValueError(name)


# -- report ---------------------------------------------------------------------------------------------
def machine():
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    flags = Path("/proc/cpuinfo").read_text()
    bf16 = "yes" if "avx512_bf16" in flags or "amx_bf16" in flags else "no"
    return f"nproc {os.cpu_count()}, {cpu}, native bf16 (avx512_bf16/amx): {bf16}"


def load_avg():
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def row(r):
    f = lambda x, scale=1, p=1: "-" if x is None or x != x else f"{x * scale:.{p}f}"  # noqa: E731
    return (r["scenario"], str(r["reqs"]), str(r["out_tokens"]), f(r["wall"]), f(r["tok_s"]), f(r["ttft_p50"], 1e3, 0),
            f(r["ttft_p99"], 1e3, 0), f(r["tpot_p50"], 1e3), f(r["tpot_p99"], 1e3), f(r["rss_mib"], 1, 0),
            "-" if r["peak_blocks"] is None else str(r["peak_blocks"]), f(r["cpu"], 100, 0), f(r["load1"]))


def report(results):
    by = {r["scenario"].split("@")[0].split(" ")[0]: r for r in results}
    lines = [markdown_table(COLUMNS, [row(r) for r in results])]
    lines.append("\nTTFT/TPOT in ms. CPU %: CPU time of the bench process over wall time (100 = one core; below "
                 "100 x threads, other processes took the rest). Engine step-time split (share of engine.step()):")
    for r in results:
        if r.get("split"):
            parts = ", ".join(f"{k} {v:.0%}" for k, v in sorted(r["split"].items(), key=lambda kv: -kv[1]))
            lines.append(f"- {r['scenario']}: {r['steps']} steps; {parts}")
    loads = ", ".join(f"{r['scenario']} {r['load_s']:.1f} s" for r in results if "load_s" in r)
    lines.append(f"\nModel load (the converted directory to a model, in each scenario's process): {loads}.")
    checks = []
    if "engine_t0" in by and "hf_static" in by:
        e, h = by["engine_t0"], by["hf_static"]
        ok = e["tok_s"] >= 3 * h["tok_s"] and e["ttft_p99"] < h["ttft_p99"]
        checks.append(f"- continuous vs static batching: {e['tok_s'] / h['tok_s']:.2f}x output tok/s (target >= 3x; "
                      f"{e['tok_s'] / e['cpu'] / (h['tok_s'] / h['cpu']):.2f}x per CPU-second), "
                      f"TTFT p99 {e['ttft_p99'] * 1e3:.0f} vs {h['ttft_p99'] * 1e3:.0f} ms -> "
                      f"{'MET' if ok else 'NOT MET'}")
    if "single_engine" in by and "single_hf" in by:
        e, h = by["single_engine"], by["single_hf"]
        ratio = e["decode_tok_s"] / h["decode_tok_s"]
        checks.append(f"- single stream decode: engine {e['decode_tok_s']:.1f} vs HF {h['decode_tok_s']:.1f} tok/s "
                      f"({ratio:.2f}x; end to end {e['tok_s']:.1f} vs {h['tok_s']:.1f}) -> "
                      f"{'MET' if ratio >= 0.8 else 'NOT MET'} (target: within 20%)")
    if "prefix_cache_on" in by and "prefix_cache_off" in by:
        on, off = by["prefix_cache_on"], by["prefix_cache_off"]
        red = 1 - on["prefill_computed"] / off["prefill_computed"]
        checks.append(f"- prefix caching: prefill tokens computed {on['prefill_computed']} vs "
                      f"{off['prefill_computed']} of {off['prompt_tokens']} ({red:.1%} fewer; kv counters hit "
                      f"{on['kv_hit']}/{on['kv_query']}), "
                      f"TTFT p50 {on['ttft_p50'] * 1e3:.0f} vs {off['ttft_p50'] * 1e3:.0f} ms -> "
                      f"{'MET' if red >= 0.9 else 'NOT MET'} (target >= 90% fewer)")
        if "prefix_cache_on_warm" in by:
            w = by["prefix_cache_on_warm"]
            red = 1 - w["prefill_computed"] / w["prompt_tokens"]
            checks.append(f"  - after one earlier request with the same system prompt: {w['prefill_computed']} of "
                          f"{w['prompt_tokens']} prompt tokens computed ({red:.1%} fewer), TTFT p50 "
                          f"{w['ttft_p50'] * 1e3:.0f} ms")
    if checks:
        lines += ["\nTargets:"] + checks
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--quick", action="store_true", help="8 requests, short prompts/outputs: a smoke run")
    p.add_argument("--threads", type=int, default=2, help="torch threads (1 on a busy 2-core machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 512])
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 256])
    p.add_argument("--rate", type=float, default=0.0, help="Poisson req/s; 0: 60%% of engine_t0's req/s (else 1)")
    p.add_argument("--seq-requests", type=int, default=8, help="hf_seq runs only this many requests")
    p.add_argument("--single-output", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="single-stream runs per system (median reported)")
    p.add_argument("--prefix-len", type=int, default=400)
    p.add_argument("--prefix-requests", type=int, default=32)
    p.add_argument("--prefix-output", type=int, default=32)
    p.add_argument("--quantization", choices=["int8", "w8a8", "int4"], help="our engine's weights (float32 only)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"], help="our engine's KV cache")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-gib", type=float, default=1.0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--cache-dir", default=None, help="model cache (default: SwitchyardConfig().model_cache_dir)")
    p.add_argument("--results", default=str(RESULTS))
    args = p.parse_args()
    if args.quick:
        args.num_requests, args.prompt_len, args.output_len = 8, [16, 64], [8, 32]
        args.seq_requests, args.single_output, args.repeats = 2, 32, 1
        args.prefix_len, args.prefix_requests, args.prefix_output = 64, 4, 8
    command = command_line()
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    load_start = load_avg()
    ctx = multiprocessing.get_context("spawn")
    sections = []
    for dtype in args.dtype:
        results, rate = [], args.rate or 1.0
        for name in [s for s in SCENARIOS if s in args.scenarios]:
            t = time.perf_counter()
            with ctx.Pool(1) as pool:  # a fresh process per scenario: its own peak RSS, no warm caches
                out = pool.apply(run_scenario, (name, args, dtype, rate))
            print(f"[{dtype}] {name}: {time.perf_counter() - t:.0f} s, load {load_avg()}", file=sys.stderr, flush=True)
            if name == "engine_t0" and not args.rate:
                rate = round(0.6 * out[0]["reqs"] / out[0]["wall"], 2)
            results += out
        table = report(results)
        print(f"\n== {dtype} ==\n{table}\n", flush=True)
        sections.append(f"### dtype {dtype}\n\n{table}\n")
    append_section(
        f"## bench/engine.py, {started}\n\n`{command}`\n\n- machine: {machine()}; torch threads "
                f"{args.threads}\n- load average (1/5/15 min) at start {load_start}, at end {load_avg()}\n"
                f"- workload: {args.num_requests} requests, prompt {args.prompt_len[0]}-{args.prompt_len[1]} tokens, "
                f"output {args.output_len[0]}-{args.output_len[1]} tokens, seed {args.seed}, greedy, ignore_eos; "
                f"engine max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, "
                f"block {args.block_size}, KV {args.kv_gib} GiB\n\n" + "\n".join(sections), args.results)


if __name__ == "__main__":
    main()
