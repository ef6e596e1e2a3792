"""Moves usage records from the durable USAGE stream into Postgres, exactly once per request id.

A record is acked only after its row is committed, and the insert ignores a request id already present, so a
redelivery (writer crash, Postgres outage, a second gateway replica) never writes twice and never loses a row.
A record Postgres refuses on its own (text it cannot store, a date out of range) is billed from what is known,
``salvaged``: its tokens, tenant, key and model, without the client's free-form fields; the original goes to the
dead letters. A served request is never left unbilled.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import math
import time

import asyncpg
import msgspec
from nats.js import JetStreamContext

from switchyard.domain.api.text import storable
from switchyard.jobs.consumer import consume_once
from switchyard.shared import subjects
from switchyard.shared.jetstream import ensure_usage_consumer
from switchyard.shared.messages import UsageRecord

log = logging.getLogger("switchyard.usage")

# The cost is priced inside the insert, from the model's row in model_prices or the '*' default, so a price
# change applies to every record written after it, whichever gateway writes it. A row really inserted (not a
# redelivered record's) adds its tokens to its tenant's month (a trigger, migration 0010), where the monthly budget
# reads them (domain/admission/budget.py).
INSERT_SQL = """
INSERT INTO requests (request_id, model, tier, tenant_id, api_key_id, prompt_tokens, completion_tokens,
                      cached_tokens, finish_reason, queue_ms, first_token_ms, total_ms, worker_id, created_at,
                      end_user, metadata, prefill_worker_id, kv_loaded_bytes, cost_usd)
SELECT $1, $2, $3, $4, $5, $6::int, $7::int, $8, $9, $10, $11, $12, $13, $14, $15, $16::jsonb, $17, $18,
       coalesce((SELECT ($6::int * p.input_per_mtok + $7::int * p.output_per_mtok) / 1000000
                        * (CASE WHEN $3::text = 'batch' THEN 1 - p.batch_discount ELSE 1 END)
                 FROM model_prices p WHERE p.model IN ($2, '*') ORDER BY p.model = '*' LIMIT 1), 0)
ON CONFLICT (request_id) DO NOTHING
"""


def _row(r: UsageRecord) -> tuple:
    created = dt.datetime.fromtimestamp(r.created_at, tz=dt.UTC)
    return (
        r.request_id, r.model, r.tier, r.tenant_id, r.api_key_id, r.prompt_tokens, r.completion_tokens,
        r.cached_tokens, r.finish_reason, r.queue_ms, r.first_token_ms, r.total_ms, r.worker_id, created,
        r.end_user, None if r.metadata is None else json.dumps(r.metadata), r.prefill_worker_id, r.kv_loaded_bytes,
    )


_MAX_INT = 2**31 - 1  # the token columns' range
_MAX_BIGINT = 2**63 - 1


def salvaged(r: UsageRecord) -> UsageRecord:
    """What of ``r`` can be written whatever its fields hold: the billing facts (tokens, tenant, key, model, tier),
    free-form text dropped or made storable, numbers brought into their columns' ranges."""
    created = r.created_at if math.isfinite(r.created_at) and 0 < r.created_at < 32503680000 else time.time()

    def count(n: int) -> int:
        return min(max(n, 0), _MAX_INT)

    def ms(value: float | None) -> float | None:
        return value if value is None or math.isfinite(value) else None

    return msgspec.structs.replace(
        r, request_id=storable(r.request_id), model=storable(r.model), tier=storable(r.tier),
        tenant_id=storable(r.tenant_id), api_key_id=storable(r.api_key_id), worker_id=storable(r.worker_id),
        prefill_worker_id=storable(r.prefill_worker_id), kv_loaded_bytes=min(max(r.kv_loaded_bytes, 0), _MAX_BIGINT),
        finish_reason=storable(r.finish_reason),
        prompt_tokens=count(r.prompt_tokens), completion_tokens=count(r.completion_tokens),
        cached_tokens=count(r.cached_tokens), created_at=created, queue_ms=ms(r.queue_ms) or 0.0,
        first_token_ms=ms(r.first_token_ms), total_ms=ms(r.total_ms) or 0.0, end_user=None, metadata=None)


async def run_usage_writer(js: JetStreamContext, pool: asyncpg.Pool, stop: asyncio.Event, batch: int = 64) -> None:
    """Consume until ``stop`` is set. Postgres errors delay records (redelivered later), never drop them."""
    await ensure_usage_consumer(js)
    sub = await js.pull_subscribe_bind(subjects.USAGE_CONSUMER, stream=subjects.USAGE_STREAM)
    async def write(records: list[UsageRecord]) -> None:
        async with pool.acquire() as conn:
            await conn.executemany(INSERT_SQL, [_row(r) for r in records])

    try:
        while not stop.is_set():
            await consume_once(js, sub, UsageRecord, write, "usage record", batch, timeout_s=1.0, salvage=salvaged)
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # connection already closing
            pass
