"""The pause rule alone (scheduler/pausing.py), and the scheduler applying it: a long generation gives its seat to
a waiting tenant holding fewer, keeps its KV and tokens, and resumes first into the next free seat."""

from __future__ import annotations

import pytest

from switchyard.scheduler import RequestStatus, Scheduler, SchedulerConfig, Sequence
from switchyard.scheduler.pausing import MAX_PAUSES, PauseRule, ahead_in_share, pause_victim
from switchyard.scheduler.seats import TenantSeats

from .conftest import toy_next_token


def _victim(running: list[tuple[str, str, int, int]], tenant: str, rule: PauseRule) -> str | None:
    """``running``: (id, tenant, tokens since start, pauses)."""
    seats = TenantSeats(t for _, t, _, _ in running)
    found = pause_victim(running, seats, tenant, rule, lambda r: r[1], lambda r: (r[2], r[3]))
    return None if found is None else found[0]


def test_the_rule_is_off_at_zero_and_refuses_bad_values():
    assert not PauseRule().is_on and not PauseRule(0).is_pausable(10_000, 0)
    assert PauseRule(64).is_on and PauseRule(64).max_pauses == MAX_PAUSES
    with pytest.raises(ValueError, match="after_tokens"):
        PauseRule(-1)
    with pytest.raises(ValueError, match="max_pauses"):
        PauseRule(8, -1)


def test_a_request_is_pausable_past_its_quantum_and_only_a_few_times():
    rule = PauseRule(after_tokens=100, max_pauses=2)
    assert not rule.is_pausable(99, 0) and rule.is_pausable(100, 0) and rule.is_pausable(500, 1)
    assert not rule.is_pausable(500, 2)


def test_the_victim_is_a_pausable_request_of_a_tenant_holding_more_seats():
    rule = PauseRule(after_tokens=10)
    running = [("a1", "a", 50, 0), ("b1", "b", 5, 0)]
    assert _victim(running, "new", rule) == "a1"  # b's is under its quantum
    assert _victim(running, "b", rule) is None  # one seat against one: equals do not pause each other
    assert _victim([("a1", "a", 50, MAX_PAUSES)], "new", rule) is None  # paused enough
    assert _victim(running, "new", PauseRule()) is None  # off


def test_the_tenant_holding_most_yields_first_then_the_longest_running():
    rule = PauseRule(after_tokens=10)
    running = [("a1", "a", 900, 0), ("h1", "h", 20, 0), ("h2", "h", 40, 0), ("h3", "h", 30, 0)]
    assert _victim(running, "new", rule) == "h2"
    assert _victim(running, "a", rule) == "h2"  # a holds 1, h 3
    # Of equal holders and progress, the last in the running order (the newest).
    assert _victim([("x1", "x", 20, 0), ("y1", "y", 20, 0)], "new", rule) == "y1"


def test_only_a_tenant_ahead_of_every_pausable_holder_in_fair_share_pauses():
    assert ahead_in_share(16.0, [400.0, 900.0])
    assert not ahead_in_share(800.0, [400.0, 900.0])  # the holder at 400 has had less than it would
    assert not ahead_in_share(0.0, [])  # nothing pausable


# --- in the scheduler ---------------------------------------------------------------------------------------

def _scheduler(seats: int, pause_after: int, num_blocks: int = 256) -> Scheduler:
    sched = Scheduler(SchedulerConfig(max_num_seqs=seats, max_num_batched_tokens=256, block_size=4,
                                      num_blocks=num_blocks, max_model_len=min(256, 4 * num_blocks)))
    sched.set_pause_rules({1: PauseRule(pause_after)})
    return sched


def _step(sched: Scheduler) -> set[str]:
    out = sched.schedule()
    sched.update_from_output(out, {e.seq.seq_id: toy_next_token(e.seq) for e in out.scheduled if e.needs_sample})
    return {e.seq.seq_id for e in out.scheduled}


def _seq(seq_id: str, tenant: str, max_tokens: int, arrival: float, priority: int = 1) -> Sequence:
    return Sequence(seq_id, [sum(map(ord, seq_id)) + i for i in range(6)], max_tokens=max_tokens, priority=priority,
                    arrival=arrival, tenant=tenant)


def _reference(seq: Sequence, num: int) -> list[int]:
    ref = Sequence("ref", list(seq.prompt_token_ids), max_tokens=num)
    for _ in range(num):
        ref.append_token(toy_next_token(ref))
    return ref.output_token_ids


