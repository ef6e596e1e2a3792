"""The attention kernels compile at the engine's start and never again while it serves.

Triton compiles a kernel once per specialisation of its arguments: integers equal to 1 or divisible by 16, and
pointers aligned to 16 bytes, each make a variant. Were any argument that changes from step to step specialised
(a split count, a block table's width, a metadata tensor's offset in its staging buffer), a GPU would compile
again in the middle of serving, 0.5-2 s with every stream stalled. Here the launches of a served workload are
keyed with Triton's own binder for sm_90 (bench/triton_aot.py) while they run interpreted on the CPU.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict

import pytest

from switchyard.shared.messages import GenerateRequest, SamplingParams
from tests.support.id_tokenizer import IdTokenizer
from tests.support.triton_devices import NOT_INTERPRETED, interpreted

pytest.importorskip("triton")
if not interpreted():
    pytest.skip(NOT_INTERPRETED, allow_module_level=True)


def keys_by_kernel(recorder, kernels) -> dict[str, set]:
    from bench.triton_aot import specialization

    keys = defaultdict(set)
    for launch in recorder.launches:
        keys[launch.kernel].add(specialization(kernels, launch))
    recorder.launches.clear()
    return keys


def test_a_served_workload_compiles_nothing_the_engine_start_did_not():
    from bench.triton_aot import KERNELS, LaunchRecorder
    from switchyard.workers.engine.engine import Engine, EngineConfig
    from tests.support.tiny_model import build_model

    engine = Engine(build_model().eval(), IdTokenizer(), EngineConfig(
        max_num_seqs=8, block_size=16, kv_cache_bytes=64 * 2**20, attention_backend="triton"))
    attention = engine.runner.attention
    kernels = attention.kernels
    recorder = attention.kernels = LaunchRecorder(kernels, run=True)
    # What a GPU worker does before it takes requests: warm up, then capture the decode graphs.
    engine.warmup()
    engine.runner.capture_cuda_graphs(8, 256)
    at_start = keys_by_kernel(recorder, kernels)
    assert sorted(at_start) == sorted(KERNELS)

    # Prompts of 2 to 90 tokens and outputs of 1 to 30, arriving in three waves: prefills alone, prefills beside
    # decodes, decodes at odd and even batch sizes, in graphs and eagerly, block tables 1 to 8 blocks wide.
    rng, now = random.Random(0), time.time()
    for wave in range(3):
        for i in range(4):
            ids = [rng.randrange(3, 500) for _ in range(rng.randint(2, 90))]
            engine.add_request(GenerateRequest(
                request_id=f"r{wave}-{i}", model="tiny", tier="pro", created_at=now, deadline_at=now + 600,
                prompt=" ".join(map(str, ids)),
                sampling=SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.0, ignore_eos=True)))
        for _ in range(rng.randint(3, 12)):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    serving = keys_by_kernel(recorder, kernels)

    assert sorted(serving) == sorted(KERNELS)
    for kernel in KERNELS:
        assert len(at_start[kernel]) == 1, f"{kernel}: {len(at_start[kernel])} variants at start"
        assert serving[kernel] <= at_start[kernel], f"{kernel} would compile again while serving"
