"""Quantized weights in our engine on SmolLM2 (weight-only int8; w8a8: int8 activations too; int4: 4-bit weights in
groups of 32, on int8 activations), against float32 and bfloat16: perplexity on a fixed text, greedy agreement with
float32 over a set of prompts, and decode tokens/s of 1, 8 and 32 streams.

    .venv/bin/python bench/quantization.py
    .venv/bin/python bench/quantization.py --configs float32 int8 --max-tokens 64

Perplexity: the model's next-token loss over FIXED_TEXT (one forward of the whole text, every row's logits).
Greedy agreement: each prompt's greedy output of ``--max-tokens`` tokens against float32's; "same" counts the
prompts whose whole output is identical, "tokens before the first difference" is the mean share of the output
that matches before they part. Speed: the engine driven directly, greedy, ``--max-tokens`` a request (EOS ignored,
so every configuration decodes as many tokens), tokens/s of all streams together, median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.local import cpu_name, lscpu  # noqa: E402
from bench.results import append_section, command_line, markdown_table  # noqa: E402
from switchyard.workers.engine.engine import Engine, EngineConfig  # noqa: E402
from switchyard.workers.model_store import load, pull  # noqa: E402
from tests.support.engine_runs import perplexity, run_prompts  # noqa: E402
from tests.support.system import model_cache_dir  # noqa: E402
from tests.support.texts import CHAT_PROMPTS, FIXED_TEXT  # noqa: E402

CONFIGS = {"float32": ("float32", None), "bfloat16": ("bfloat16", None), "int8": ("float32", "int8"),
           "w8a8": ("float32", "w8a8"), "int4": ("float32", "int4")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--results", default=None, help="markdown file to append to; '-' for none")
    args = p.parse_args()
    report = lscpu()
    torch.set_num_threads(args.threads)
    path = pull("smollm2", model_cache_dir())
    rows, reference = [], None
    for name in args.configs:
        dtype, quantization = CONFIGS[name]
        model, tokenizer = load(path, dtype=dtype, device="cpu")
        ppl = perplexity(model, tokenizer, FIXED_TEXT, quantization)
        engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=max(len(CHAT_PROMPTS), *args.streams),
                                                       quantization=quantization))
        engine.warmup()
        outputs = run_prompts(engine, CHAT_PROMPTS, args.max_tokens).token_ids
        if reference is None:
            reference = outputs
        same = sum(a == b for a, b in zip(outputs, reference))
        matched = statistics.mean(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                                  / max(1, len(b)) for a, b in zip(outputs, reference))
        speeds = []
        for streams in args.streams:
            prompts = [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(streams)]
            # Every stream runs its max_tokens: configurations whose outputs end sooner are not slower for it.
            runs = [run_prompts(engine, prompts, args.max_tokens, ignore_eos=True) for _ in range(args.repeats)]
            speeds.append(statistics.median(run.num_tokens / run.seconds for run in runs))
        bytes_ = engine.runner.packed_weight_bytes or sum(x.numel() * x.element_size() for x in model.parameters())
        row = [name, f"{bytes_ / 2**20:.0f}", f"{ppl:.3f}", f"{same}/{len(CHAT_PROMPTS)}", f"{matched:.0%}",
               *(f"{speed:.1f}" for speed in speeds)]
        rows.append(row)
        print(" | ".join(row), flush=True)
    table = markdown_table(["weights", "MiB streamed a step", "perplexity", "same greedy output as float32",
                            "tokens before the first difference", *(f"tok/s, {n} streams" for n in args.streams)],
                           rows)
    section = "\n".join([
        f"## Quantized weights (int8, w8a8, int4) against float32 and bfloat16, SmolLM2, {cpu_name(report)} "
        f"({args.threads} threads)",
        "", f"`{command_line()}`", "",
        f"Perplexity over the {len(FIXED_TEXT)}-character FIXED_TEXT in tests/support/texts.py; greedy agreement "
        f"over {len(CHAT_PROMPTS)} chat prompts of {args.max_tokens} tokens against float32; decode speed of the "
        f"engine driven directly (median of {args.repeats}).", "", table])
    print(section)
    append_section(section, args.results or Path(__file__).with_name("RESULTS.md"))


if __name__ == "__main__":
    main()
