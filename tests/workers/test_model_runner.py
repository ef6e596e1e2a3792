"""ModelRunner against HF transformers on tiny random models: same logits, same greedy tokens.

Block size 4 with shuffled block tables, so every sequence crosses many non-contiguous blocks.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from switchyard.workers.executor.attention import SdpaAttention, make_attention
from switchyard.workers.executor.model_runner import ModelRunner, SeqChunk
from tests.support.triton_devices import NOT_INTERPRETED, interpreted

BLOCK_SIZE = 4
NUM_BLOCKS = 128
DIMS = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
)
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,  # small, so all three bands are exercised
}


def build(kind: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "qwen2":  # q/k/v biases
        model = Qwen2ForCausalLM(Qwen2Config(**DIMS))
    elif kind == "llama3-rope":
        model = LlamaForCausalLM(LlamaConfig(**DIMS, rope_parameters=LLAMA3_ROPE))
    elif kind == "llama-tied-bias":
        model = LlamaForCausalLM(LlamaConfig(**DIMS, attention_bias=True, tie_word_embeddings=True))
    else:
        model = LlamaForCausalLM(LlamaConfig(**DIMS))
    if kind == "qwen2":  # random init leaves biases at zero: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(std=0.5)
    return model.to(dtype).eval()


class BlockPool:
    """Hands out shuffled, non-contiguous block ids."""

    def __init__(self, seed: int = 1):
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)

    def table(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // BLOCK_SIZE)
        table, self.free = self.free[:n], self.free[n:]
        return table


def prompts(*lengths: int, seed: int = 2) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, DIMS["vocab_size"]) for _ in range(n)] for n in lengths]


@torch.no_grad()
def hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1].float()


@torch.no_grad()
def hf_greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
        max_new_tokens=num_tokens, eos_token_id=None, pad_token_id=0,
    )
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama3-rope", "llama-tied-bias"])
def test_full_prefill_matches_hf(kind):
    model = build(kind)
    runner = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE)
    pool = BlockPool()
    seqs = prompts(5, 17, 30)
    chunks = [SeqChunk(p, 0, pool.table(len(p)), needs_logits=True) for p in seqs]

    logits = runner.execute(chunks)

    assert logits.dtype == torch.float32 and logits.shape == (3, DIMS["vocab_size"])
    for p, row in zip(seqs, logits):
        torch.testing.assert_close(row, hf_last_logits(model, p), atol=1e-4, rtol=1e-4)


def test_logits_only_where_asked_in_chunk_order():
    model = build()
    runner = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE)
    pool = BlockPool()
    long, short, single = prompts(9, 3, 1)
    chunks = [
        SeqChunk(single, 0, pool.table(1), needs_logits=True),  # a one-token prompt runs with the decodes
        SeqChunk(long, 0, pool.table(9), needs_logits=False),
        SeqChunk(short, 0, pool.table(3), needs_logits=True),
    ]
    logits = runner.execute(chunks)
    assert logits.shape[0] == 2
    torch.testing.assert_close(logits[0], hf_last_logits(model, single), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], hf_last_logits(model, short), atol=1e-4, rtol=1e-4)
    assert runner.execute([SeqChunk([7], 9, chunks[1].block_table, needs_logits=False)]).shape == (0, 512)


def test_chunked_prefill_matches_full_prefill():
    model = build()
    runner = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE)
    pool = BlockPool()
    seqs = prompts(5, 17, 30)
    tables = [pool.table(len(p)) for p in seqs]
    final: dict[int, torch.Tensor] = {}
    done = [0] * len(seqs)
    while len(final) < len(seqs):
        step = [i for i in range(len(seqs)) if done[i] < len(seqs[i])]
        chunks = []
        for i in step:
            part = seqs[i][done[i] : done[i] + 5]
            chunks.append(SeqChunk(part, done[i], tables[i], needs_logits=done[i] + len(part) == len(seqs[i])))
            done[i] += len(part)
        logits = runner.execute(chunks)
        for i, row in zip([i for i, c in zip(step, chunks) if c.needs_logits], logits):
            final[i] = row

    for i, p in enumerate(seqs):
        torch.testing.assert_close(final[i], hf_last_logits(model, p), atol=1e-4, rtol=1e-4)


# The runner tests run on CPU tensors: Triton takes them only interpreted (the GPU machine runs test_cuda_engine).
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None or not interpreted(),
                                  reason=NOT_INTERPRETED)


def test_prefix_shared_through_block_table():
    """A second sequence reuses the first one's full blocks (prefix caching) and computes only its suffix."""
    model = build()
    runner = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE)
    pool = BlockPool()
    first, suffix = prompts(10, 7)
    first_table = pool.table(10)
    runner.execute([SeqChunk(first, 0, first_table, needs_logits=False)])
    shared = 8  # two full blocks
    second = first[:shared] + suffix
    second_table = first_table[:2] + pool.table(len(suffix) + 1)

    logits = runner.execute([SeqChunk(suffix, shared, second_table, needs_logits=True)])

    torch.testing.assert_close(logits[0], hf_last_logits(model, second), atol=1e-4, rtol=1e-4)


