"""What a hand-over's continuation carries (gateway/failover.py): the prefill worker's name, for the usage record
of the worker that finishes the request, and a vLLM prefill's connector parameters, for the decode side's vLLM,
only until the next failover (the prefill side may have freed those blocks by then)."""

from __future__ import annotations

import time

from switchyard.gateway.failover import Failover
from switchyard.shared.messages import GenerateRequest, SamplingParams


class RecordingPublisher:
    def __init__(self) -> None:
        self.published: list[tuple[GenerateRequest, str]] = []

    async def publish(self, request: GenerateRequest, msg_id: str) -> None:
        self.published.append((request, msg_id))


async def test_a_hand_over_names_the_prefill_worker_and_a_later_failover_keeps_the_name_but_not_the_blocks():
    publisher = RecordingPublisher()
    failover = Failover(js=None, publisher=publisher)  # type: ignore[arg-type]
    now = time.time()
    request = GenerateRequest("r1", "m", "standard", SamplingParams(max_tokens=9), created_at=now,
                              deadline_at=now + 30, prompt="x", handover=True)
    params = {"remote_engine_id": "e1", "remote_block_ids": [3, 4], "do_remote_prefill": True}

    handed = await failover.hand_over(request, [7], 2, prefill_worker="p1", kv_transfer=params)
    assert handed is not None and not handed.handover
    assert (handed.resume.token_ids, handed.resume.text_len, handed.resume.attempt, handed.resume.handovers) == \
        ([7], 2, 1, 1)
    assert (handed.resume.prefill_worker, handed.resume.kv_transfer) == ("p1", params)

    # The decode worker's stream broke (dead_worker None: any live worker may go on): still prefilled by p1, but
    # the next worker computes or loads the prompt itself.
    again = await failover.continue_elsewhere(handed, None, [7, 8, 9], 5)
    assert again is not None
    assert (again.resume.attempt, again.resume.handovers, again.resume.prefill_worker, again.resume.kv_transfer) == \
        (2, 1, "p1", None)
    assert [msg_id for _, msg_id in publisher.published] == ["r1.resume1", "r1.resume2"]
