"""Priority tiers: one number end to end (subject, pull order and share, engine priority and preemption). A new
tier is a line of ``TIERS``: everything else (CLI choices, Kubernetes triggers, defaults) reads it from here.

Lower ``priority`` is more important, matching the engine's (priority, arrival) ordering. Each tier has a policy
that ops change live (``switchyard tiers set``): the queue cap is enforced by JetStream itself, the wait limit by
the gateway's deadline and the worker's check, the weight by every worker's pull.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec


class TierPolicy(msgspec.Struct, frozen=True):
    """What ops set per tier; stored in the ``tiers`` KV bucket (the live value) and mirrored in Postgres."""

    max_queued: int  # queued requests in the tier (every model); more are refused with 429 queue_full
    max_wait_s: float  # a request not started within this is answered queue_timeout, never run late
    weight: float  # share of a worker's pulls when several tiers have work
    rpm: int = 0  # default requests per minute per API key (0: unlimited)
    tpm: int = 0  # default tokens per minute per API key (0: unlimited)
    # Queued requests of one tenant for one model: a tenant's flood fills its own queue, never the tier's, so the
    # tier's other tenants still get in (0: a quarter of max_queued).
    max_queued_per_tenant: int = 0
    # What one tenant may hold at once (domain/admission/concurrency.py), whatever its key or service_tier: requests
    # generating (streamed or not) and their sequences, every choice of each (0: no cap).
    max_streams: int = 0
    max_sequences: int = 0
    # Hedged requests (gateway/hedging.py): a request with no token this long after it was accepted is offered to a
    # second worker with a spare seat, and whichever produces a token first serves it. 0: off; "auto": the tier's
    # recent TTFT p95 on the request's model. Never for the batch tier.
    hedge_after_ms: int | Literal["auto"] = 0
    # Hedges at most this share of the tier's requests (each gateway counts its own): a hedge costs a second
    # prefill, and hedging everything would double the load it is meant to route around.
    hedge_budget: float = 0.05
    # Pausing (scheduler/pausing.py): with every seat of the tier taken, a running request that has generated this
    # many tokens since it last started may be paused for a waiting tenant that holds fewer seats and is far below
    # its fair share (a light tenant among busy ones): its KV and tokens kept, it resumes into the next free seat;
    # its client sees a longer gap, never an error. At most 3 pauses a request. 0: off. Never for the batch tier.
    pause_after_tokens: int = 0

    @property
    def tenant_cap(self) -> int:
        return self.max_queued_per_tenant or max(1, self.max_queued // 4)

    def describe_hedging(self) -> str:
        """As ``tiers set`` takes it: ``off``, ``auto`` or a number of milliseconds, and the budget."""
        after = "off" if self.hedge_after_ms == 0 else str(self.hedge_after_ms)
        return after if after == "off" else f"{after} (budget {self.hedge_budget:.0%})"

    def describe_pausing(self) -> str:
        """As ``tiers set`` takes it: ``off`` or the tokens after which a long generation may be paused."""
        return "off" if self.pause_after_tokens == 0 else f"after {self.pause_after_tokens} tokens"


@dataclass(frozen=True, slots=True)
class Tier:
    """A tier, and everything that is said of it once: its priority, the policy it starts with (ops change it
    live), whether it is interactive, and how its queue asks Kubernetes for workers (deploy/k8s_scaling.py)."""

    name: str
    priority: int
    defaults: TierPolicy
    interactive: bool = True
    # KEDA: requests waiting per worker before another is asked for (a worker already runs max_num_seqs at once and
    # pulls only what fits, so any queue means every worker is full: the threshold says how long the tier may queue)
    scale_threshold: int = 8
    # KEDA with --min-replicas 0: the queue that wakes the first worker
    scale_activation: int = 0


# The longest a batch line may wait to run: its batch's completion window (domain/batch_format.py offers "24h"),
# whatever the batch tier's max_wait_s says.
BATCH_COMPLETION_WINDOW_S = 24 * 3600.0

TIERS: tuple[Tier, ...] = (
    Tier("enterprise", 0, TierPolicy(max_queued=1000, max_wait_s=60.0, weight=8.0, rpm=6000, tpm=2_000_000,
                                     max_streams=512, max_sequences=2048), scale_threshold=4),
    # Pausing on for the tiers with many small tenants (docs/operating/tiers.md, "Pausing long generations"): a
    # light tenant gets a seat at once instead of after some 400-token request ends; it costs the paused stream a
    # gap about one short request long, and no throughput (its KV is kept). Off for enterprise, whose streams'
    # steady token rate is what it pays for, and for batch, whose requests wait for idle seats anyway.
    Tier("pro", 1, TierPolicy(max_queued=500, max_wait_s=30.0, weight=4.0, rpm=600, tpm=400_000, max_streams=128,
                              max_sequences=512, pause_after_tokens=256), scale_threshold=8),
    Tier("free", 2, TierPolicy(max_queued=200, max_wait_s=20.0, weight=1.0, rpm=60, tpm=40_000, max_streams=16,
                               max_sequences=64, pause_after_tokens=256), scale_threshold=32),
    # Batch takes what the interactive tiers leave idle, plus a small guaranteed share (see BatchShare); it may
    # wait hours by design, so it asks for workers only once its queue is deep, and lines do not wake a GPU one by
    # one.
    Tier("batch", 3, TierPolicy(max_queued=100_000, max_wait_s=BATCH_COMPLETION_WINDOW_S, weight=0.05, rpm=0, tpm=0),
         interactive=False, scale_threshold=1024, scale_activation=64),
)

TIER_NAMES: tuple[str, ...] = tuple(t.name for t in TIERS)
INTERACTIVE_TIERS: tuple[str, ...] = tuple(t.name for t in TIERS if t.interactive)
BATCH_TIER = next(t.name for t in TIERS if not t.interactive)
DEFAULT_POLICIES: dict[str, TierPolicy] = {t.name: t.defaults for t in TIERS}
NEW_TENANT_TIER = "free"  # a tenant created without one (switchyard tenants create)
FIRST_TENANT_TIER = "pro"  # the `default` tenant a first `switchyard up` creates
_BY_NAME = {t.name: t for t in TIERS}


def get_tier(name: str) -> Tier:
    """Return the tier called ``name``; raise ``KeyError`` for an unknown tier."""
    return _BY_NAME[name]


def tiers_by_priority() -> list[Tier]:
    """Tiers from most to least important."""
    return sorted(TIERS, key=lambda t: t.priority)
