"""A continuation (``GenerateRequest.resume``) goes on exactly where the first worker stopped: the same tokens and
text as an uninterrupted run, greedy or seeded, no character sent twice or skipped, all tokens billed once."""

from __future__ import annotations

import msgspec
import pytest

from switchyard.shared.messages import Resume
from switchyard.workers.serving.prompts import RequestRejected
from tests.workers.test_engine import PROMPTS, RecordingEngine, Result, collect, run

CASES = {
    "greedy": dict(temperature=0, max_tokens=30, ignore_eos=True),
    "seeded": dict(temperature=1.0, top_p=0.9, seed=77, max_tokens=30, ignore_eos=True),
    "penalties": dict(temperature=0, frequency_penalty=1.5, presence_penalty=0.5, max_tokens=30, ignore_eos=True),
}


def _run_continuation(engine) -> Result:
    """Step until done; ``run``'s check that the deltas' tokens add up to the usage does not hold here (the
    usage counts the resumed tokens too)."""
    results: dict[str, Result] = {}
    while engine.has_unfinished_requests():
        step = engine.step()
        for delta in step:
            results.setdefault(delta.request_id, Result())
        collect(results, step)
    (result,) = results.values()
    assert [d.finish_reason is not None for d in result.deltas].count(True) == 1
    return result


def _uninterrupted(tiny, request):
    engine = RecordingEngine(*tiny)
    engine.add_request(request)
    return run(engine)[request.request_id], engine.token_ids[request.request_id]


@pytest.mark.parametrize("params", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("cut", [1, 7, 20])
def test_a_continuation_after_any_delta_ends_as_the_uninterrupted_run(tiny, make_request, params, cut):
    request = make_request(prompt=PROMPTS[1], request_id="r", **params)
    full, full_ids = _uninterrupted(tiny, request)
    # What the gateway relayed before the first worker died: the deltas up to the cut, their ids and text.
    sent = full.deltas[:cut]
    sent_ids = [t for d in sent for t in d.token_ids or ()]
    sent_text = "".join(d.text for d in sent)
    assert sent_ids == full_ids[:len(sent_ids)]  # every delta carries its tokens' ids, in order

    resumed = msgspec.structs.replace(request, resume=Resume(sent_ids, len(sent_text)))
    engine = RecordingEngine(*tiny)
    engine.add_request(resumed)
    rest = _run_continuation(engine)
    assert sent_text + rest.text == full.text
    assert sent_ids + engine.token_ids["r"] == full_ids
    assert rest.final.usage == full.final.usage  # the continuation bills every token, the first worker's too
    assert sum(d.num_tokens for d in rest.deltas) == len(full_ids) - len(sent_ids)


@pytest.mark.parametrize("offset", [-3, 2])
def test_a_client_behind_or_ahead_of_the_decoded_text_gets_each_character_once(tiny, make_request, offset):
    """The text the first worker held back (a possible stop string) is sent by the continuation; text the client
    has beyond what the ids decode to is not sent again."""
    request = make_request(prompt=PROMPTS[2], request_id="r", temperature=0, max_tokens=24, ignore_eos=True)
    full, _ = _uninterrupted(tiny, request)
    sent = full.deltas[:10]
    text_len = len("".join(d.text for d in sent)) + offset
    engine = RecordingEngine(*tiny)
    engine.add_request(msgspec.structs.replace(
        request, resume=Resume([t for d in sent for t in d.token_ids], text_len)))
    assert full.text[:text_len] + _run_continuation(engine).text == full.text


def test_what_cannot_be_resumed_is_refused_before_compute(tiny, make_request):
    engine = RecordingEngine(*tiny)
    with pytest.raises(RequestRejected) as exc:
        engine.add_request(msgspec.structs.replace(make_request(prompt="hi", n=2, max_tokens=5),
                                                   resume=Resume([5, 6], 2)))
    assert exc.value.error.param == "n"
    with pytest.raises(RequestRejected) as exc:
        engine.add_request(msgspec.structs.replace(make_request(prompt="hi", max_tokens=2),
                                                   resume=Resume([5, 6], 2)))
    assert exc.value.error.param == "resume"
    assert not engine.has_unfinished_requests()
