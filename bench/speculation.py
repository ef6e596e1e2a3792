"""Speculative decoding by prompt lookup on SmolLM2: decode tokens/s of one stream, and of 8 at once, with drafts
and without, where the output repeats the prompt (quoting a document, editing a given text) and where it does not
(free writing), and whether the two outputs are the same.

    .venv/bin/python bench/speculation.py                      # K = 4, float32, 128 tokens, 3 repeats
    .venv/bin/python bench/speculation.py --num-speculative-tokens 4 8 --dtype bfloat16

The engine is driven directly (no gateway, no NATS): what is measured is the engine's decode, the part drafts
change. Each request is greedy (drafts are for greedy requests). A row's time runs from the request's add to its
end, its prefill included, the same in both arms; the speed-up is plain time over speculative time (median of the
repeats). Targets (issue 40): at least 1.8x where the output repeats the prompt, at least 0.95x where it does not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.local import cpu_name, lscpu  # noqa: E402
from bench.results import append_section, command_line, markdown_table  # noqa: E402
from switchyard.shared.messages import ChatMessage, GenerateRequest, SamplingParams  # noqa: E402
from switchyard.workers.engine.engine import Engine, EngineConfig  # noqa: E402
from switchyard.workers.model_store import load, pull  # noqa: E402
from tests.support.system import model_cache_dir  # noqa: E402

DOCUMENT = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, the "
            "members agreed to raise the allowance for repairs to the old library, to hire two more teachers for the "
            "primary school, and to postpone the new road until the spring, when the ground will be dry enough to "
            "build on. The treasurer reminded everyone that the accounts must be filed by the end of March.")
CODE = ("def parse_line(line):\n    fields = line.strip().split(',')\n    name = fields[0]\n    age = int(fields[1])\n"
        "    city = fields[2]\n    return {'name': name, 'age': age, 'city': city}\n\n\n"
        "def parse_file(path):\n    with open(path) as f:\n        return [parse_line(line) for line in f]\n")
WORKLOADS = {
    "repeats the prompt": [
        f"Repeat the following text exactly, word for word:\n\n{DOCUMENT}",
        f"Rewrite the following text, replacing 'committee' with 'council' and changing nothing else:\n\n{DOCUMENT}",
        f"Add a docstring to each function below and return the whole code:\n\n{CODE}",
    ],
    "free writing": [
        "Write a short story about a fisherman and a storm.",
        "Explain how a bicycle works to a ten-year-old.",
        "What are three good habits for studying?",
    ],
}


def request(i: int, prompt: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id=f"r{i}", model="smollm2", tier="pro", created_at=0.0, deadline_at=0.0,
                           sampling=SamplingParams(temperature=0, max_tokens=max_tokens),
                           messages=[ChatMessage("user", prompt)])


def run(engine: Engine, prompts: list[str], max_tokens: int, ids) -> tuple[float, int, dict[str, str]]:
    """Every prompt at once to its end: (seconds, tokens generated, text per prompt)."""
    texts: dict[str, str] = {}
    tokens = 0
    started = time.perf_counter()
    for prompt in prompts:
        engine.add_request(request(next(ids), prompt, max_tokens))
    by_id = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            by_id[delta.request_id] = by_id.get(delta.request_id, "") + delta.text
            tokens += delta.num_tokens
    elapsed = time.perf_counter() - started
    for prompt, request_id in zip(prompts, sorted(by_id, key=lambda r: int(r[1:]))):
        texts[prompt] = by_id[request_id]
    return elapsed, tokens, texts


def measure(model, tokenizer, config: EngineConfig, prompts: list[str], streams: int, args) -> dict:
    """Median seconds and tokens/s over ``args.repeats`` runs of the prompts, ``streams`` at a time."""
    engine = Engine(model, tokenizer, config)
    engine.warmup()
    ids = iter(range(10**9))
    run(engine, prompts[:1], 8, ids)  # first-use costs out of the timed runs
    times, tokens, texts = [], 0, {}
    for _ in range(args.repeats):
        seconds = 0.0
        tokens = 0
        for start in range(0, len(prompts), streams):
            batch = prompts[start : start + streams]
            if streams > 1:
                batch = (batch * streams)[:streams]  # several streams of the same prompts
            s, n, t = run(engine, batch, args.max_tokens, ids)
            seconds, tokens = seconds + s, tokens + n
            texts.update(t)
        times.append(seconds)
    seconds = statistics.median(times)
    kept = engine.num_accepted_draft_tokens / engine.num_draft_tokens if engine.num_draft_tokens else None
    return {"seconds": seconds, "tok_s": tokens / seconds, "texts": texts, "acceptance": kept}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[4])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--results", default=None, help="markdown file to append to; '-' for none")
    args = p.parse_args()
    report = lscpu()
    torch.set_num_threads(args.threads)
    model, tokenizer = load(pull("smollm2", model_cache_dir()), dtype=args.dtype, device="cpu")
    rows = []
    for workload, prompts in WORKLOADS.items():
        for streams in args.streams:
            plain = measure(model, tokenizer, EngineConfig(max_num_seqs=max(args.streams)), prompts, streams, args)
            for k in args.num_speculative_tokens:
                config = EngineConfig(max_num_seqs=max(args.streams), speculative="ngram", num_speculative_tokens=k)
                fast = measure(model, tokenizer, config, prompts, streams, args)
                same = sum(fast["texts"][q] == plain["texts"][q] for q in plain["texts"])
                row = [workload, streams, k, f"{plain['tok_s']:.1f}", f"{fast['tok_s']:.1f}",
                       f"{plain['seconds'] / fast['seconds']:.2f}x",
                       "-" if fast["acceptance"] is None else f"{fast['acceptance']:.0%}",
                       f"{same}/{len(plain['texts'])}"]
                rows.append(row)
                print(" | ".join(map(str, row)), flush=True)
    table = markdown_table(["workload", "streams", "K", "plain tok/s", "drafts tok/s", "speed-up",
                            "drafts kept", "same output"], rows)
    section = "\n".join([
        f"## Speculative decoding by prompt lookup, SmolLM2 ({args.dtype}, {args.threads} threads), "
        f"{cpu_name(report)}", "", f"`{command_line()}`", "",
        f"{args.max_tokens} tokens a request, greedy; tokens/s of all streams together, median of {args.repeats}. "
        "Engine only (no gateway): what drafts change is the engine's decode.", "", table])
    print(section)
    append_section(section, args.results or Path(__file__).with_name("RESULTS.md"))


if __name__ == "__main__":
    main()
