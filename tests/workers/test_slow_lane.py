"""The intake's slow lane (workers/service/intake.py): a tenant whose prompts are expensive to prepare has them
prepared one at a time, each after a rest of twice the CPU the last one took, so such prompts hold at most a third
of the worker's interpreter; prompts of other tenants go on meanwhile on the prepare threads."""

from __future__ import annotations

import asyncio
import time

from switchyard.shared.messages import ChatMessage, GenerateRequest, SamplingParams
from switchyard.workers.service.intake import DEMOTED_S, SLOW_PREPARE_S, Intake


class BurningEngine:
    """``prepare`` burns ``cost_s`` of CPU and records when it ran, on which thread."""

    def __init__(self, cost_s: float) -> None:
        self.cost_s, self.spans = cost_s, []

    def prepare(self, request):
        start = time.monotonic()
        until = time.thread_time() + self.cost_s
        while time.thread_time() < until:
            pass
        self.spans.append((request.request_id, start, time.monotonic()))
        return request.request_id


class StubConnection:
    def new_inbox(self) -> str:
        return "_INBOX.test"


def request(request_id: str) -> GenerateRequest:
    now = time.time()
    return GenerateRequest(request_id, "m", "pro", SamplingParams(max_tokens=1), now, now + 60,
                           messages=[ChatMessage(role="user", content="hi")], tenant_id="heavy")


async def test_expensive_prompts_are_prepared_one_at_a_time_with_rests_between():
    engine = BurningEngine(cost_s=0.05)
    intake = Intake(engine, StubConnection(), None, "m", "w", held=None, capacity=None, out=None)
    try:
        results = await asyncio.gather(*(intake._on_slow_lane(request(f"r{i}")) for i in range(3)))
    finally:
        intake.shutdown()
    assert [prepared for prepared, _ in results] == ["r0", "r1", "r2"]
    assert all(cpu_s >= 0.05 for _, cpu_s in results)
    starts = {rid: start for rid, start, _ in engine.spans}
    ends = {rid: end for rid, _, end in engine.spans}
    for before, after in (("r0", "r1"), ("r1", "r2")):
        assert starts[after] - ends[before] >= 2.0 * 0.05 * 0.9  # rested after each, not back to back


def test_tenants_forgiven_are_forgotten():
    intake = Intake(BurningEngine(cost_s=0.0), StubConnection(), None, "m", "w", held=None, capacity=None, out=None)
    try:
        intake._note_cost("gone", SLOW_PREPARE_S * 2, now=100.0)
        intake._note_cost("staying", SLOW_PREPARE_S * 2, now=100.0 + DEMOTED_S / 2)
        intake._note_cost("cheap", 0.0, now=100.0 + DEMOTED_S + 1)  # any prepare sweeps, once every DEMOTED_S
        assert set(intake._demoted) == {"staying"}
        intake._note_cost("cheap", 0.0, now=100.0 + 3 * DEMOTED_S)
        assert intake._demoted == {}
    finally:
        intake.shutdown()