def test_a_long_generation_pauses_for_a_new_tenant_keeps_its_kv_and_resumes_with_the_same_tokens():
    sched = _scheduler(seats=2, pause_after=5)
    long_a, long_b = _seq("a", "ta", 40, 0.0), _seq("b", "tb", 40, 1.0)
    sched.add_request(long_a)
    sched.add_request(long_b)
    for _ in range(3):
        _step(sched)
    light = _seq("l", "light", 3, 5.0)
    sched.add_request(light)
    assert "l" not in _step(sched)  # 3 tokens each: under the quantum, the light one waits
    for _ in range(3):
        _step(sched)
    blocks = sched.kv_cache.get_block_table("b")
    ran = _step(sched)  # both past 5 tokens: the newest of equals (b) gives its seat
    assert "l" in ran and "b" not in ran
    assert long_b.status == RequestStatus.PAUSED and long_b.num_pauses == 1 and sched.num_pauses == 1
    assert sched.kv_cache.get_block_table("b") == blocks and long_b.num_computed_tokens > 0  # KV kept
    assert sched.num_preemptions == 0 and sched.num_free_slots == 0  # holds its place
    while light.status == RequestStatus.RUNNING:
        assert "b" not in _step(sched)
    assert "b" in _step(sched)  # the seat the light one freed: b resumes first, computing nothing again
    assert long_b.status == RequestStatus.RUNNING and long_b.num_tokens_since_start <= 1
    while sched.has_unfinished_requests():
        _step(sched)
    assert long_b.output_token_ids == _reference(long_b, 40)  # not a token lost, repeated or changed
    assert long_a.output_token_ids == _reference(long_a, 40)


def test_a_paused_request_resumes_before_a_request_that_came_after_it():
    sched = _scheduler(seats=1, pause_after=2)
    long = _seq("a", "ta", 30, 0.0)
    sched.add_request(long)
    for _ in range(4):
        _step(sched)
    sched.add_request(_seq("l", "light", 2, 5.0))
    assert _step(sched) == {"l"} and long.status == RequestStatus.PAUSED
    sched.add_request(_seq("later", "other", 2, 6.0))
    ran = set()
    while "a" not in ran:
        ran = _step(sched)
        assert "later" not in ran  # a seat freed goes to the paused one; the newcomer may not pause it back yet


def test_no_request_is_paused_more_than_max_pauses_times():
    sched = _scheduler(seats=1, pause_after=1)
    long = _seq("a", "ta", 200, 0.0)
    sched.add_request(long)
    _step(sched)
    for i in range(MAX_PAUSES + 2):
        for _ in range(3):
            _step(sched)
        sched.add_request(_seq(f"l{i}", f"light{i}", 1, 10.0 + i))
        for _ in range(4):
            _step(sched)
    assert long.num_pauses == MAX_PAUSES
    while sched.has_unfinished_requests():
        _step(sched)
    assert long.output_token_ids == _reference(long, 200)


def test_a_paused_request_or_one_holding_as_many_seats_does_not_pause_another():
    sched = _scheduler(seats=2, pause_after=2)
    for s in (_seq("a", "ta", 50, 0.0), _seq("b", "tb", 50, 1.0)):
        sched.add_request(s)
    for _ in range(4):
        _step(sched)
    sched.add_request(_seq("a2", "ta", 5, 2.0))  # ta holds one already: one against one, no pause
    assert "a2" not in _step(sched)
    assert sched.num_pauses == 0


def test_pausing_is_per_priority_and_off_unless_set():
    sched = _scheduler(seats=1, pause_after=2)
    other = _seq("x", "tx", 30, 0.0, priority=2)  # priority 2 has no rule
    sched.add_request(other)
    for _ in range(5):
        _step(sched)
    sched.add_request(_seq("y", "ty", 2, 1.0, priority=2))
    assert _step(sched) == {"x"} and sched.num_pauses == 0


def test_with_blocks_short_a_paused_request_drops_its_kv_and_recomputes_it_later():
    # 12 blocks of 4 tokens: two sequences of 6 + up to 18 tokens fill them.
    sched = _scheduler(seats=2, pause_after=3, num_blocks=12)
    long_a, long_b = _seq("a", "ta", 18, 0.0), _seq("b", "tb", 18, 1.0)
    sched.add_request(long_a)
    sched.add_request(long_b)
    for _ in range(5):
        _step(sched)
    big = Sequence("l", [7] * 28, max_tokens=2, priority=1, arrival=3.0, tenant="light")
    sched.add_request(big)
    _step(sched)
    assert long_b.num_pauses == 1 and long_b.num_preemptions == 1 and long_b.status == RequestStatus.PREEMPTED
    assert long_a.status == RequestStatus.RUNNING  # the paused one's KV went, not a running one's
    while sched.has_unfinished_requests():
        _step(sched)
    assert long_b.output_token_ids == _reference(long_b, 18) and long_a.output_token_ids == _reference(long_a, 18)
    assert sched.kv_cache.num_free_blocks == 12
