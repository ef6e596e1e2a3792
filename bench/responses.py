"""The Responses API's cost over chat, and embeddings throughput against sentence-transformers.

    /work/bin/benchlock .venv/bin/python bench/responses.py    # starts its own system, ~3 minutes

It starts embedded NATS + Postgres in a temp dir, a SmolLM2-135M worker, an all-MiniLM-L6-v2 embeddings worker
(both from the model cache) and a gateway, then:

1. Time to first token of the same streamed requests through ``/v1/chat/completions`` and ``/v1/responses``,
   alternating one by one (so both see the same machine), ``--requests`` of each: send to the first content chunk
   (chat) or the first ``response.output_text.delta`` (responses); each pair's prompts are the same sentence
   opened differently, so neither finds the other in the prefix cache. Target: the Responses p50 within 5 ms of
   chat's (the median of the pairs' differences is reported too: it is steadier on a shared machine).
2. Embeddings: inputs/s at batch 1, 16 and 64 (``--inputs`` sentences of 4 to 60 words, one request per batch,
   one request at a time, the official ``openai`` client's default base64) through the whole system, and
   sentence-transformers' ``encode`` on the same sentences at the same batch sizes in this process, with the
   same number of torch threads as the worker, the two alternating in ``--rounds`` rounds. Target: the system at
   least sentence-transformers' throughput at batch 64. ``--vllm``: a second embeddings worker on the vLLM engine
   (its pooling runner, in .venv-vllm), served as ``all-minilm-l6-v2-vllm``, measured in the same rounds.
   ``--requests 0`` skips part 1 (no chat worker).

Prints ``lscpu`` and appends the tables to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.local import MODEL, cpu_name, local_system, lscpu, unlimited_keys  # noqa: E402
from bench.overload import ms, pct  # noqa: E402
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402
from tests.support.system import free_port  # noqa: E402

EMBED = "all-minilm-l6-v2"
EMBED_VLLM = f"{EMBED}-vllm"
WORDS = ("river mountain ledger cobalt harbor lantern orchard falcon meadow quartz signal timber velvet willow "
         "anchor beacon canyon delta ember fjord glacier horizon island jasmine kestrel lagoon").split()


def sentences(n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))) + "." for _ in range(n)]


async def first_token_s(http: httpx.AsyncClient, path: str, body: dict) -> float:
    """Seconds from send to the first content of a streamed chat completion or response."""
    t0 = time.perf_counter()
    async with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path}: {r.status_code} {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            if obj.get("type") == "response.output_text.delta" or any(
                    c["delta"].get("content") for c in obj.get("choices") or ()):
                elapsed = time.perf_counter() - t0
                await r.aclose()
                return elapsed
    raise RuntimeError(f"{path}: no content")


async def compare_ttft(base: str, key: str, n: int, max_tokens: int) -> dict[str, list[float]]:
    prompts = sentences(n, seed=3)
    out: dict[str, list[float]] = {"chat": [], "responses": []}
    async with httpx.AsyncClient(base_url=base, timeout=120, headers={"Authorization": f"Bearer {key}"}) as http:
        for warm in range(3):  # the first requests of each path pay for imports and caches
            await first_token_s(http, "/v1/chat/completions", _chat(prompts[warm], max_tokens))
            await first_token_s(http, "/v1/responses", _response(prompts[warm], max_tokens))
        for i, prompt in enumerate(prompts):
            # The same sentence, opened differently: neither request finds the other's prompt in the prefix cache.
            pair = [("chat", "/v1/chat/completions", _chat(f"Chat {i}: {prompt}", max_tokens)),
                    ("responses", "/v1/responses", _response(f"Resp {i}: {prompt}", max_tokens))]
            for name, path, body in pair if i % 2 == 0 else pair[::-1]:  # alternate which goes first
                out[name].append(await first_token_s(http, path, body))
    return out


def _chat(prompt: str, max_tokens: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}


def _response(prompt: str, max_tokens: int) -> dict:
    return {"model": MODEL, "input": prompt, "max_output_tokens": max_tokens, "temperature": 0, "stream": True,
            "store": False}


def embed_rounds(base: str, key: str, reference, texts: list[str], batch: int, rounds: int,
                 models: list[str]) -> dict[str, float]:
    """Inputs/s of each of ``models`` through the system and of sentence-transformers (``reference``) at ``batch``,
    measured in alternating rounds (each on its share of ``texts``), so all see the same machine: a shared one
    changes speed by the minute."""
    from openai import OpenAI

    spent = dict.fromkeys([*models, "reference"], 0.0)
    with OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=600) as client:
        for model in models:  # warm
            client.embeddings.create(model=model, input=texts[:batch])
        reference.encode(texts[:batch], batch_size=batch)
        share = len(texts) // rounds
        for r in range(rounds):
            part = texts[r * share:(r + 1) * share]
            for model in models:
                t0 = time.perf_counter()
                for start in range(0, len(part), batch):
                    client.embeddings.create(model=model, input=part[start:start + batch])
                spent[model] += time.perf_counter() - t0
            t0 = time.perf_counter()
            for start in range(0, len(part), batch):
                reference.encode(part[start:start + batch], batch_size=batch)
            spent["reference"] += time.perf_counter() - t0
    done = share * rounds
    return {name: done / seconds for name, seconds in spent.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=60, help="streamed requests per API")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--inputs", type=int, default=512, help="sentences embedded per batch size")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads, worker and reference")
    p.add_argument("--rounds", type=int, default=4, help="alternating system/reference rounds per batch size")
    p.add_argument("--vllm", action="store_true", help="also an embeddings worker on the vLLM engine (.venv-vllm)")
    p.add_argument("--results", type=Path, default=RESULTS, help="'-' to skip")
    args = p.parse_args()
    command, cpu = command_line(), lscpu()
    import torch
    from sentence_transformers import SentenceTransformer

    from switchyard.shared.config import GatewayConfig, SwitchyardConfig
    from switchyard.workers import model_store

    embed_dir = model_store.resolve(EMBED, SwitchyardConfig().model_cache_dir)
    system, config, work = local_system("responses", GatewayConfig(port=free_port()),
                                        {"torch_threads": args.threads, "max_num_seqs": 8})
    texts = sentences(args.inputs)
    batches = (1, 16, 64)
    torch.set_num_threads(args.threads)
    reference = SentenceTransformer(str(embed_dir), device="cpu")
    models = [EMBED, *([EMBED_VLLM] if args.vllm else [])]
    rates: dict[int, dict[str, float]] = {}
    ttft = None
    try:
        system.start_servers()
        (key,) = asyncio.run(unlimited_keys(config.database_url, "pro", "responses"))
        if args.requests:
            system.start_worker("worker")
        system.start_worker("worker-embed", model=str(embed_dir), served_model_name=EMBED, engine="embeddings",
                            max_num_seqs=64, dtype="float32")
        if args.vllm:
            system.start_worker("worker-embed-vllm", model=str(embed_dir), served_model_name=EMBED_VLLM,
                                engine="vllm", max_num_seqs=64, dtype="float32")
        system.start_gateway()
        for model in ([MODEL] if args.requests else []) + models:
            system.wait_until_ready(model, timeout_s=300)
        if args.requests:
            ttft = asyncio.run(compare_ttft(system.url(), key, args.requests, args.max_tokens))
            print({k: (ms(pct(v, 50)), ms(pct(v, 95))) for k, v in ttft.items()}, flush=True)
        # The chat worker idles meanwhile; the embeddings workers and the reference take turns on the cores.
        for b in batches:
            rates[b] = embed_rounds(system.url(), key, reference, texts, b, args.rounds, models)
            print(f"batch {b}: " + ", ".join(f"{k} {v:.1f} inputs/s" for k, v in rates[b].items()), flush=True)
    finally:
        system.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(args, ttft, rates, command, cpu)
    return 0


def report(args, ttft: dict | None, rates: dict[int, dict[str, float]], command: str, cpu: str) -> None:
    parts = [f"`{command}` on {cpu_name(cpu)}, {os.cpu_count()} cores, run through benchlock (no test ran meanwhile; "
             f"other engineers' builds and editors share the machine: timings are noisy). "]
    if ttft is not None:
        parts.append(f"SmolLM2-135M worker (max_num_seqs=8), streamed requests one at a time, {args.requests} per API "
                     f"alternating, max_tokens={args.max_tokens}; ")
    parts.append(f"all-MiniLM-L6-v2 worker (fp32, 64 inputs a step{', and one on the vLLM engine' if args.vllm else ''}"
                 f"), {args.inputs} sentences of 4-60 words, one request at a time, the official client; "
                 f"sentence-transformers in process, same sentences and batch sizes, {args.threads} torch threads "
                 f"(the worker's too), {'all' if args.vllm else 'the two'} alternating in {args.rounds} rounds.")
    lines = [f"## The Responses API over chat; embeddings against sentence-transformers "
             f"({datetime.date.today().isoformat()})", "", "".join(parts), ""]
    if ttft is not None:
        chat50, resp50 = pct(ttft["chat"], 50), pct(ttft["responses"], 50)
        added_ms = (resp50 - chat50) * 1000
        # Each pair ran back to back on the same machine state: the median of their differences is steadier.
        paired_ms = pct([r - c for r, c in zip(ttft["responses"], ttft["chat"])], 50) * 1000
        rows = [[name, len(v), ms(pct(v, 50)), ms(pct(v, 95))] for name, v in ttft.items()]
        lines += [markdown_table(["API", "requests", "TTFT p50 ms", "TTFT p95 ms"], rows), "",
                  f"- Responses TTFT p50 - chat TTFT p50 = {added_ms:+.1f} ms (target within 5 ms): "
                  f"{'MET' if added_ms <= 5 else 'NOT MET'}; the median of the pairs' differences (each pair back to "
                  f"back): {paired_ms:+.1f} ms", ""]
    header = ["batch", "system inputs/s", "sentence-transformers inputs/s", "ratio"]
    if args.vllm:
        header += ["system on vLLM inputs/s", "vLLM ratio"]
    rows = []
    for b, r in rates.items():
        row = [b, f"{r[EMBED]:.1f}", f"{r['reference']:.1f}", f"{r[EMBED] / r['reference']:.2f}"]
        if args.vllm:
            row += [f"{r[EMBED_VLLM]:.1f}", f"{r[EMBED_VLLM] / r['reference']:.2f}"]
        rows.append(row)
    at64 = rates[64][EMBED] / rates[64]["reference"]
    lines += [markdown_table(header, rows), "",
              f"- at batch 64 the system does {at64:.2f}x sentence-transformers' throughput (target >= 1): "
              f"{'MET' if at64 >= 1 else 'NOT MET'}"]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    append_section(text, args.results)


if __name__ == "__main__":
    sys.exit(main())