# the fallback, the compiled CPU kernels, and the CUDA default (interpreted on CPU)
@pytest.mark.parametrize("backend", ["sdpa", "cpu_paged", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_decode_mixed_with_prefill_matches_hf_generate(kind, backend):
    model = build(kind)
    runner = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, attention_backend=backend)
    pool = BlockPool()
    num_new = 10
    seqs = prompts(6, 11, 23)
    tables = [pool.table(len(p) + num_new) for p in seqs]
    tokens = [list(p) for p in seqs]
    computed = [0] * len(seqs)  # tokens already in the cache
    # The first two prefill at once; the third starts later and prefills in chunks of 5 while the others decode.
    active = [0, 1]
    steps = 0
    while any(len(tokens[i]) < len(seqs[i]) + num_new for i in range(len(seqs))):
        if steps == 2:
            active.append(2)
        chunks, owners = [], []
        for i in active:
            if len(tokens[i]) == len(seqs[i]) + num_new:
                continue
            todo = tokens[i][computed[i] :]
            if computed[i] < len(seqs[i]) and i == 2:
                todo = todo[:5]
            last = computed[i] + len(todo) == len(tokens[i])
            chunks.append(SeqChunk(todo, computed[i], tables[i], needs_logits=last))
            owners.append(i)
        logits = runner.execute(chunks)
        rows = iter(logits)
        for i, chunk in zip(owners, chunks):
            computed[i] += len(chunk.token_ids)
            if chunk.needs_logits:
                tokens[i].append(int(next(rows).argmax()))
        steps += 1

    for p, out in zip(seqs, tokens):
        assert out[len(p) :] == hf_greedy(model, p, num_new)


def test_bf16_greedy_matches_hf_bf16():
    model = build(dtype=torch.bfloat16)
    runner = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE)
    assert runner.k_cache[0].dtype == torch.bfloat16
    pool = BlockPool()
    num_new = 5
    for p in prompts(9, 20):
        table = pool.table(len(p) + num_new)
        out, todo, start = [], list(p), 0
        for _ in range(num_new):
            logits = runner.execute([SeqChunk(todo, start, table, needs_logits=True)])
            assert logits.dtype == torch.float32
            start += len(todo)
            todo = [int(logits[0].argmax())]
            out.append(todo[0])
        assert out == hf_greedy(model, p, num_new)


def test_bf16_runner_over_fp32_model_casts_weights():
    model = build()
    runner = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, dtype=torch.bfloat16)
    p = prompts(12)[0]
    logits = runner.execute([SeqChunk(p, 0, BlockPool().table(12), needs_logits=True)])
    assert int(logits[0].argmax()) == int(hf_last_logits(model, p).argmax())
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32  # the HF model is untouched


def test_cache_sizing():
    config = LlamaConfig(**DIMS)
    per_token = ModelRunner.kv_bytes_per_token(config, torch.bfloat16)
    assert per_token == 2 * 2 * 2 * 16 * 2  # K+V, layers, kv heads, head_dim, bytes
    assert ModelRunner.num_blocks_for_budget(config, torch.bfloat16, 16, per_token * 16 * 10 + 5) == 10
    runner = ModelRunner(build(), 10, 16)
    assert runner.k_cache[0].shape == (10, 16, 2, 16)
    assert runner.max_context == 512 and runner.vocab_size == 512
    runner.warmup()


