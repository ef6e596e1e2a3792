"""A request's token subject (``llm.tok.<request_id>``) received into a queue of its own.

nats-py's ``Subscription.next_msg`` makes a task and a ``wait_for`` for every message: at thousands of streams
that was a fifth of the gateway's time (bench/streams.py's profile). Here the subscription's callback drops each
message into an ``asyncio.Queue``; a reader takes what is there without waiting, and waits (with a timeout, no
task) only when nothing is. ``pending`` lets a stream write every chunk that is already here in one go.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg


class TokenInbox:
    """See the module docstring. Made with ``subscribe``; ``close`` unsubscribes."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._sub = None

    @classmethod
    async def subscribe(cls, nc: NATS, subject: str) -> TokenInbox:
        inbox = cls()
        inbox._sub = await nc.subscribe(subject, cb=inbox._received)
        return inbox

    async def _received(self, msg: Msg) -> None:
        self._queue.put_nowait(msg)

    @property
    def pending(self) -> int:
        """Messages received and not taken yet."""
        return self._queue.qsize()

    async def next(self, timeout: float) -> Msg:
        """The next message; raises ``TimeoutError`` when none comes within ``timeout`` seconds."""
        if self._queue.qsize():
            return self._queue.get_nowait()
        async with asyncio.timeout(timeout):
            return await self._queue.get()

    async def close(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()
