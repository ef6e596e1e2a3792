"""The simulated engine alone (a test double for load tests): the ServingEngine contract a worker relies on."""

from __future__ import annotations

import time

import pytest

from switchyard.shared.messages import ErrorInfo, GenerateRequest, Resume, SamplingParams
from switchyard.workers.serving.interface import RequestRejected
from switchyard.workers.simulated_engine import SimulatedEngine


def request(rid: str, prompt: str = "hello there", resume: Resume | None = None, **sampling) -> GenerateRequest:
    now = time.time()
    return GenerateRequest(rid, "sim", "pro", SamplingParams(**sampling), created_at=now, deadline_at=now + 60,
                           prompt=prompt, resume=resume)


def run(engine: SimulatedEngine, *requests: GenerateRequest) -> dict[str, list]:
    deltas: dict[str, list] = {}
    for r in requests:
        engine.add_request(r, engine.prepare(r))
    while engine.has_unfinished_requests():
        for d in engine.step():
            deltas.setdefault(d.request_id, []).append(d)
    return deltas


def text(deltas: list, index: int = 0) -> str:
    return "".join(d.text for d in deltas if d.index == index)


def test_tokens_come_at_the_set_rate_and_the_last_delta_carries_the_usage():
    engine = SimulatedEngine(max_num_seqs=8, tokens_per_s=100)
    started = time.monotonic()
    (deltas,) = run(engine, request("a", max_tokens=20)).values()
    assert time.monotonic() - started >= 19 / 100  # the 20th token is due 0.19 s after the first
    assert sum(d.num_tokens for d in deltas) == 20 and len(text(deltas).split()) == 20
    assert [d.is_last for d in deltas].count(True) == 1 and deltas[-1].is_last
    assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 20
    assert engine.capacity().num_free_seats == 8


def test_tokens_can_come_several_to_a_delta_at_the_same_rate_with_the_same_words():
    grouped = SimulatedEngine(max_num_seqs=8, tokens_per_s=200, tokens_per_delta=4)
    started = time.monotonic()
    (deltas,) = run(grouped, request("a", max_tokens=10)).values()
    assert time.monotonic() - started >= 9 / 200  # the 10th token is due as without groups
    # The first alone, then groups of 4 (1, 4, 4, 1 on time; a late step only makes a group larger).
    assert deltas[0].num_tokens == 1 and all(d.num_tokens >= 4 for d in deltas[1:-1]) and len(deltas) <= 4
    (single,) = run(SimulatedEngine(max_num_seqs=8, tokens_per_s=200), request("a", max_tokens=10)).values()
    assert text(deltas) == text(single)


def test_choices_differ_and_a_request_without_max_tokens_stops_at_the_reply_length():
    engine = SimulatedEngine(max_num_seqs=8, tokens_per_s=5000, output_tokens=7)
    (deltas,) = run(engine, request("a", n=3)).values()
    finals = [d for d in deltas if d.finish_reason]
    assert sorted(d.index for d in finals) == [0, 1, 2] and {d.finish_reason for d in finals} == {"stop"}
    assert len({text(deltas, i) for i in range(3)}) == 3
    assert finals[-1].usage.completion_tokens == 21 and finals[-1].is_last and not finals[0].is_last


