"""Speculative decoding on SmolLM2, by prompt lookup or by a draft model: decode tokens/s of one stream, and of 8 at
once, with drafts and without, where the output repeats the prompt (quoting a document, editing a given text) and
where it does not (free writing), and whether the two outputs are the same.

    .venv/bin/python bench/speculation.py                      # prompt lookup, K = 4, float32, 128 tokens
    .venv/bin/python bench/speculation.py --num-speculative-tokens 4 8 --dtype bfloat16
    .venv/bin/python bench/speculation.py --method draft --draft-quantization int4   # SmolLM2 in int4 drafts
    .venv/bin/python bench/speculation.py --measured       # and drafts only where measured faster

There is no smaller model of SmolLM2's tokenizer here, so ``--method draft`` drafts with SmolLM2 itself, quantized
as ``--draft-quantization`` says: what it shows is the mechanism's cost and what a draft that agrees often gains.

The engine is driven directly (no gateway, no NATS): what is measured is the engine's decode, the part drafts
change. Each request is greedy, so the two arms' outputs can be compared token for token. A row's time runs from
the request's add to its end, its prefill included, the same in both arms; the speed-up is plain time over
speculative time (median of the repeats). Targets (issue 40): at least 1.8x where the output repeats the prompt,
at least 0.95x where it does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.local import cpu_name, lscpu  # noqa: E402
from bench.results import append_section, command_line, markdown_table  # noqa: E402
from switchyard.workers.engine.engine import Engine, EngineConfig  # noqa: E402
from switchyard.workers.model_store import load, pull  # noqa: E402
from tests.support.engine_runs import run_prompts  # noqa: E402
from tests.support.system import model_cache_dir  # noqa: E402
from tests.support.texts import FREE_PROMPTS, REPEATING_PROMPTS  # noqa: E402

WORKLOADS = {"repeats the prompt": REPEATING_PROMPTS, "free writing": FREE_PROMPTS}


def measure(model, tokenizer, config: EngineConfig, prompts: list[str], streams: int, args, draft=None) -> dict:
    """Median seconds and tokens/s over ``args.repeats`` runs of the prompts, ``streams`` at a time (one prompt a
    stream, several streams of each where there are more streams than prompts), and each prompt's output."""
    engine = Engine(model, tokenizer, config, draft)
    engine.warmup()
    run_prompts(engine, prompts[:1], 8)  # first-use costs out of the timed runs
    times, tokens, outputs = [], 0, {}
    for _ in range(args.repeats):
        seconds, tokens = 0.0, 0
        for start in range(0, len(prompts), streams):
            batch = prompts[start : start + streams]
            if streams > 1:
                batch = (batch * streams)[:streams]
            run = run_prompts(engine, batch, args.max_tokens)
            seconds, tokens = seconds + run.seconds, tokens + run.num_tokens
            outputs.update(zip(batch, run.token_ids))
        times.append(seconds)
    seconds = statistics.median(times)
    kept = engine.num_accepted_draft_tokens / engine.num_draft_tokens if engine.num_draft_tokens else None
    return {"seconds": seconds, "tok_s": tokens / seconds, "outputs": outputs, "acceptance": kept,
            "without_drafts": engine.stats().num_steps_without_drafts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="ngram", choices=["ngram", "draft"])
    p.add_argument("--draft-quantization", choices=["int8", "w8a8", "int4"], default="int4",
                   help="--method draft: SmolLM2 drafts for itself with its weights so (float32)")
    p.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[4])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--measured", action="store_true",
                   help="also with drafts only where measured faster (speculation_gate.py): what that choice changes")
    p.add_argument("--results", default=None, help="markdown file to append to; '-' for none")
    args = p.parse_args()
    report = lscpu()
    torch.set_num_threads(args.threads)
    path = pull("smollm2", model_cache_dir())
    model, tokenizer = load(path, dtype=args.dtype, device="cpu")
    draft = load(path, dtype="float32", device="cpu")[0] if args.method == "draft" else None
    draft_quantization = args.draft_quantization if draft is not None else None
    rows = []
    for workload, prompts in WORKLOADS.items():
        for streams in args.streams:
            plain = measure(model, tokenizer, EngineConfig(max_num_seqs=max(args.streams)), prompts, streams, args)
            for k in args.num_speculative_tokens:
                config = EngineConfig(max_num_seqs=max(args.streams), speculative=args.method,
                                      num_speculative_tokens=k,
                                      speculative_quantization=draft_quantization)
                fast = measure(model, tokenizer, config, prompts, streams, args, draft)
                same = sum(fast["outputs"][q] == plain["outputs"][q] for q in plain["outputs"])
                measured_cells = []
                if args.measured:
                    gated = measure(model, tokenizer, dataclasses.replace(config, speculation_measured=True),
                                    prompts, streams, args, draft)
                    measured_cells = [f"{gated['tok_s']:.1f} ({plain['seconds'] / gated['seconds']:.2f}x)",
                             gated["without_drafts"]]
                row = [workload, streams, k, f"{plain['tok_s']:.1f}", *measured_cells, f"{fast['tok_s']:.1f}",
                       f"{plain['seconds'] / fast['seconds']:.2f}x",
                       "-" if fast["acceptance"] is None else f"{fast['acceptance']:.0%}",
                       f"{same}/{len(plain['outputs'])}"]
                rows.append(row)
                print(" | ".join(map(str, row)), flush=True)
    table = markdown_table(["workload", "streams", "K", "plain tok/s",
                            *(["measured drafts tok/s", "steps without drafts"] if args.measured else []),
                            "drafts tok/s", "speed-up", "drafts kept", "same output"], rows)
    section = "\n".join([
        f"## Speculative decoding by "
        f"{'prompt lookup' if draft is None else f'a draft model (SmolLM2 in {args.draft_quantization})'}, "
        f"SmolLM2 ({args.dtype}, {args.threads} threads), "
        f"{cpu_name(report)}", "", f"`{command_line()}`", "",
        f"{args.max_tokens} tokens a request, greedy; tokens/s of all streams together, median of {args.repeats}. "
        "Engine only (no gateway): what drafts change is the engine's decode. Measured drafts: drafts only where "
        "measured faster for the batch's size (workers/engine/speculation_gate.py); steps without drafts: the decode "
        "steps it ran without them, its tries included.", "", table])
    print(section)
    append_section(section, args.results or Path(__file__).with_name("RESULTS.md"))


if __name__ == "__main__":
    main()
