"""Writes held while Postgres was away (conversation turns, see domain/conversations.py), written once it is back.

Like the billing writer: a record is acked only after its rows are committed, and rows whose ids come from the
request id are inserted with ON CONFLICT DO NOTHING, so a redelivery never writes twice and nothing is dropped.
"""

from __future__ import annotations

import asyncio

import asyncpg
from nats.js import JetStreamContext

from switchyard.domain.conversations import write_turn
from switchyard.jobs.consumer import consume_once
from switchyard.shared import subjects
from switchyard.shared.jetstream import ensure_held_writes_consumer
from switchyard.shared.messages import ConversationTurn


async def run_held_writer(js: JetStreamContext, pool: asyncpg.Pool, stop: asyncio.Event) -> None:
    """Consume held turns until ``stop`` is set; Postgres errors delay them (redelivered), never drop them."""
    await ensure_held_writes_consumer(js)
    sub = await js.pull_subscribe_bind(subjects.HELD_WRITES_CONSUMER, stream=subjects.HELD_WRITES_STREAM)

    async def write(turns: list[ConversationTurn]) -> None:
        for turn in turns:
            await write_turn(pool, turn)

    try:
        while not stop.is_set():
            await consume_once(js, sub, ConversationTurn, write, "held turn", batch=16, timeout_s=1.0)
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # connection already closing
            pass
