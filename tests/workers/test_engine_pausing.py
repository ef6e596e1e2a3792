"""Pausing on our engine (scheduler/pausing.py through the worker's interface): a long generation paused for a
newcomer of another tenant resumes with exactly the tokens it would have produced unpaused, its KV kept."""

from __future__ import annotations

from collections import defaultdict

import msgspec

from switchyard.workers.engine.engine import EngineConfig
from tests.workers.test_engine import RecordingEngine, Result, collect, hf_greedy, run


def test_a_long_greedy_generation_paused_for_a_newcomer_resumes_with_the_same_tokens(tiny, make_request):
    model, tokenizer = tiny
    engine = RecordingEngine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=128))
    engine.set_pause_rules({"pro": 4, "enterprise": 0})
    prompt = "The quick brown fox jumps over the lazy dog."
    long = msgspec.structs.replace(make_request(prompt=prompt, temperature=0, max_tokens=24, ignore_eos=True),
                                   tenant_id="busy")
    light = msgspec.structs.replace(make_request(prompt="Hi", temperature=0, max_tokens=3, ignore_eos=True),
                                    tenant_id="light")
    engine.add_request(long)
    results: dict[str, Result] = defaultdict(Result)
    for _ in range(6):  # 6 tokens (the prompt's step samples the first): past the quantum of 4
        collect(results, engine.step())
    blocks_free = engine.num_free_blocks
    engine.add_request(light)
    collect(results, engine.step())
    # Its first token at once (the long one paused), sent once it spells some text.
    assert list(engine.token_ids) == [long.request_id, light.request_id]
    assert len(engine.token_ids[light.request_id]) == 1 and len(engine.token_ids[long.request_id]) == 6
    assert engine.stats().num_pauses == 1 and engine.capacity().num_waiting == 1
    assert engine.capacity().num_waiting_new == 0 and engine.capacity().num_free_seats == 0  # it keeps its place
    assert engine.num_free_blocks < blocks_free  # the newcomer's blocks came on top: the paused one kept its KV
    gap = 0
    while light.request_id not in {rid for rid, r in results.items() if r.deltas and r.deltas[-1].finish_reason}:
        collect(results, step := engine.step())
        gap += 1
        assert long.request_id not in {d.request_id for d in step}  # paused while the newcomer runs
    results = run(engine, results)
    paused = results[long.request_id]
    assert all(d.error is None for d in paused.deltas) and paused.final.finish_reason == "length"
    assert paused.final.usage.completion_tokens == 24 and gap >= 2
    assert engine.token_ids[long.request_id] == hf_greedy(model, tokenizer, prompt, 24)  # not a token lost or redone
    assert engine.token_ids[light.request_id] == hf_greedy(model, tokenizer, "Hi", 3)
    assert engine.stats().num_preemptions == 0 and engine.num_free_blocks == engine.num_blocks

    # The same without pausing: the newcomer waits for the long one to end.
    plain = RecordingEngine(model, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=128))
    plain.add_request(msgspec.structs.replace(long, request_id="again"))
    unpaused: dict[str, Result] = defaultdict(Result)
    for _ in range(6):
        collect(unpaused, plain.step())
    plain.add_request(msgspec.structs.replace(light, request_id="waits"))
    collect(unpaused, plain.step())
    assert len(plain.token_ids["again"]) == 7 and "waits" not in plain.token_ids
    assert run(plain, unpaused)["again"].text == paused.text