def test_programmer_errors_raise():
    runner = ModelRunner(build(), NUM_BLOCKS, BLOCK_SIZE)
    with pytest.raises(ValueError, match="block table"):
        runner.execute([SeqChunk([1, 2, 3, 4, 5], 0, [0], needs_logits=True)])
    with pytest.raises(ValueError, match="max_context"):
        runner.execute([SeqChunk([1], 512, list(range(NUM_BLOCKS)), needs_logits=True)])
    assert runner.execute([]).shape == (0, 512)


def test_cpu_fp32_uses_the_compiled_kernels():
    from switchyard.workers.executor.fused_ops import load_ops_kernel
    from switchyard.workers.executor.linear import load_gemm_kernel

    if load_gemm_kernel() is None or load_ops_kernel() is None:
        pytest.skip("the C kernels cannot be built here")
    runner = ModelRunner(build("llama-tied-bias"), NUM_BLOCKS, BLOCK_SIZE)
    assert runner.linear_kernel == "packed_gemm" and runner.ops.name == "cpu_fused"
    assert all(x.packed is not None for x in (runner.lm_head, runner.layers[0].qkv, runner.layers[-1].down))
    params = build("llama-tied-bias").named_parameters()
    weights = sum(p.numel() for name, p in params if "norm" not in name and "bias" not in name)
    assert runner.packed_weight_bytes == 4 * weights  # every matrix once (tied embedding = LM head); no padding here
    bf16 = ModelRunner(build(dtype=torch.bfloat16), NUM_BLOCKS, BLOCK_SIZE)
    assert bf16.linear_kernel == "torch" and bf16.packed_weight_bytes == 0 and bf16.ops.name == "torch"


@torch.no_grad()
def test_a_chunk_with_drafts_gives_the_logits_of_each_row_as_hf_does():
    model = build()
    runner = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE)
    (ids,) = prompts(12)
    table = BlockPool().table(len(ids))
    runner.execute([SeqChunk(ids[:8], 0, table, needs_logits=False)])
    logits = runner.execute([SeqChunk(ids[8:], 8, table, needs_logits=True, num_drafts=3)])  # 4 rows: 1 + 3 drafts
    torch.testing.assert_close(logits, model(torch.tensor([ids])).logits[0, 8:].float(), atol=1e-4, rtol=1e-4)


# A byte a weight and a scale a feature (int8; w8a8 also an int32 a feature per 32 inputs, csrc/int8_gemm.c), or
# half a byte a weight and two float16s per 32 (int4, its LM head as w8a8: a fifth of float32's bytes in this small
# model, whose head is a large share): the share of float32's bytes each must stay under; and the least cosine
# similarity of their logits to float32's (4 bits a weight of this random model: 0.990 measured).
QUANTIZED_BYTES = {"int8": 1 / 3.5, "w8a8": 1 / 3.3, "int4": 1 / 4.5}
SIMILARITY = {"int8": 0.999, "w8a8": 0.999, "int4": 0.98}


@torch.no_grad()
@pytest.mark.parametrize("quantization", ["int8", "w8a8", "int4"])
def test_quantized_weights_keep_the_logits_and_their_argmax_close_to_float32(quantization):
    from switchyard.workers.executor.linear import load_gemm_kernel, load_w4a8_kernel, load_w8a8_kernel

    if load_gemm_kernel() is None or load_w8a8_kernel() is None or load_w4a8_kernel() is None:
        pytest.skip("the C kernels cannot be built here")
    model = build("llama-tied-bias")
    full, int8 = (ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, quantization=q) for q in (None, quantization))
    assert int8.linear_kernel.startswith(f"packed_gemm {quantization}")
    assert int8.packed_weight_bytes < full.packed_weight_bytes * QUANTIZED_BYTES[quantization]
    (ids,) = prompts(40)
    pool = BlockPool()
    rows = [runner.execute([SeqChunk(ids, 0, pool.table(len(ids)), True, num_drafts=len(ids) - 1)])
            for runner in (full, int8)]
    similarity = torch.nn.functional.cosine_similarity(rows[0], rows[1], dim=-1)
    assert similarity.min() > SIMILARITY[quantization], similarity.min()
    assert (rows[0].argmax(-1) == rows[1].argmax(-1)).float().mean() >= 0.9
    with pytest.raises(ValueError, match="float32"):
        ModelRunner(build(dtype=torch.bfloat16), NUM_BLOCKS, BLOCK_SIZE, quantization=quantization)


