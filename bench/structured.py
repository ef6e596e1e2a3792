"""What constrained decoding costs per engine step: SmolLM2 decoding a batch of 32 under a mid-sized JSON schema,
next to the same batch unconstrained (target: at most 10% more per step).

    .venv/bin/python bench/structured.py                 # batch 32, 2 threads, the CPU's fastest dtype
    .venv/bin/python bench/structured.py --batch 8 --steps 40

Only steps where every sequence decodes (no prefill chunk) are timed, the first ``--skip`` of them left out. The
grammar's mask (computed in llguidance's threads, then applied to the logits) is also timed on its own, and so is
compiling the schema the first time and taking it from the cache after. Prints ``lscpu`` and appends a table to
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402

# Mid-sized: nested object, array, enums, numbers, booleans, free strings (so nothing ends early).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string"},
        "member": {"type": "boolean"},
        "plan": {"enum": ["free", "pro", "enterprise"]},
        "score": {"type": "number"},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"},
            "country": {"type": "string"}}, "required": ["street", "city", "zip", "country"],
            "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string"}},
        "notes": {"type": "string"},
    },
    "required": ["name", "age", "email", "member", "plan", "score", "address", "tags", "notes"],
    "additionalProperties": False,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=30, help="full-batch decode steps timed per run")
    p.add_argument("--skip", type=int, default=3, help="full-batch decode steps left out first (warm-up)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved (free, constrained) runs")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--results", default=str(RESULTS))
    args = p.parse_args()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print(cpu)

    import torch

    from switchyard.shared.config import SwitchyardConfig
    from switchyard.shared.messages import ChatMessage, GenerateRequest, ResponseFormat, SamplingParams
    from switchyard.workers import model_store
    from switchyard.workers.engine import engine as engine_module
    from switchyard.workers.engine import sampling as sampling_module
    from switchyard.workers.engine.engine import Engine, EngineConfig
    from switchyard.workers.serving.guided import json_schema_grammar

    torch.set_num_threads(args.threads)
    path = model_store.pull("smollm2", SwitchyardConfig().model_cache_dir)
    model, tokenizer = model_store.load(path, dtype=args.dtype, device="cpu")
    dtype = next(model.parameters()).dtype
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=args.batch, max_num_batched_tokens=2048))
    engine.runner.warmup()

    mask_s: list[float] = []
    fill, apply = engine_module.fill_masks, sampling_module.apply_masks

    def timed_fill(*a):
        t = time.perf_counter()
        out = fill(*a)
        mask_s.append(time.perf_counter() - t)
        return out

    def timed_apply(*a):
        t = time.perf_counter()
        apply(*a)
        mask_s[-1] += time.perf_counter() - t

    engine_module.fill_masks, sampling_module.apply_masks = timed_fill, timed_apply

    t = time.perf_counter()
    _ = engine.grammars  # the tokenizer's automaton for llguidance, built once per engine
    tokenizer_ms = (time.perf_counter() - t) * 1000
    grammar = json_schema_grammar(SCHEMA)
    t = time.perf_counter()
    engine.grammars.matcher(grammar)
    compile_ms = (time.perf_counter() - t) * 1000
    t = time.perf_counter()
    engine.grammars.matcher(grammar)
    cached_ms = (time.perf_counter() - t) * 1000

    def run(constrained: bool) -> list[float]:
        fmt = ResponseFormat("json_schema", SCHEMA, name="customer", strict=True) if constrained else None
        for i in range(args.batch):
            engine.add_request(GenerateRequest(
                f"{'c' if constrained else 'u'}{i}", "smollm2", "pro",
                SamplingParams(max_tokens=args.skip + args.steps + 64, temperature=0.8, seed=i, ignore_eos=True),
                0.0, 0.0, messages=[ChatMessage("user", f"Invent customer number {i} of a shop, as JSON.")],
                response_format=fmt))
        times: list[float] = []
        full = 0
        mask_s.clear()
        while engine.has_unfinished_requests() and len(times) < args.steps:
            t = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - t
            stats = engine.stats()
            if stats.batch_size == args.batch and stats.num_batched_tokens == args.batch:  # all decoding, no prefill
                full += 1
                if full > args.skip:
                    times.append(elapsed)
        for i in range(args.batch):
            engine.abort_request(f"{'c' if constrained else 'u'}{i}")
        while engine.has_unfinished_requests():
            engine.step()
        return times

    results = {}
    for constrained in (False, True) * args.rounds:  # interleaved: drift on a shared VM hits both alike
        times = run(constrained)
        results.setdefault(constrained, []).extend(times)
        if constrained:
            results.setdefault("mask", []).extend(mask_s[-len(times):] if times else [])
    free_ms = statistics.median(results[False]) * 1000
    guided_ms = statistics.median(results[True]) * 1000
    mask_ms = statistics.median(results["mask"]) * 1000 if results["mask"] else float("nan")
    ratio = guided_ms / free_ms
    model_name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if "Model name" in line), "?")
    rows = [[args.batch, f"{free_ms:.1f}", f"{guided_ms:.1f}", f"{(ratio - 1) * 100:+.1f}%", f"{mask_ms:.2f}",
             f"{tokenizer_ms:.0f}", f"{compile_ms:.1f}", f"{cached_ms:.3f}"]]
    table = markdown_table(["batch", "step ms, free", "step ms, JSON schema", "more", "mask ms / step",
                            "tokenizer ms (once)", "schema compile ms", "from cache ms"], rows)
    print(table)
    append_section(
        f"## Constrained decoding cost ({time.strftime('%Y-%m-%d')})\n\n"
        f"`{command_line()}` on {model_name}, {args.threads} threads, "
        f"SmolLM2-135M {str(dtype).removeprefix('torch.')}, "
        f"median of {len(results[False])} and {len(results[True])} full-batch decode steps ({args.rounds} "
        f"interleaved runs each), llguidance, a 9-property schema with a nested object and an array.\n\n{table}\n",
        args.results)


if __name__ == "__main__":
    main()
