"""Blocks from another node's tiers: whether fetching them beats computing them, and who fetches them.

    a request the gateway's index says another node holds the prefix of (GenerateRequest.kv_source)
        ──▶ TransferCost.worth(): the blocks' bytes at the measured bandwidth, plus a round trip,
                                  against their tokens at the measured prefill speed
        ──yes─▶ the loader thread asks KVPeers.fetch (the worker's NATS request-reply, workers/service/kv_blocks.py)
                ──▶ each block verified as a local one is (CRC, hash, tokens), kept in this node's top tier, loaded
        ──no──▶ computed here

Both speeds are measured as the worker runs: every prefill step and every fetch updates a moving average. Before
the first measurement the transfer is taken to run at ``ASSUMED_BYTES_PER_S`` (a 1 Gb/s link, the slow end of a
datacentre's) and compute is taken as unknown, so the first fetch is tried and measured.
"""

from __future__ import annotations

import threading
from typing import Protocol

ASSUMED_BYTES_PER_S = 125e6
ASSUMED_ROUND_TRIP_S = 0.002
UNMEASURED_BUDGET_S = 5.0
_SMOOTHING = 0.3  # weight of the newest measurement in the moving averages
_MIN_PREFILL_TOKENS = 32  # a step with fewer tokens is a decode step: it says little about prefill speed


class KVPeers(Protocol):
    """How an engine reaches the other nodes' tiers (the worker's NATS connection). Called on the loader thread."""

    node: str  # this worker's node (workers/service/kv_events.node_id)

    def fetch(self, node: str, layout: str, scope: str, block_hashes: list[int], budget_s: float,
              ) -> list[bytes | None]:
        """The block files ``node`` holds for these hashes in tiers of ``layout`` (``BlockLayout.key``: the same
        weights, dtype and block shape), in order, each None where it has none (a failure ends the list: everything
        after it is None). No block is asked for once ``budget_s`` has passed. Blocks until done or failed; never
        raises."""
        ...


class TransferCost:
    """Measured prefill speed and transfer bandwidth, and the choice they make (thread-safe: the step thread
    measures prefill, the loader thread transfers)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prefill_tokens_per_s: float | None = None
        self.bytes_per_s: float | None = None
        self.round_trip_s: float | None = None
        self.num_fetched = 0  # blocks fetched from other nodes
        self.num_declined = 0  # blocks cheaper to compute than to fetch, so computed

    def note_step(self, num_tokens: int, seconds: float) -> None:
        """A step computed ``num_tokens`` in ``seconds``: prefill speed, when it was mostly prefill."""
        if num_tokens < _MIN_PREFILL_TOKENS or seconds <= 0:
            return
        with self._lock:
            self.prefill_tokens_per_s = _average(self.prefill_tokens_per_s, num_tokens / seconds)

    def note_transfer(self, num_blocks: int, num_bytes: int, seconds: float) -> None:
        """A fetch of ``num_blocks`` blocks took ``seconds``."""
        if num_blocks <= 0 or seconds <= 0:
            return
        with self._lock:
            self.num_fetched += num_blocks
            self.bytes_per_s = _average(self.bytes_per_s, num_bytes / seconds)
            if num_blocks == 1:
                self.round_trip_s = _average(self.round_trip_s, seconds)

    def fetch_s(self, num_bytes: int) -> float:
        rtt = self.round_trip_s if self.round_trip_s is not None else ASSUMED_ROUND_TRIP_S
        return rtt + num_bytes / (self.bytes_per_s or ASSUMED_BYTES_PER_S)

    def compute_s(self, num_tokens: int) -> float | None:
        return num_tokens / self.prefill_tokens_per_s if self.prefill_tokens_per_s else None

    def budget_s(self, num_blocks: int, block_tokens: int) -> float:
        """How long a fetch of ``num_blocks`` may go on asking for blocks: twice what computing them would take (a
        link that slows down mid-fetch costs at most that), or ``UNMEASURED_BUDGET_S`` before any prefill step."""
        compute = self.compute_s(num_blocks * block_tokens)
        return UNMEASURED_BUDGET_S if compute is None else 2 * compute

    def worth(self, num_blocks: int, block_tokens: int, block_bytes: int) -> bool:
        """Whether fetching ``num_blocks`` blocks beats computing their tokens (counted when it does not)."""
        compute = self.compute_s(num_blocks * block_tokens)
        worth = compute is None or self.fetch_s(num_blocks * block_bytes) < compute
        if not worth:
            with self._lock:
                self.num_declined += num_blocks
        return worth


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * new