def test_backend_choice_falls_back_to_sdpa():
    cpu = torch.device("cpu")
    # On CPU: the compiled kernels or SDPA itself; never flash-attn.
    assert make_attention(4, 2, 16, 16, cpu).name in ("cpu_paged", "sdpa")
    assert make_attention(4, 2, 16, 256, cpu).name in ("cpu_paged", "sdpa")
    assert isinstance(make_attention(4, 2, 16, 16, cpu, backend="sdpa"), SdpaAttention)
    with pytest.raises((ValueError, RuntimeError)):
        make_attention(4, 2, 16, 16, cpu, backend="flash")  # block size not a multiple of 256


def test_decodes_grouped_by_length_match_one_padded_call():
    """Many decodes of very different lengths: grouping them (less padding) must not change any logit."""
    model = build()
    lengths = [3, 30, 9, 21, 40, 5, 28, 17, 12, 33, 2, 25]
    ids = prompts(*lengths)
    logits = {}
    for max_groups in (1, 4):
        runner = ModelRunner(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, attention_backend="sdpa")
        runner.attention.max_decode_groups = max_groups
        pool = BlockPool()
        tables = [pool.table(n + 1) for n in lengths]
        runner.execute([SeqChunk(p[:-1], 0, t, False) for p, t in zip(ids, tables)])  # prefill all but one
        logits[max_groups] = runner.execute([SeqChunk(p[-1:], len(p) - 1, t, True) for p, t in zip(ids, tables)])
    torch.testing.assert_close(logits[4], logits[1], atol=1e-5, rtol=1e-5)
    for p, row in zip(ids, logits[4]):
        torch.testing.assert_close(row, hf_last_logits(model, p), atol=1e-4, rtol=1e-4)


def _greedy(runner: ModelRunner, ids: list[int], table: list[int], num_new: int) -> tuple[list[int], torch.Tensor]:
    """Prefill ``ids``, then decode ``num_new`` tokens greedily: the tokens and every step's logits."""
    logits = [runner.execute([SeqChunk(ids, 0, table, True)])[0]]
    tokens = list(ids)
    for _ in range(num_new):
        tokens.append(int(logits[-1].argmax()))
        logits.append(runner.execute([SeqChunk([tokens[-1]], len(tokens) - 1, table, True)])[0])
    return tokens[len(ids):], torch.stack(logits)


@torch.no_grad()
def test_int8_kv_cache_keeps_the_logits_close_to_float32_and_moves_its_blocks_whole():
    model = build("llama")
    full = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE)
    int8 = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, kv_cache_dtype="int8")
    assert int8.kv_dtype == torch.int8 and int8.block_shape == (2, 2, BLOCK_SIZE, 2, 16 + 4)
    (ids,) = prompts(30)
    table = BlockPool().table(len(ids) + 12)
    expected, full_logits = _greedy(full, ids, table, 12)
    got, int8_logits = _greedy(int8, ids, table, 12)
    assert torch.nn.functional.cosine_similarity(full_logits, int8_logits, dim=-1).min() > 0.999
    assert sum(a == b for a, b in zip(got, expected)) >= 10
    # What the KV tiers do: a prefix's blocks copied out and into another cache's blocks continue it the same.
    other = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, kv_cache_dtype="int8")
    moved = BlockPool(seed=7).table(len(ids) + 12)
    other.write_blocks(moved, int8.read_blocks(table))
    position = len(ids) + 11
    step = [SeqChunk([got[-1]], position, table, True)], [SeqChunk([got[-1]], position, moved, True)]
    assert torch.equal(int8.execute(step[0]), other.execute(step[1]))


def test_int8_kv_cache_sizing_and_what_it_refuses():
    config = LlamaConfig(**DIMS)
    per_token = ModelRunner.kv_bytes_per_token(config, torch.float32, "int8")
    assert per_token == 2 * 2 * 2 * (16 + 4)  # K+V, layers, kv heads, a row of int8 values and its float32 scale
    assert ModelRunner.num_blocks_for_budget(config, torch.float32, 16, per_token * 16 * 10 + 5, "int8") == 10
    with pytest.raises(ValueError, match="float32"):
        ModelRunner(build(dtype=torch.bfloat16), NUM_BLOCKS, BLOCK_SIZE, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="cpu_paged"):
        ModelRunner(build(), NUM_BLOCKS, BLOCK_SIZE, attention_backend="sdpa", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ModelRunner(build(), NUM_BLOCKS, BLOCK_SIZE, kv_cache_dtype="fp8")
