"""The worker's capacity alone: what it may pull from which tier, for which tenant, and the batch limit per step,
from an engine's capacity and the requests it holds (no NATS, no model)."""

from __future__ import annotations

from switchyard.scheduler.background import BackgroundPolicy
from switchyard.shared import subjects
from switchyard.shared.config import WorkerConfig
from switchyard.shared.messages import GenerateRequest, SamplingParams
from switchyard.workers.service.capacity import Capacity, allowance, background_policy
from switchyard.workers.service.held import HeldRequests, Tracked
from switchyard.workers.serving.interface import EngineCapacity

ALL_TIERS = {"enterprise", "pro", "free", "batch"}


def tracked(i: int, tier: str, tenant: str = "t") -> Tracked:
    return Tracked(GenerateRequest(f"r{i}", "tiny", tier, SamplingParams(), created_at=0.0, deadline_at=1e18,
                                   prompt="x", tenant_id=tenant), received_at=0.0)


def holding(active: list[Tracked], pending: list[Tracked] = (), num_admitting: int = 0) -> HeldRequests:
    held = HeldRequests()
    held.active = {t.request.request_id: t for t in active}
    held.pending = [(t, None) for t in pending]
    held.num_admitting = num_admitting
    return held


def engine(free: int, running: int, seats: int = 8, waiting_new: int = 0) -> EngineCapacity:
    return EngineCapacity(seats, free, running, waiting_new, waiting_new, 0.1)


def no_batch_limit() -> BackgroundPolicy:
    return BackgroundPolicy(seats_when_busy=None, busy_window_s=10.0)


def test_with_free_seats_every_tier_may_be_pulled():
    allowed = allowance(engine(free=3, running=5), holding([tracked(i, "pro") for i in range(5)]), no_batch_limit())
    assert allowed.num_free_seats == 3 and set(allowed.pull) == ALL_TIERS
    assert all(not out for out in allowed.pull.values()) and allowed.background_limit is None


def test_requests_on_their_way_in_take_free_seats_too():
    held = holding([tracked(0, "pro")], pending=[tracked(1, "pro"), tracked(2, "pro")], num_admitting=1)
    assert allowance(engine(free=3, running=1), held, no_batch_limit()).num_free_seats == 0


def test_with_every_seat_taken_only_seat_takers_are_pulled():
    running = [tracked(i, "free", "heavy") for i in range(6)] + [tracked(6, "free", "light"), tracked(7, "pro")]
    allowed = allowance(engine(free=0, running=8), holding(running), no_batch_limit())
    # More important than the least important running tier: anyone; in that tier, not the tenants that hold
    # enough already (light holds 1, heavy 6: light may still take one of heavy's).
    heavy = subjects.tenant_token("heavy")
    assert allowed.pull == {"enterprise": frozenset(), "pro": frozenset(), "free": frozenset({heavy})}


def test_tenants_sharing_seats_evenly_take_no_more_but_a_newcomer_may():
    a, b = subjects.tenant_token("a"), subjects.tenant_token("b")
    running = [tracked(i, "pro", "a") for i in range(4)] + [tracked(i + 4, "pro", "b") for i in range(3)]
    allowed = allowance(engine(free=0, running=7, seats=7), holding(running), no_batch_limit())
    assert allowed.pull == {"enterprise": frozenset(), "pro": frozenset({a, b})}
    # Nobody holds two seats: no tenant would get one, so the tier is not pulled from at all.
    one_each = allowance(engine(free=0, running=2, seats=2), holding([tracked(0, "pro", "a"), tracked(1, "pro", "b")]),
                         no_batch_limit())
    assert one_each.pull == {"enterprise": frozenset()}


def test_seat_takers_are_bounded_by_the_headroom():
    running = [tracked(i, "free") for i in range(16)]
    # 16 seats: 2 may wait beyond them; one is in the engine already and one is on its way in.
    held = holding(running, pending=[tracked(99, "pro")])
    assert allowance(engine(free=0, running=16, seats=16, waiting_new=1), held, no_batch_limit()).pull == {}
    assert allowance(engine(free=0, running=16, seats=16), held, no_batch_limit()).pull


