"""KV blocks between nodes: a prefix another node's tiers hold, fetched over NATS vs computed.

    .venv/bin/python bench/kv_fetch.py                 # ~3 minutes on 2 CPU cores

Two engines of SmolLM2-135M (ours, float32) in one process, each on a node of its own (a host tier each), and a real
NATS server between them (workers/service/kv_blocks.py, as the workers use it). For each repetition, node a computes
two prompts of ``--words`` words (about 1,500 tokens); node b then runs the first naming node a as its source
(``kv_source``: it fetches the blocks, checks them, keeps them, loads them) and the second naming none (it computes
it). Reported: node b's time to first token for each, the blocks and bytes fetched, and the link's speed and the
prefill speed the engine measured (what it weighs to decide). Prints ``lscpu`` and appends to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.affinity import WORDS  # noqa: E402
from bench.local import cpu_name, lscpu  # noqa: E402
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402


def first_token_s(engine, request) -> float:
    """Add ``request``, step until its first token; the time it took. Then run it to its end."""
    t0 = time.perf_counter()
    engine.add_request(request)
    first = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if first is None and delta.request_id == request.request_id and delta.token_ids:
                first = time.perf_counter() - t0
    assert first is not None
    return first


async def run(args, model, tokenizer, work: Path, nats_url: str) -> dict:
    import nats

    from switchyard.shared.messages import GenerateRequest, KVSource, SamplingParams
    from switchyard.workers.engine.engine import Engine, EngineConfig
    from switchyard.workers.service.kv_blocks import KVBlockExchange

    def engine(node: str) -> Engine:
        return Engine(model, tokenizer, EngineConfig(max_num_seqs=4, kv_offload_gib=2.0,
                                                     kv_offload_host_dir=work / node))

    nodes = {}
    for name in ("node-a", "node-b"):
        e = engine(name)
        e.warmup()
        nc = await nats.connect(nats_url)
        exchange = KVBlockExchange(nc, "smollm2", name)
        read = e.connect_kv_peers(exchange)
        assert read is not None
        await exchange.start(read)
        nodes[name] = (e, nc, exchange)
    a, b = nodes["node-a"][0], nodes["node-b"][0]
    rng = random.Random(0)

    def request(n: int, prompt: str, source: KVSource | None = None) -> GenerateRequest:
        return GenerateRequest(request_id=f"r{n}", model="smollm2", tier="pro", tenant_id="t",
                               sampling=SamplingParams(max_tokens=4, temperature=0.0), created_at=0.0,
                               deadline_at=time.time() + 3600, prompt=prompt, kv_source=source)

    rows = []
    for rep in range(args.repetitions):
        prompts = [f"Record {rep}.{i}: " + " ".join(rng.choice(WORDS) for _ in range(args.words)) for i in range(2)]
        for i, prompt in enumerate(prompts):
            await asyncio.to_thread(first_token_s, a, request(100 * rep + i, prompt))
        assert await asyncio.to_thread(a.tiers.tiers.flush)
        num_tokens = len(tokenizer.encode(prompts[0]))
        blocks = num_tokens // a.config.block_size
        fetched_before = b.tiers.tiers.cost.num_fetched
        fetch = await asyncio.to_thread(first_token_s, b, request(1000 + rep, prompts[0], KVSource("node-a", blocks)))
        compute = await asyncio.to_thread(first_token_s, b, request(2000 + rep, prompts[1]))
        rows.append({"tokens": num_tokens, "fetch": fetch, "compute": compute,
                     "fetched": b.tiers.tiers.cost.num_fetched - fetched_before})
        print(f"  {rep + 1}: {num_tokens} tokens, fetched {rows[-1]['fetched']} blocks: first token {fetch * 1000:.0f}"
              f" ms fetched vs {compute * 1000:.0f} ms computed", flush=True)
    cost = b.tiers.tiers.cost
    layout = b.tiers.layout
    for e, nc, exchange in nodes.values():
        await exchange.stop()
        await nc.close()
        e.shutdown()
    return {"rows": rows, "bytes_per_s": cost.bytes_per_s, "prefill": cost.prefill_tokens_per_s,
            "block_bytes": layout.block_bytes}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--words", type=int, default=1250, help="each prompt (~1.2 tokens a word)")
    p.add_argument("--repetitions", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--results", type=Path, default=RESULTS, help="'-' to skip")
    args = p.parse_args()
    command, cpu = command_line(), lscpu()
    print(cpu)
    import torch

    from switchyard.deploy.launcher import NatsServer
    from switchyard.shared.config import SwitchyardConfig, WorkerConfig
    from switchyard.workers import model_store

    torch.set_num_threads(args.threads)
    path = model_store.pull("smollm2", SwitchyardConfig().model_cache_dir)
    model, tokenizer = model_store.load(path, WorkerConfig().dtype, "cpu")
    with tempfile.TemporaryDirectory(prefix="switchyard-kv-fetch-") as tmp, NatsServer(Path(tmp) / "nats") as server:
        out = asyncio.run(run(args, model, tokenizer, Path(tmp), server.url))
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    rows = out["rows"]
    fetch = statistics.median(r["fetch"] for r in rows)
    compute = statistics.median(r["compute"] for r in rows)
    text = "\n".join([
        f"## KV tiers between nodes: a prefix fetched from another node over NATS vs computed "
        f"({datetime.date.today().isoformat()})", "",
        f"`{command}` on {cpu_name(cpu)}, {os.cpu_count()} cores: two engines (SmolLM2-135M, ours, "
        f"{dtype}, {args.threads} torch threads) in one process, each on a node of its own (a host "
        f"tier each), a real NATS server between them (workers/service/kv_blocks.py). Per repetition node a computes "
        f"two prompts of {args.words} words; node b runs the first naming node a as its source, the second naming "
        f"none. Blocks of {out['block_bytes']:,} bytes.", "",
        markdown_table(["repetition", "prompt tokens", "blocks fetched", "first token, fetched ms",
                        "first token, computed ms"],
                       [[i + 1, r["tokens"], r["fetched"], f"{r['fetch'] * 1000:.0f}", f"{r['compute'] * 1000:.0f}"]
                        for i, r in enumerate(rows)]), "",
        f"- time to first token p50: {fetch * 1000:.0f} ms fetched vs {compute * 1000:.0f} ms computed "
        f"({compute / fetch:.1f}x)",
        f"- measured by the engine: the link at {(out['bytes_per_s'] or 0) / 1e6:.0f} MB/s, prefill at "
        f"{out['prefill'] or 0:.0f} tokens/s: a block fetched in "
        f"{out['block_bytes'] / (out['bytes_per_s'] or 1) * 1000:.1f} ms vs computed in "
        f"{16 / (out['prefill'] or 1) * 1000:.1f} ms",
    ]) + "\n"
    print("\n" + text)
    append_section(text, args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
