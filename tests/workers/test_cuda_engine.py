"""The engine on the GPU's code path: Triton attention (and, on CUDA, CUDA graphs) gives HF's greedy tokens.

Each test runs on CUDA where there is a GPU and has a CPU twin that CI runs: the same engine over the Triton
kernels under ``TRITON_INTERPRET=1`` (tests/conftest.py sets it where there is no GPU), with decode graphs replayed
eagerly (executor/cuda_graphs.py's ``EagerReplay``) where a test asks for them; everything but the capture itself.
Where Triton is not interpreted (a GPU machine) the twins are skipped (tests/support/triton_devices.py).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

from switchyard.shared.messages import GenerateRequest, SamplingParams
from switchyard.workers.engine.engine import Engine, EngineConfig
from switchyard.workers.executor.cuda_graphs import batch_ladder
from switchyard.workers.executor.model_runner import ModelRunner, SeqChunk
from tests.support.id_tokenizer import IdTokenizer
from tests.support.triton_devices import DEVICES

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_batch_ladder_covers_every_size_up_to_the_largest():
    assert batch_ladder(1) == [1]
    assert batch_ladder(20) == [1, 2, 4, 8, 16, 20]
    assert batch_ladder(32) == [1, 2, 4, 8, 16, 24, 32]


def greedy_request(request_id: str, ids: list[int], num_tokens: int) -> GenerateRequest:
    now = time.time()
    return GenerateRequest(request_id=request_id, model="tiny", tier="pro", created_at=now, deadline_at=now + 60,
                           prompt=" ".join(map(str, ids)),
                           sampling=SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))


def greedy_engine_tokens(model, prompts, num_tokens, cuda_graphs):
    engine = Engine(model, IdTokenizer(), EngineConfig(max_num_seqs=8, block_size=16, kv_cache_bytes=64 * 2**20,
                                                       cuda_graphs=cuda_graphs, attention_backend="triton"))
    assert (engine.runner.graphs is not None) == (cuda_graphs and model.device.type == "cuda")
    tokens = {}
    for i, ids in enumerate(prompts):
        engine.add_request(greedy_request(f"r{i}", ids, num_tokens))
        tokens[f"r{i}"] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids or ())
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphs_and_eager_and_hf_agree(device, dtype):
    from tests.support.tiny_model import build_model

    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter multiplies bf16 tl.dot operands as integers (3.9); GPU only")
    model = build_model().to(device, dtype).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 40, 3, 70)]
    graphs = greedy_engine_tokens(model, prompts, 24, cuda_graphs=True)
    eager = greedy_engine_tokens(model, prompts, 24, cuda_graphs=False)
    assert graphs == eager
    assert all(len(t) == 24 for t in graphs)
    if dtype == torch.float32:
        for ids, got in zip(prompts, graphs):
            out = model.generate(torch.tensor([ids], device=device), max_new_tokens=24, do_sample=False,
                                 min_new_tokens=24)
            assert got == out[0, len(ids):].tolist()


# Least cosine similarity of quantized logits to the model's own (the tiny random model; int4 as on the CPU).
GPU_SIMILARITY = {"int8": 0.995, "int4": 0.98}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU's int8 path is the C kernel)")
@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_weights_on_the_gpu_keep_the_logits_and_replay_in_graphs(dtype, quantization):
    from tests.support.tiny_model import build_model

    model = build_model().to("cuda", dtype).eval()
    full, quantized = (ModelRunner(model, 64, 16, device="cuda", attention_backend="triton", quantization=q)
                  for q in (None, quantization))
    assert quantized.linear_kernel == f"triton {quantization}"
    ids = torch.randint(3, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    rows = [runner.execute([SeqChunk(ids, 0, list(range(3)), True, len(ids) - 1)]) for runner in (full, quantized)]
    similarity = torch.nn.functional.cosine_similarity(rows[0], rows[1], dim=-1)
    assert similarity.min() > GPU_SIMILARITY[quantization], similarity.min()
    graphs = quantized.capture_cuda_graphs(8, 128)
    quantized.graphs = None
    chunks = [SeqChunk([5], 40, list(range(3)), True)]
    eager = quantized.execute(chunks)
    quantized.graphs = graphs
    tolerance = 1e-3 if dtype == torch.float32 else 3e-2  # a replay may split the context otherwise
    torch.testing.assert_close(quantized.execute(chunks), eager, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("device", DEVICES)
def test_a_replayed_decode_step_equals_the_eager_one(device):
    from tests.support.tiny_model import build_model

    model = build_model().to(device).eval()
    runner = ModelRunner(model, 64, 16, device=device, attention_backend="triton")
    graphs = runner.capture_cuda_graphs(8, 128)
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(3)]
    runner.graphs = None
    runner.execute([SeqChunk(list(range(3, 14 + i)), 0, tables[i], False) for i in range(3)])
    chunks = [SeqChunk([5 + i], 11 + i, tables[i], True) for i in range(3)]  # padded to the captured size 4
    eager = runner.execute(chunks)
    runner.graphs = graphs
    replayed = runner.execute(chunks)
    torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_graphs_keep_what_they_read_and_not_their_runner(device):
    """A graph replays raw addresses: the decode kernels' scratch of every captured size must live as long as the
    graphs (it was freed after each capture, and a replay then wrote into memory the allocator had handed on). And
    the runner (its KV cache) must be freed when its last owner lets go, without waiting for the garbage
    collector: a benchmark's next part needs that memory."""
    from tests.support.tiny_model import build_model

    runner = ModelRunner(build_model().to(device).eval(), 64, 16, device=device, attention_backend="triton")
    graphs = runner.capture_cuda_graphs(8, 128)
    scratch = [weakref.ref(t) for size in graphs.sizes
               for t in (graphs._metadata[size].decode.part_out, graphs._metadata[size].decode.part_lse)]
    gc.collect()
    assert len(scratch) == 2 * len(graphs.sizes) and all(ref() is not None for ref in scratch)
    runner_ref, cache_ref = weakref.ref(runner), weakref.ref(runner.k_cache[0])
    gc.disable()
    try:
        del runner
        assert runner_ref() is None and cache_ref() is None
    finally:
        gc.enable()


