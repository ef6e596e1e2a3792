"""Writes held while Postgres was away (conversation turns, see domain/conversations.py; Responses API responses,
see domain/responses.py), written once it is back.

Like the billing writer: a record is acked only after its rows are committed, and rows whose ids come from the
request id are inserted with ON CONFLICT DO NOTHING (a response's row moves out of a final state never), so a
redelivery never writes twice and nothing is dropped. One durable consumer per kind of write.
"""

from __future__ import annotations

import asyncio

import asyncpg
from nats.js import JetStreamContext

from switchyard.domain.conversations import write_turn
from switchyard.domain.responses import write_response
from switchyard.jobs.consumer import consume_once
from switchyard.shared import subjects
from switchyard.shared.jetstream import ensure_held_writes_consumer
from switchyard.shared.messages import ConversationTurn, StoredResponse


async def run_held_writer(js: JetStreamContext, pool: asyncpg.Pool, stop: asyncio.Event) -> None:
    """Consume held turns and responses until ``stop`` is set; Postgres errors delay them (redelivered), never
    drop them."""
    kinds = ((subjects.HELD_TURN_SUBJECT, ConversationTurn, write_turn, "held turn"),
             (subjects.HELD_RESPONSE_SUBJECT, StoredResponse, write_response, "held response"))
    subs = []
    for subject, *_ in kinds:
        name = await ensure_held_writes_consumer(js, subject)
        subs.append(await js.pull_subscribe_bind(name, stream=subjects.HELD_WRITES_STREAM))

    def writer(write_one):
        async def write(records: list) -> None:
            for record in records:
                await write_one(pool, record)
        return write

    try:
        while not stop.is_set():
            for sub, (_, struct, write_one, what) in zip(subs, kinds):
                await consume_once(js, sub, struct, writer(write_one), what, batch=16, timeout_s=0.5)
    finally:
        for sub in subs:
            try:
                await sub.unsubscribe()
            except Exception:  # connection already closing
                pass
