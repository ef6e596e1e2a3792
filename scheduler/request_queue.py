"""The waiting queue: sequences in ``(priority, arrival, seq_id)`` order, with O(log n) push/pop and O(1) removal.

Removal (an abort while waiting) only forgets the member; its heap entry is dropped lazily when it reaches
the top, or in a rebuild once stale entries outnumber live ones, so aborts never cost a heap search.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from switchyard.scheduler.request import Sequence


class WaitingQueue:
    """A priority queue of sequences keyed by ``Sequence.sort_key`` (lower = scheduled first).

    Preempted sequences are pushed back with their original arrival, so they keep their place ahead of
    requests that arrived after them.
    """

    def __init__(self) -> None:
        # Entries are (sort_key, seq); sort_key ends with the unique seq_id, so seqs are never compared.
        self._heap: list[tuple[tuple[int, float, str], Sequence]] = []
        self._members: dict[str, Sequence] = {}

    def __len__(self) -> int:
        return len(self._members)

    def __bool__(self) -> bool:
        return bool(self._members)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._members

    def __iter__(self) -> Iterator[Sequence]:
        """Members in no particular order."""
        return iter(self._members.values())

    def push(self, seq: Sequence) -> None:
        if seq.seq_id in self._members:
            raise ValueError(f"sequence {seq.seq_id!r} is already waiting")
        self._members[seq.seq_id] = seq
        heapq.heappush(self._heap, (seq.sort_key, seq))

    def peek(self) -> Sequence | None:
        """The next sequence to schedule, or None when empty."""
        self._drop_stale_head()
        return self._heap[0][1] if self._heap else None

    def pop(self) -> Sequence:
        """Remove and return the next sequence; raises IndexError when empty."""
        self._drop_stale_head()
        _, seq = heapq.heappop(self._heap)
        del self._members[seq.seq_id]
        return seq

    def remove(self, seq_id: str) -> Sequence | None:
        """Take a sequence out wherever it is; returns it, or None if it was not waiting."""
        seq = self._members.pop(seq_id, None)
        if seq is not None and len(self._heap) > 2 * len(self._members) + 16:
            self._heap = [entry for entry in self._heap if self._is_live(entry[1])]
            heapq.heapify(self._heap)
        return seq

    def _is_live(self, seq: Sequence) -> bool:
        return self._members.get(seq.seq_id) is seq

    def _drop_stale_head(self) -> None:
        heap = self._heap
        while heap and not self._is_live(heap[0][1]):
            heapq.heappop(heap)
