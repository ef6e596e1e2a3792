"""Which tier a worker pulls its next request from: weighted fair share, with batch on idle capacity.

Start-time fair queuing over the interactive tiers: each tier has a virtual finish tag that grows by
``1 / weight`` per request taken, and the tier with the smallest next tag goes first (ties: higher priority).
Under sustained load from every tier, pulls split in proportion to the weights, so ``free`` keeps moving
while ``pro`` is busy; a tier returning from idle starts at the current virtual time, so it cannot spend
credit saved while it had nothing queued.

Batch is outside that race: it is tried last, after every interactive tier came up empty, except when its
share of recent pulls has fallen below ``batch_min_share``; then it goes first once, so a batch job always
progresses, however busy the interactive tiers are.
"""

from __future__ import annotations

from collections import deque


class TierShare:
    def __init__(self, weights: dict[str, float], priorities: dict[str, int], batch_tier: str = "batch",
                 batch_min_share: float = 0.05, window: int = 200) -> None:
        self._priorities = dict(priorities)
        self._batch_tier = batch_tier
        self._batch_min_share = batch_min_share
        self._finish: dict[str, float] = {t: 0.0 for t in priorities}
        self._virtual_time = 0.0
        self._recent: deque[str] = deque(maxlen=window)  # tiers of the last `window` pulls
        self._weights: dict[str, float] = {}
        self.set_weights(weights)

    def set_weights(self, weights: dict[str, float]) -> None:
        """Apply new weights (ops change them live); a weight <= 0 is treated as a tiny one, never zero."""
        self._weights = {t: max(float(weights.get(t, 1.0)), 1e-6) for t in self._priorities}

    def _next_tag(self, tier: str) -> float:
        return self._finish[tier] + 1.0 / self._weights[tier]

    def is_batch_due(self) -> bool:
        """True when batch got less than its guaranteed share of the recent pulls."""
        if not self._recent:
            return False
        return self._recent.count(self._batch_tier) < self._batch_min_share * len(self._recent)

    def order(self) -> list[str]:
        """Every tier, in the order to try pulling from them now."""
        interactive = sorted((t for t in self._priorities if t != self._batch_tier),
                             key=lambda t: (self._next_tag(t), self._priorities[t]))
        if self._batch_tier not in self._priorities:
            return interactive
        if self.is_batch_due():
            return [self._batch_tier, *interactive]
        return [*interactive, self._batch_tier]

    def charge(self, tier: str) -> None:
        """Record that one request was taken from ``tier``."""
        self._recent.append(tier)
        if tier == self._batch_tier:
            return
        start = self._finish[tier]
        self._finish[tier] = start + 1.0 / self._weights[tier]
        self._virtual_time = start

    def note_empty(self, tier: str) -> None:
        """A pull from ``tier`` found nothing queued: when work comes back it starts at the current virtual
        time, without credit saved while it was idle."""
        self._finish[tier] = max(self._finish[tier], self._virtual_time)

    def note_idle(self) -> None:
        """Every queue was empty: nothing is owed to anyone any more."""
        for tier in self._finish:
            self._finish[tier] = max(self._finish[tier], self._virtual_time)
        self._recent.clear()