ENGINE_SCRIPT = """
import sys, time
from switchyard.shared.messages import GenerateRequest, ResponseFormat, SafetyPolicy, SamplingParams
from switchyard.workers.engine.engine import Engine, EngineConfig
from switchyard.workers.serving.prompts import prepare_prompt
from tests.support.id_tokenizer import IdTokenizer
from tests.support.tiny_model import build_model, build_tokenizer

def request(i, **fields):
    return GenerateRequest(request_id=f"r{i}", model="tiny", tier="pro", created_at=time.time(),
                           deadline_at=time.time() + 60, sampling=SamplingParams(max_tokens=3), **fields)

engine = Engine(build_model().eval(), IdTokenizer(), EngineConfig(kv_cache_bytes=2**20))
engine.add_request(request(0, prompt="5 6 7"))
while engine.has_unfinished_requests():
    engine.step()
loaded = lambda: sorted(m for m in ("llguidance", "profanity_check", "sklearn") if m in sys.modules)
assert loaded() == [], loaded()
tokenizer = build_tokenizer()
"""


def run_isolated(script: str) -> None:
    """Run ``script`` in a fresh interpreter (what it imports is the point) and expect it to print ok."""
    # Run from elsewhere, the checkout last on the path: where switchyard is not installed, it comes from the
    # path's mapped folder (bench/gpu_site.py) before the checkout's root.
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    done = subprocess.run([sys.executable, "-c", script + "print('ok')"], cwd=Path(__file__).parent,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path})
    assert done.stdout.strip().endswith("ok"), done.stdout[-3000:] + done.stderr[-3000:]


def test_an_engine_loads_a_grammar_only_for_a_request_that_uses_one():
    """An engine that never sees a grammar or a filtered tenant imports neither llguidance nor the profanity
    classifier (a GPU machine's image has neither); a request with a response format loads llguidance, on the
    intake's side of the engine (prepare_prompt), not inside a step."""
    run_isolated(ENGINE_SCRIPT + """
engine = Engine(build_model().eval(), tokenizer, EngineConfig(kv_cache_bytes=2**20))
prepare_prompt(tokenizer, request(2, prompt="hi", response_format=ResponseFormat(type="json_object")), 256,
               engine.grammars, 512)
assert loaded() == ["llguidance"], loaded()
""")


def test_a_filtered_tenants_request_loads_the_classifier_on_the_intake_side():
    """The profanity classifier is loaded by the first request whose safety policy uses it, in prepare_prompt.
    (A GPU machine's image lacks the classifier on purpose, and its engine never loads it: skipped there.)"""
    pytest.importorskip("profanity_check")
    run_isolated(ENGINE_SCRIPT + """
prepare_prompt(tokenizer, request(1, prompt="hi", safety=SafetyPolicy(mode="block", classifier_threshold=0.9)),
               256, None, 512)
assert loaded() == ["profanity_check", "sklearn"], loaded()
""")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sampling_with_penalties_and_masks_never_waits_for_the_device():
    from switchyard.workers.engine.sampling import sample
    from switchyard.workers.serving.choice import make_generator

    logits = torch.randn(4, 1000, device="cuda")
    params = [SamplingParams(temperature=t, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
              for t in (0.0, 0.7, 1.0, 0.0)]
    mask = torch.full((2, -(-1000 // 32)), -1, dtype=torch.int32, pin_memory=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample(logits, params, [make_generator(i) for i in range(4)], prompt_token_ids=[[1, 2, 3]] * 4,
               output_token_ids=[[4, 4, 5], [], [9], [1]], masks=([1, 3], mask))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("device", DEVICES)
def test_a_prefix_written_to_the_kv_tiers_comes_back_on_the_device_exactly(device, tmp_path):
    """The device path of the KV tiers: blocks copied off the device (pinned, not blocking, on CUDA) by one engine,
    loaded into another's pool, give the same greedy tokens as computing them."""
    from tests.support.tiny_model import build_model

    model = build_model().to(device).eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (90,), generator=gen).tolist()

    def run(tiers: bool) -> tuple[list[int], int]:
        offload = {"kv_offload_gib": 0.05, "kv_offload_host_dir": tmp_path} if tiers else {"kv_offload_gib": 0}
        engine = Engine(model, IdTokenizer(), EngineConfig(max_num_seqs=2, kv_cache_bytes=8 * 2**20,
                                                           attention_backend="triton", cuda_graphs=False, **offload))
        engine.add_request(greedy_request("r", ids, 12))
        tokens, cached = [], 0
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens.extend(delta.token_ids or ())
                cached = delta.usage.cached_tokens if delta.usage else cached
        if engine.tiers is not None:
            assert engine.tiers.tiers.flush()
        engine.shutdown()
        return tokens, cached

    computed, _ = run(tiers=False)
    assert run(tiers=True) == (computed, 0)  # the first writes the prompt's blocks through
    assert run(tiers=True) == (computed, 80)  # the second loads its five full blocks before the last token
