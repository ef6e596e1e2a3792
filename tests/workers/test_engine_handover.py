"""Disaggregated serving in our engine: a prefill worker's part of a request (``handover``) ends with its first
token, billed as one completion token and nothing after it; a decode worker sharing the host tier goes on from that
token with the prompt's blocks loaded, not computed; and the two parts together are exactly what one worker gives."""

from __future__ import annotations

from pathlib import Path

import msgspec

from switchyard.shared.messages import HANDOVER, Resume
from switchyard.workers.engine.config import EngineConfig
from tests.workers.test_engine import PROMPTS, RecordingEngine, run
from tests.workers.test_engine_resume import _run_continuation

PROMPT = PROMPTS[2]


def _config(tmp_path: Path) -> EngineConfig:
    return EngineConfig(max_num_seqs=2, kv_cache_bytes=1, max_model_len=128, kv_offload_gib=0.01,
                        kv_offload_host_dir=tmp_path / "host")


def test_a_prefill_part_ends_at_the_first_token_and_a_decode_worker_goes_on_from_the_shared_tier(
        tiny, make_request, tmp_path):
    request = make_request(prompt=PROMPT, request_id="r", temperature=0, max_tokens=20, ignore_eos=True)
    whole = RecordingEngine(*tiny, EngineConfig(max_num_seqs=2, kv_cache_bytes=1, max_model_len=128))
    whole.add_request(request)
    expected = run(whole)["r"]
    whole.shutdown()

    prefill = RecordingEngine(*tiny, _config(tmp_path))
    prefill.add_request(msgspec.structs.replace(request, handover=True))
    part = run(prefill)["r"]
    assert part.final.finish_reason == HANDOVER and part.final.is_last
    assert part.final.usage.completion_tokens == 1 and prefill.token_ids["r"] == expected.deltas[0].token_ids[:1]
    assert not prefill.has_unfinished_requests() and prefill.capacity().num_running == 0  # its seat is free
    num_prompt = part.final.usage.prompt_tokens

    decode = RecordingEngine(*tiny, _config(tmp_path))
    sent = "".join(d.text for d in part.deltas)
    decode.add_request(msgspec.structs.replace(request, resume=Resume(prefill.token_ids["r"], len(sent), 1, 1)))
    rest = _run_continuation(decode)
    assert sent + rest.text == expected.text
    assert prefill.token_ids["r"] + decode.token_ids["r"] == whole.token_ids["r"]
    assert decode.tiers.num_loaded_blocks == num_prompt // 16  # the prompt's full blocks, none computed again
    assert rest.final.finish_reason == "length"
    assert (rest.final.usage.prompt_tokens, rest.final.usage.completion_tokens) == (num_prompt, 20)
    # What the hand-over moved, for the usage record: the loaded blocks' bytes (the prefill's part loaded none).
    assert rest.final.usage.kv_loaded_bytes == num_prompt // 16 * decode.tiers.layout.block_bytes > 0
    assert part.final.usage.kv_loaded_bytes == 0
    prefill.shutdown()
    decode.shutdown()


def test_a_first_token_that_ends_the_request_ends_it_there(tiny, make_request, tmp_path):
    """Nothing to hand over when the request is done at its first token (max_tokens 1 here): it ends as it would
    on one worker, and that worker bills it."""
    prefill = RecordingEngine(*tiny, _config(tmp_path))
    request = make_request(prompt=PROMPT, request_id="r", temperature=0, max_tokens=1)
    prefill.add_request(msgspec.structs.replace(request, handover=True))
    assert run(prefill)["r"].final.finish_reason == "length"
    prefill.shutdown()
