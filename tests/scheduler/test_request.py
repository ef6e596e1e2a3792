"""RequestStatus ordering and Sequence token bookkeeping."""

from __future__ import annotations

import pytest

from switchyard.scheduler import RequestStatus, Sequence, finish_reason


def test_every_finished_state_sorts_after_preempted() -> None:
    live = [RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PAUSED, RequestStatus.PREEMPTED]
    finished = [s for s in RequestStatus if s not in live]
    assert all(s > RequestStatus.PREEMPTED for s in finished)
    assert [RequestStatus.is_finished(s) for s in live] == [False, False, False, False]
    assert all(RequestStatus.is_finished(s) for s in finished)


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (RequestStatus.WAITING, None),
        (RequestStatus.RUNNING, None),
        (RequestStatus.PAUSED, None),
        (RequestStatus.PREEMPTED, None),
        (RequestStatus.FINISHED_STOPPED, "stop"),
        (RequestStatus.FINISHED_LENGTH, "length"),
        (RequestStatus.FINISHED_ABORTED, "cancelled"),
        (RequestStatus.FINISHED_ERROR, "error"),
        (RequestStatus.FINISHED_FILTERED, "content_filter"),
    ],
)
def test_finish_reason_maps_to_openai(status: RequestStatus, reason: str | None) -> None:
    assert RequestStatus.finish_reason(status) == reason
    assert finish_reason(status) == reason


def test_tokens_are_one_list_of_prompt_then_outputs() -> None:
    prompt = [5, 6, 7]
    seq = Sequence("a", prompt, max_tokens=4)
    prompt.append(99)  # the caller's list is copied, not aliased
    assert seq.num_prompt_tokens == 3 and seq.num_output_tokens == 0 and seq.num_tokens == 3
    seq.append_token(8)
    seq.append_token(9)
    assert seq.all_token_ids == [5, 6, 7, 8, 9]
    assert seq.all_token_ids is seq.token_ids  # no copy on the hot path
    assert seq.output_token_ids == [8, 9]
    assert seq.last_token_id == 9
    assert (seq.num_output_tokens, seq.num_tokens, seq.num_uncomputed_tokens) == (2, 5, 5)
    assert seq.status == RequestStatus.WAITING and not seq.is_finished
    seq.status = RequestStatus.FINISHED_LENGTH
    assert seq.is_finished


def test_sort_key_is_priority_then_arrival_then_id() -> None:
    seqs = [
        Sequence("c", [1], 1, priority=1, arrival=0.0),
        Sequence("b", [1], 1, priority=0, arrival=2.0),
        Sequence("a", [1], 1, priority=0, arrival=2.0),
        Sequence("d", [1], 1, priority=0, arrival=1.0),
    ]
    assert [s.seq_id for s in sorted(seqs, key=lambda s: s.sort_key)] == ["d", "a", "b", "c"]


def test_sequence_is_slotted_and_compared_by_identity() -> None:
    a, b = Sequence("a", [1], 1), Sequence("a", [1], 1)
    assert not hasattr(a, "__dict__")
    assert a != b and len({a, b}) == 2


@pytest.mark.parametrize(("prompt", "max_tokens"), [([], 4), ([1], 0)])
def test_invalid_sequence_is_rejected(prompt: list[int], max_tokens: int) -> None:
    with pytest.raises(ValueError):
        Sequence("bad", prompt, max_tokens=max_tokens)
