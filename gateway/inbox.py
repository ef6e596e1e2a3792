"""A request's token subject (``llm.tok.<request_id>``), read straight from its subscription's own queue.

nats-py's ``Subscription.next_msg`` makes a task and a ``wait_for`` for every message: at thousands of streams
that was a fifth of the gateway's time (bench/streams.py's profile). A subscription with a callback instead runs
a task of its own that wakes for every message to hand it on, a second wake-up per token besides the reader's.
Here the subscription has neither: nats-py puts each message in the subscription's queue, and the reader takes
what is there without waiting, and waits (with a timeout, no task) only when nothing is: one wake-up per message,
and none while the reader is busy writing. ``pending`` lets a stream write every chunk that is already here in one
go; ``pending_bytes`` is what a reader falling behind has left waiting (gateway/client_watch.py bounds it).

The queue and its byte count are nats-py's own (``Subscription._pending_queue``, ``_pending_size``, what its
``next_msg`` reads; 2.9 to 2.16 at least): ``tests/gateway/test_inbox.py`` fails if a release renames them.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription


class TokenInbox:
    """See the module docstring. Made with ``subscribe``; ``close`` unsubscribes."""

    def __init__(self, sub: Subscription) -> None:
        self._sub = sub
        self._queue: asyncio.Queue[Msg] = sub._pending_queue

    @classmethod
    async def subscribe(cls, nc: NATS, subject: str) -> TokenInbox:
        return cls(await nc.subscribe(subject))

    @property
    def pending(self) -> int:
        """Messages received and not taken yet."""
        return self._queue.qsize()

    @property
    def pending_bytes(self) -> int:
        """The payload bytes of the messages received and not taken yet."""
        return self._sub.pending_bytes

    def _taken(self, msg: Msg) -> Msg:
        self._sub._pending_size -= len(msg.data)  # as next_msg does: nats-py's slow-consumer bound reads it
        return msg

    async def next(self, timeout: float) -> Msg:
        """The next message; raises ``TimeoutError`` when none comes within ``timeout`` seconds."""
        if self._queue.qsize():
            return self._taken(self._queue.get_nowait())
        async with asyncio.timeout(timeout):
            return self._taken(await self._queue.get())

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            await sub.unsubscribe()
