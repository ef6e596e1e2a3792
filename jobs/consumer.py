"""The JetStream-to-Postgres step both durable writers share: fetch, decode, write in one go, then ack.

A message is acked only after its write committed, so a crash or a Postgres outage redelivers it (the writes are
idempotent per request id). What no retry can ever write goes to the dead-letter stream (``llm.dead.<what>``,
with the reason in a header) and is terminated, with a log line, and the writer goes on: a message that cannot be
decoded, and a record the write refuses on its own (a value Postgres rejects, a date out of range). When a batch
fails for a reason other than the connection, each record is written alone to find the ones at fault; a writer
with a ``salvage`` writes what can be kept of such a record (the usage writer: the tokens, tenant and model, so a
served request is billed however odd its other fields) and keeps the original among the dead letters.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
from nats.errors import TimeoutError as NatsTimeoutError

from switchyard.domain.database import OUTAGE_ERRORS
from switchyard.shared import subjects
from switchyard.shared.messages import decode

log = logging.getLogger("switchyard.jobs")

T = TypeVar("T", bound=msgspec.Struct)

REDELIVER_DELAY_S = 2.0
# Failures of the database, not of a record (a server shutting down mid-write included): the records wait for it
# (redelivered), none is given up on.
TRANSIENT_ERRORS = OUTAGE_ERRORS


async def consume_once(js, sub, struct: type[T], write: Callable[[list[T]], Awaitable[None]], what: str,
                       batch: int, timeout_s: float, salvage: Callable[[T], T] | None = None) -> None:
    """One round on the pull subscription ``sub``: up to ``batch`` messages of type ``struct``, written by
    ``write``; nothing when none came within ``timeout_s``. ``js`` publishes dead letters. ``salvage``: what of a
    record the write refuses on its own can still be written."""
    try:
        msgs = await sub.fetch(batch=batch, timeout=timeout_s)
    except (TimeoutError, NatsTimeoutError):
        return
    records, good = [], []
    for msg in msgs:
        try:
            records.append(decode(msg.data, struct))
            good.append(msg)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            await _dead_letter(js, msg, what, exc)
    if not good:
        return
    try:
        await write(records)
    except TRANSIENT_ERRORS as exc:
        log.warning("could not write %d %ss (%s); they will be redelivered", len(good), what, exc)
        for msg in good:
            await msg.nak(delay=REDELIVER_DELAY_S)
        return
    except Exception as exc:  # some record is at fault: find it, write the others
        log.warning("writing %d %ss failed (%r): writing each alone", len(good), what, exc)
        for record, msg in zip(records, good):
            try:
                await write([record])
            except TRANSIENT_ERRORS:
                await msg.nak(delay=REDELIVER_DELAY_S)
            except Exception as one_exc:
                await _refused(js, msg, what, one_exc, record, write, salvage)
            else:
                await msg.ack()
        return
    for msg in good:
        await msg.ack()


async def _refused(js, msg, what: str, exc: BaseException, record, write, salvage) -> None:
    """A record the write refuses on its own: its salvage written (when there is one and it goes in), and the
    original kept among the dead letters either way."""
    if salvage is not None:
        try:
            await write([salvage(record)])
        except TRANSIENT_ERRORS:
            await msg.nak(delay=REDELIVER_DELAY_S)  # the database went away meanwhile: the whole record again later
            return
        except Exception as salvage_exc:
            log.error("%s at seq %s: even its salvage was refused (%r)", what, msg.metadata.sequence.stream,
                      salvage_exc)
        else:
            log.error("%s at seq %s was refused (%r): what could be kept of it was written", what,
                      msg.metadata.sequence.stream, exc)
            exc = SalvagedRecord(exc)
    await _dead_letter(js, msg, what, exc)


class SalvagedRecord(Exception):
    """The dead letter's reason when the record's salvage was written: ``Switchyard-Error`` says both."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"written salvaged after {cause!r}")


async def _dead_letter(js, msg, what: str, exc: BaseException) -> None:
    """Keep ``msg`` on the dead-letter stream with why, then terminate it; if NATS cannot take it now, it is
    redelivered instead (never dropped)."""
    seq = msg.metadata.sequence.stream
    log.error("%s at seq %s cannot be written (%r): moved to %s", what, seq, exc,
              subjects.dead_letter_subject(what))
    try:
        await js.publish(subjects.dead_letter_subject(what), msg.data, headers={
            "Nats-Msg-Id": f"{msg.metadata.stream}.{seq}", "Switchyard-Error": repr(exc)[:1000],
            "Switchyard-Subject": msg.subject})
    except Exception as publish_exc:
        log.warning("could not publish the dead letter (%s); it will be redelivered", publish_exc)
        await msg.nak(delay=REDELIVER_DELAY_S)
        return
    await msg.term()
