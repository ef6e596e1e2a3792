"""The JetStream-to-Postgres step both durable writers share: fetch, decode, write in one go, then ack.

A message is acked only after its write committed, so a crash or a Postgres outage redelivers it (the writes are
idempotent per request id); a message that cannot be decoded is terminated, since no retry can ever write it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import asyncpg
import msgspec
from nats.errors import TimeoutError as NatsTimeoutError

from switchyard.shared.messages import decode

log = logging.getLogger("switchyard.jobs")

T = TypeVar("T")

REDELIVER_DELAY_S = 2.0


async def consume_once(sub, struct: type[T], write: Callable[[list[T]], Awaitable[None]], what: str,
                       batch: int, timeout_s: float) -> None:
    """One round on the pull subscription ``sub``: up to ``batch`` messages of type ``struct``, written by
    ``write``; nothing when none came within ``timeout_s``."""
    try:
        msgs = await sub.fetch(batch=batch, timeout=timeout_s)
    except (NatsTimeoutError, asyncio.TimeoutError):
        return
    records, good = [], []
    for msg in msgs:
        try:
            records.append(decode(msg.data, struct))
            good.append(msg)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.error("dropping a malformed %s at seq %s", what, msg.metadata.sequence.stream)
            await msg.term()
    try:
        await write(records)
    except (OSError, asyncpg.PostgresError) as exc:
        log.warning("could not write %d %ss (%s); they will be redelivered", len(good), what, exc)
        for msg in good:
            await msg.nak(delay=REDELIVER_DELAY_S)
        return
    for msg in good:
        await msg.ack()