def test_a_tiers_own_seat_takers_are_bounded_by_the_seats_its_holders_would_give_up():
    # 64 seats: "heavy" holds two, 62 tenants one each. One seat would change hands (heavy's second), so one
    # request of a tenant holding none may be pulled; a second would only wait in the engine, ahead of the next
    # tenant to come, for a seat to end.
    running = [tracked(0, "pro", "heavy"), tracked(1, "pro", "heavy")] + [tracked(i, "pro", f"t{i}")
                                                                          for i in range(2, 64)]
    assert "pro" in allowance(engine(free=0, running=64, seats=64), holding(running), no_batch_limit()).pull
    one_on_its_way = holding(running, pending=[tracked(99, "pro", "newcomer")])
    assert allowance(engine(free=0, running=64, seats=64), one_on_its_way, no_batch_limit()).pull == {
        "enterprise": frozenset()}


def test_batch_yields_to_interactive_work():
    policy = BackgroundPolicy(seats_when_busy=2, busy_window_s=10.0)
    batch = [tracked(i, "batch") for i in range(2)]
    allowed = allowance(engine(free=4, running=3), holding(batch + [tracked(9, "pro")]), policy)
    assert "batch" not in allowed.pull and allowed.background_limit == 2
    idle = allowance(engine(free=4, running=2), holding(batch), BackgroundPolicy(2, busy_window_s=0.0))
    assert "batch" in idle.pull and idle.background_limit is None


def test_the_default_batch_policy_depends_on_the_device():
    assert background_policy(WorkerConfig(), "cpu").seats_when_busy == 2
    assert background_policy(WorkerConfig(), "cuda").seats_when_busy is None
    assert background_policy(WorkerConfig(batch_seqs_when_busy=0), "cpu").seats_when_busy is None
    assert background_policy(WorkerConfig(batch_seqs_when_busy=5), "cuda").seats_when_busy == 5


async def test_the_intake_is_woken_when_seats_or_holders_change_not_for_every_token():
    """A step that only generated tokens changes nothing the intake decides on: waking it for each such step (hundreds
    a second with every seat taken) cost the worker more CPU than its pulls."""
    capacity = Capacity(engine(free=0, running=8), holding([tracked(i, "pro") for i in range(8)]), no_batch_limit())
    capacity.update(EngineCapacity(8, 0, 8, 0, 0, 0.7), moved=False)  # more KV used, the same seats
    assert not capacity.changed.is_set()
    capacity.update(engine(free=1, running=7), moved=False)  # a seat freed
    assert capacity.changed.is_set()
    capacity.changed.clear()
    capacity.update(engine(free=1, running=7), moved=True)  # a request admitted as another finished
    assert capacity.changed.is_set()
    capacity.changed.clear()
    capacity.update(None, moved=False)  # the step failed: nothing known, so look again
    assert capacity.changed.is_set()
    assert capacity.background_limit() == capacity.allowance().background_limit


def test_a_steps_batch_limit_is_the_allowances_without_counting_by_tenant():
    limited = BackgroundPolicy(seats_when_busy=2, busy_window_s=0.0)
    mixed = Capacity(engine(free=4, running=4), holding([tracked(0, "batch"), tracked(1, "pro")]), limited)
    batch_only = Capacity(engine(free=4, running=4), holding([tracked(0, "batch"), tracked(1, "batch")]), limited)
    assert mixed.background_limit() == mixed.allowance().background_limit == 2
    assert batch_only.background_limit() is None and batch_only.allowance().background_limit is None


