"""Ops control of tiers, shared by the admin HTTP API and ``switchyard tiers``: show queues, change policies live.

A change is applied to JetStream first (the stream cap at once; weights and wait limits within a second, as
gateway and worker caches expire) and then recorded in Postgres with who made it.
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from switchyard.domain.queues import queue_state
from switchyard.shared import subjects
from switchyard.shared.messages import WorkerInfo
from switchyard.shared.tier_store import read_policies, write_policy
from switchyard.shared.tiers import BATCH_TIER, TIER_NAMES, TierPolicy


class TierChangeError(ValueError):
    """A change that cannot be applied (unknown tier, invalid value); the message says why."""


async def change_tier(js: JetStreamContext, pool: asyncpg.Pool, tier: str, who: str, *,
                      max_queued: int | None = None, max_wait_s: float | None = None,
                      weight: float | None = None, max_queued_per_tenant: int | None = None,
                      max_streams: int | None = None, max_sequences: int | None = None,
                      hedge_after_ms: int | str | None = None, hedge_budget: float | None = None,
                      pause_after_tokens: int | None = None,
                      ) -> tuple[TierPolicy, TierPolicy]:
    """Apply the given fields to ``tier``'s policy live; returns ``(old, new)``. ``hedge_after_ms``: milliseconds,
    ``"auto"`` or ``"off"`` (or 0). ``pause_after_tokens``: tokens, 0 for off."""
    _check_pause_after(tier, pause_after_tokens)
    if tier not in TIER_NAMES:
        raise TierChangeError(f"unknown tier {tier!r}; known: {', '.join(TIER_NAMES)}")
    hedge_after_ms = _hedge_after(hedge_after_ms)
    if tier == BATCH_TIER and hedge_after_ms not in (None, 0):
        raise TierChangeError("the batch tier is never hedged: its requests wait for idle seats by design")
    if hedge_budget is not None and not 0 < hedge_budget <= 1:
        raise TierChangeError("hedge_budget must be a share of the tier's requests, above 0 and at most 1")
    if max_queued is not None and max_queued < 1:
        raise TierChangeError("max_queued must be at least 1")
    if max_queued_per_tenant is not None and max_queued_per_tenant < 0:
        raise TierChangeError("max_queued_per_tenant must be 0 (a quarter of max_queued) or more")
    if any(v is not None and v < 0 for v in (max_streams, max_sequences)):
        raise TierChangeError("max_streams and max_sequences must be 0 (no cap) or more")
    if max_wait_s is not None and max_wait_s <= 0:
        raise TierChangeError("max_wait_s must be positive")
    if weight is not None and weight <= 0:
        raise TierChangeError("weight must be positive")
    old = (await read_policies(js))[tier]
    changes = {k: v for k, v in (("max_queued", max_queued), ("max_wait_s", max_wait_s), ("weight", weight),
                                 ("max_queued_per_tenant", max_queued_per_tenant), ("max_streams", max_streams),
                                 ("max_sequences", max_sequences), ("hedge_after_ms", hedge_after_ms),
                                 ("hedge_budget", hedge_budget), ("pause_after_tokens", pause_after_tokens))
               if v is not None}
    new = msgspec.structs.replace(old, **changes)
    await write_policy(js, tier, new)
    async with pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO tier_changes (tier, changed_by, old_policy, new_policy) VALUES ($1, $2, $3, $4)",
            tier, who, json.dumps(msgspec.to_builtins(old)), json.dumps(msgspec.to_builtins(new)))
    return old, new


# A quantum longer than any context would never pause anything: a typo, not a setting.
MAX_PAUSE_AFTER_TOKENS = 1_000_000


def _check_pause_after(tier: str, value: int | None) -> None:
    """``tiers set --pause-after-tokens``: a whole number of tokens, 0 for off; never on for the batch tier."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TierChangeError(f"pause_after_tokens must be a whole number of tokens (0: off), not {value!r}")
    if not 0 <= value <= MAX_PAUSE_AFTER_TOKENS:
        raise TierChangeError(f"pause_after_tokens must be 0 (off) or a number of tokens up to "
                              f"{MAX_PAUSE_AFTER_TOKENS:,}, not {value}")
    if tier == BATCH_TIER and value:
        raise TierChangeError("the batch tier is never paused for: its requests wait for idle seats by design")


def _hedge_after(value: int | str | None) -> int | str | None:
    """``tiers set --hedge-after-ms`` as the policy holds it: milliseconds, "auto", or 0 for off."""
    if value is None or value == "auto":
        return value
    if value == "off":
        return 0
    try:
        ms = int(value)
    except (TypeError, ValueError):
        raise TierChangeError(f"hedge_after_ms must be milliseconds, 'auto' or 'off', not {value!r}") from None
    if ms < 0:
        raise TierChangeError("hedge_after_ms must be 0 (off) or more milliseconds")
    return ms


async def tier_status(js: JetStreamContext, served: dict[str, list[WorkerInfo]]) -> list[dict[str, Any]]:
    """Per model and tier: queued, oldest wait, token backlog (the gateway's queue gauges, gateway/queue_metrics.py),
    running, limits, workers, 429s in the last 5 minutes."""
    policies = await read_policies(js)
    rejected: dict[str, int] = {}
    try:
        info = await js.stream_info(subjects.EVENTS_STREAM, subjects_filter=f"{subjects.EVENTS_PREFIX}.rejected.>")
        rejected = dict(info.state.subjects or {})
    except NotFoundError:
        pass
    rows = []
    for model, workers in sorted(served.items()):
        for tier in TIER_NAMES:
            queue = await queue_state(js, model, tier)
            policy = policies[tier]
            rows.append({
                "model": model,
                "tier": tier,
                "queued": queue.depth,
                "oldest_wait_s": queue.oldest_age_s,
                "backlog_tokens": queue.backlog_tokens,
                "running": sum(w.running.get(tier, 0) for w in workers),
                "max_queued": policy.max_queued,
                "max_queued_per_tenant": policy.tenant_cap,
                "max_wait_s": policy.max_wait_s,
                "weight": policy.weight,
                "hedge_after_ms": policy.describe_hedging(),
                "pause_after_tokens": policy.describe_pausing(),
                "workers": len(workers),
                "rejected_5m": rejected.get(subjects.rejected_subject(model, tier), 0),
            })
    return rows
