"""WaitingQueue: (priority, arrival) order, O(1) removal with lazy heap cleanup."""

from __future__ import annotations

import pytest

from switchyard.scheduler import Sequence, WaitingQueue


def seq(seq_id: str, priority: int = 0, arrival: float = 0.0) -> Sequence:
    return Sequence(seq_id, [1], max_tokens=1, priority=priority, arrival=arrival)


def test_pops_by_priority_then_arrival() -> None:
    queue = WaitingQueue()
    for s in (seq("c", 1, 0.0), seq("b", 0, 2.0), seq("a", 0, 1.0)):
        queue.push(s)
    assert queue.peek().seq_id == "a" and len(queue) == 3
    assert [queue.pop().seq_id for _ in range(3)] == ["a", "b", "c"]
    assert not queue and queue.peek() is None
    with pytest.raises(IndexError):
        queue.pop()


def test_removed_members_are_skipped_and_the_heap_compacts() -> None:
    queue = WaitingQueue()
    seqs = [seq(f"s{i:03}", arrival=float(i)) for i in range(100)]
    for s in seqs:
        queue.push(s)
    for s in seqs[:90]:
        assert queue.remove(s.seq_id) is s
    assert queue.remove("s000") is None and "s000" not in queue and "s095" in queue
    assert len(queue._heap) < 50  # stale entries were dropped in a rebuild, not kept forever
    assert [queue.pop().seq_id for _ in range(len(queue))] == [s.seq_id for s in seqs[90:]]


def test_a_sequence_is_queued_once() -> None:
    queue = WaitingQueue()
    s = seq("a")
    queue.push(s)
    with pytest.raises(ValueError):
        queue.push(s)