def test_a_tenant_preparing_only_cheap_requests_is_pulled_for_until_it_has_many():
    """One tenant's burst of small prompts is not taken one request per pull and prepare; a tenant with a request
    that may be slow to prepare (by its size: a grammar, tools, many or long messages) waits for it, as does one
    with ``CHEAP_PREPARING`` in preparation."""
    from switchyard.shared.messages import ChatMessage, ResponseFormat
    from switchyard.workers.service.capacity import CHEAP_PREPARING
    from switchyard.workers.service.prepare_cost import is_cheap_to_prepare

    def preparing(requests: list[Tracked]) -> frozenset[str]:
        held = holding([])
        held.preparing = {t.request.request_id: t for t in requests}
        return allowance(engine(free=64, running=0, seats=64), held, no_batch_limit()).pull["pro"]

    cheap = [tracked(i, "pro", "burst") for i in range(CHEAP_PREPARING - 1)]
    assert all(is_cheap_to_prepare(t.request) for t in cheap)
    assert preparing(cheap) == frozenset()
    assert preparing([*cheap, tracked(99, "pro", "burst")]) == {subjects.tenant_token("burst")}
    schema = tracked(100, "pro", "schema")
    schema.request.response_format = ResponseFormat(type="json_object")
    many = tracked(101, "pro", "many")
    many.request.messages = [ChatMessage("user", "hi")] * 1000
    long = tracked(102, "pro", "long")
    long.request.prompt = "x" * 100_000
    assert not any(is_cheap_to_prepare(t.request) for t in (schema, many, long))
    assert preparing([schema, many, long, *cheap]) == {subjects.tenant_token(t) for t in ("schema", "many", "long")}


def _one_seat_each(n: int, tier: str = "pro", tokens: int = 0) -> list[Tracked]:
    out = [tracked(i, tier, f"t{i}") for i in range(n)]
    for t in out:
        t.completion_tokens = tokens
    return out


def test_with_every_seat_held_by_one_tenant_each_a_pause_pull_is_offered_past_the_quantum():
    running = _one_seat_each(8, tokens=300)
    allowed = allowance(engine(free=0, running=8), holding(running), no_batch_limit(), {"pro": 256})
    tokens = frozenset(subjects.tenant_token(f"t{i}") for i in range(8))
    # A tenant holding none of the tier's seats may be pulled, to pause one of theirs (the intake checks the share).
    assert allowed.pull["pro"] == tokens and allowed.pause_over == {"pro": tokens}
    # Off, or nobody past the quantum: the tier waits for a seat to free, as before.
    assert "pro" not in allowance(engine(free=0, running=8), holding(running), no_batch_limit()).pull
    young = allowance(engine(free=0, running=8), holding(_one_seat_each(8, tokens=100)), no_batch_limit(), {"pro": 256})
    assert "pro" not in young.pull and not young.pause_over


def test_pause_pulls_go_one_at_a_time_and_stop_while_many_are_paused():
    running = _one_seat_each(16, tokens=300)
    on_its_way = holding(running, pending=[tracked(99, "pro", "light")])
    assert not allowance(engine(free=0, running=16, seats=16), on_its_way, no_batch_limit(), {"pro": 8}).pause_over
    # 16 seats: at most 2 waiting inside the engine (paused ones included) before pause pulls stop.
    two_paused = EngineCapacity(16, 0, 16, 2, 0, 0.9)
    assert not allowance(two_paused, holding(running), no_batch_limit(), {"pro": 8}).pause_over
    one_paused = EngineCapacity(16, 0, 16, 1, 0, 0.9)
    assert allowance(one_paused, holding(running), no_batch_limit(), {"pro": 8}).pause_over
    # A request running a seat over (the simulated engine's seat taker) is not one on its way in.
    one_over = EngineCapacity(16, 0, 17, 0, 0, 0.9)
    assert allowance(one_over, holding(running), no_batch_limit(), {"pro": 8}).pause_over


def test_an_engine_that_does_not_pause_gets_no_quanta_and_no_pause_pulls():
    held = holding(_one_seat_each(8, tokens=300))
    plain = Capacity(engine(free=0, running=8), held, no_batch_limit())
    plain.set_pause_after({"pro": 64})
    assert plain.take_pause_rules() is None and not plain.allowance().pause_over
    pausing = Capacity(engine(free=0, running=8), held, no_batch_limit(), pausing=True)
    pausing.set_pause_after({"pro": 64, "enterprise": 0})
    assert pausing.changed.is_set() and pausing.take_pause_rules() == {"pro": 64}
    assert pausing.take_pause_rules() is None  # once per change
    assert pausing.allowance().pause_over