def test_a_continuation_sends_exactly_what_the_client_lacks():
    engine = SimulatedEngine(max_num_seqs=8, tokens_per_s=5000)
    (whole,) = run(engine, request("a", max_tokens=12)).values()
    ids = [t for d in whole for t in d.token_ids or ()]
    full = text(whole)
    head = full[:len(full) // 3]  # the client got part of the fourth-or-so token's text, the worker died
    (rest,) = run(engine, request("a2", max_tokens=12, resume=Resume(ids[:5], len(head)))).values()
    assert head + text(rest) == full
    assert rest[-1].usage.completion_tokens == 12


def test_abort_ends_every_choice_with_its_reason_and_frees_the_seats():
    engine = SimulatedEngine(max_num_seqs=4, tokens_per_s=10)
    r = request("a", max_tokens=1000, n=2)
    engine.add_request(r, engine.prepare(r))
    assert engine.capacity().num_free_seats == 2
    assert engine.abort_request("a", ErrorInfo("shutting down", code="worker_shutdown", status=503))
    finals = engine.step()
    assert [d.finish_reason for d in finals] == ["error", "error"] and finals[-1].is_last
    assert engine.capacity().num_free_seats == 4 and not engine.has_unfinished_requests()
    assert not engine.abort_request("a")


@pytest.mark.parametrize("asked, param", [({"logprobs": True}, "logprobs"), ({"echo": True}, "echo"),
                                          ({"n": 17}, "n"), ({"max_tokens": 10**6}, "prompt")])
def test_what_it_cannot_imitate_is_refused_by_name(asked, param):
    with pytest.raises(RequestRejected) as refused:
        SimulatedEngine(max_num_seqs=4, tokens_per_s=10).prepare(request("a", **asked))
    assert refused.value.error.param == param


def test_with_a_step_cadence_every_sequences_later_tokens_go_in_the_same_steps_and_say_the_same():
    stepped = SimulatedEngine(max_num_seqs=8, tokens_per_s=50, step_s=0.05)
    steps: list[list] = []
    for i in range(3):  # started apart, so their tokens fall due at different times
        r = request(f"r{i}", prompt=f"prompt {i}", max_tokens=8)
        stepped.add_request(r, stepped.prepare(r))
        steps.append(stepped.step())
        time.sleep(0.013)
    while stepped.has_unfinished_requests():
        steps.append(stepped.step())
    later = [step for step in steps[3:] if step]
    assert all(any(d.request_id == f"r{i}" for d in steps[i]) for i in range(3))  # each first token at once
    # Then in lockstep: all three in every step but where one's tokens began or ended a step before the others'.
    assert all(len({d.request_id for d in step}) == 3 for step in later[1:-1])
    assert len(later) <= 5  # 7 tokens each at 50/s: about 0.14 s, so three to five steps of 0.05 s
    alone = run(SimulatedEngine(max_num_seqs=8, tokens_per_s=50),
                *(request(f"r{i}", prompt=f"prompt {i}", max_tokens=8) for i in range(3)))
    for i in range(3):
        got = [d for step in steps for d in step if d.request_id == f"r{i}"]
        assert text(got) == text(alone[f"r{i}"]) and sum(d.num_tokens for d in got) == 8


def test_a_long_request_pauses_for_a_newcomer_by_the_engines_rule_and_resumes_with_the_same_words():
    import msgspec

    engine = SimulatedEngine(max_num_seqs=1, tokens_per_s=400)
    engine.set_pause_rules({"pro": 5})
    long = msgspec.structs.replace(request("a", prompt="a long one", max_tokens=40), tenant_id="busy")
    engine.add_request(long, engine.prepare(long))
    got: list = []
    while sum(d.num_tokens for d in got) < 6:
        got += engine.step()
    light = msgspec.structs.replace(request("b", prompt="a short one", max_tokens=3), tenant_id="light")
    engine.add_request(light, engine.prepare(light))
    assert engine.capacity().num_waiting == 1 and engine.capacity().num_free_seats == 0  # paused, its place kept
    assert engine.stats().num_pauses == 1 and engine.stats().waiting == {"pro": 1}
    order: list[str] = []
    while engine.has_unfinished_requests():
        for d in engine.step():
            got.append(d)
            order.append(d.request_id)
    last_b = max(i for i, rid in enumerate(order) if rid == "b")
    assert order[0] == "b" and all(rid == "b" for rid in order[:last_b + 1])  # nothing from the paused one meanwhile
    paused_text = text([d for d in got if d.request_id == "a"])
    alone = run(SimulatedEngine(max_num_seqs=1, tokens_per_s=400), request("a", prompt="a long one", max_tokens=40))
    assert paused_text == text(alone["a"]) and [d for d in got if d.request_id == "a"][-1].usage.completion_tokens == 40
    assert engine.capacity().num_waiting == 0 and engine.capacity().num_free_seats == 1


def test_without_a_rule_or_a_tenant_holding_fewer_seats_nothing_is_paused():
    import msgspec

    engine = SimulatedEngine(max_num_seqs=1, tokens_per_s=400)
    first = msgspec.structs.replace(request("a", max_tokens=40), tenant_id="busy")
    engine.add_request(first, engine.prepare(first))
    for _ in range(20):
        engine.step()
    second = msgspec.structs.replace(request("b", max_tokens=3), tenant_id="light")
    engine.add_request(second, engine.prepare(second))  # no rule: it runs beyond the seats, as before
    assert engine.stats().num_pauses == 0 and engine.capacity().num_running == 2
    engine.set_pause_rules({"pro": 5})
    third = msgspec.structs.replace(request("c", max_tokens=3), tenant_id="busy")  # holds one already: no pause
    engine.add_request(third, engine.prepare(third))
    assert engine.stats().num_pauses == 0


def test_a_newcomer_the_seat_rule_seats_runs_a_seat_over_rather_than_pausing_anyone():
    import msgspec

    engine = SimulatedEngine(max_num_seqs=2, tokens_per_s=400)
    engine.set_pause_rules({"pro": 1})
    for rid in ("a", "b"):  # one tenant holds both seats: two apart from one holding none
        r = msgspec.structs.replace(request(rid, max_tokens=40), tenant_id="busy")
        engine.add_request(r, engine.prepare(r))
    for _ in range(20):
        engine.step()
    newcomer = msgspec.structs.replace(request("c", max_tokens=3), tenant_id="light")
    engine.add_request(newcomer, engine.prepare(newcomer))
    assert engine.stats().num_pauses == 0 and engine.capacity().num_running == 3  # as without pausing
