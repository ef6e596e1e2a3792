"""Admission policy: a tenant's batches in progress hold at most a day of its tokens-per-minute limit in estimated
tokens (OpenAI's "enqueued token limit"). Judged when a batch is about to start, on all its lines together; its
lines are then paced by the batch tier, not by the key's per-minute rate.
"""

from __future__ import annotations

from switchyard.domain.admission.pipeline import Policy
from switchyard.domain.admission.ticket import Origin, Ticket
from switchyard.domain.database import Database
from switchyard.domain.errors import OpenAIError
from switchyard.shared.tier_store import PolicyCache

ENQUEUED_MINUTES = 24 * 60
ENQUEUED_SQL = """
SELECT coalesce(sum(l.estimated_tokens), 0) FROM batch_lines l JOIN batches b ON b.id = l.batch_id
WHERE b.tenant_id = $1 AND b.status = 'in_progress' AND l.status IN ('pending', 'queued')
"""


class EnqueuedBatchTokens(Policy):
    origins = frozenset({Origin.BATCH})

    def __init__(self, db: Database, tier_policies: PolicyCache) -> None:
        self._db = db
        self._tier_policies = tier_policies

    async def check(self, ticket: Ticket) -> None:
        auth = ticket.auth
        tpm = auth.tpm_limit or (await self._tier_policies.get())[auth.tier].tpm
        if not tpm:
            return
        cap = tpm * ENQUEUED_MINUTES
        # Read now, not through the breaker's fallbacks: a batch can wait for Postgres, a limit must not be guessed.
        enqueued = await self._db.pool.fetchval(ENQUEUED_SQL, auth.tenant_id)
        if enqueued + ticket.estimated_tokens <= cap:
            return
        raise OpenAIError(429, f"Enqueued token limit reached: this batch may use {ticket.estimated_tokens} tokens "
                          f"and your batches in progress {enqueued}, over your limit of {cap} enqueued tokens. Please "
                          "try again once some in-progress batches have been completed.", type="rate_limit_error",
                          code="token_limit_exceeded")
