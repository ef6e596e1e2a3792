"""The engine on a GPU: triton attention and CUDA graphs give HF's greedy tokens. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from switchyard.shared.messages import GenerateRequest, SamplingParams
from switchyard.workers.engine.engine import Engine, EngineConfig
from switchyard.workers.executor.cuda_graphs import batch_ladder
from tests.support.id_tokenizer import IdTokenizer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_batch_ladder_covers_every_size_up_to_the_largest():
    assert batch_ladder(1) == [1]
    assert batch_ladder(20) == [1, 2, 4, 8, 16, 20]
    assert batch_ladder(32) == [1, 2, 4, 8, 16, 24, 32]


def greedy_engine_tokens(model, prompts, num_tokens, cuda_graphs):
    engine = Engine(model, IdTokenizer(), EngineConfig(max_num_seqs=8, block_size=16, kv_cache_bytes=64 * 2**20,
                                                       cuda_graphs=cuda_graphs))
    assert (engine.runner.graphs is not None) == cuda_graphs
    seqs = []
    add = engine.scheduler.add_request
    engine.scheduler.add_request = lambda seq: (seqs.append(seq), add(seq))[1]
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=f"r{i}", model="tiny", prompt=" ".join(map(str, ids)),
                                           sampling=SamplingParams(max_tokens=num_tokens, temperature=0.0,
                                                                   ignore_eos=True)))
    while engine.has_unfinished_requests():
        engine.step()
    return [list(s.output_token_ids) for s in sorted(seqs, key=lambda s: s.seq_id)]


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphs_and_eager_and_hf_agree(dtype):
    from tests.support.tiny_model import build_model

    model = build_model().to("cuda", dtype).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 40, 3, 70)]
    graphs = greedy_engine_tokens(model, prompts, 24, cuda_graphs=True)
    eager = greedy_engine_tokens(model, prompts, 24, cuda_graphs=False)
    assert graphs == eager
    if dtype == torch.float32:
        for ids, got in zip(prompts, graphs):
            out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=24, do_sample=False,
                                 min_new_tokens=24)
            assert got == out[0, len(ids):].tolist()
