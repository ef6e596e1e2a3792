"""Waiting on asyncio events with a time limit: the worker's parts wake each other with events (work arrived,
seats freed, the intake went idle) and never wait on one for ever."""

from __future__ import annotations

import asyncio
import contextlib


async def set_within(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event``; whether it is set."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)
    return event.is_set()


async def first_of(*events: asyncio.Event, timeout: float | None = None) -> None:
    """Wait until any of ``events`` is set, or ``timeout`` seconds (None: no limit)."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
