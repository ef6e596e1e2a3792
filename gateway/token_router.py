"""Every relayed request's token deltas, through one subscription per gateway process.

    worker ── llm.tok.gw.<gateway_id>: one message per step, [(request_id, delta), ...] ──▶ TokenRouter
                                                                                           ├─▶ inbox of request a
                                                                                           └─▶ inbox of request b
One subscription per gateway, not one per request (``llm.tok.<request_id>``), which would make the worker, NATS and
this process handle a message per token, each parsed by nats-py and waking a queue of its own. A worker sends one
message per step to each gateway it serves, and the router hands each delta, still encoded, to its request's
inbox: a dict lookup and, when the reader waits, one wake-up. The reader decodes it on its own turn, and what
waits for a slow reader is counted in bytes (gateway/client_watch.py bounds it).

Every idle tick the router also says the gateway lives (``llm.gw.alive.<gateway_id>``): a worker whose stream's
gateway stops saying so keeps the stream for another gateway to take over (gateway/stream_resume.py).

A second ``open`` for a request this gateway already relays (its client resuming here, gateway/stream_resume.py)
routes its deltas to the new inbox; the one it displaced keeps its ticks, and is routed to again, with what the new
one received and nobody read, if the new one closes while it is still open (a take-over that failed must leave the
run it would have replaced as it was, not deaf).

An inbox is registered before its request is published, and the subscription exists from the gateway's start, so
no delta can come before there is somewhere for it to go. A delta for a request no longer relayed (its client left,
a superseded worker's late one) is dropped here.

A stream waits for each delta with no timer of its own: it only needs waking now and then when none comes (to ask
whether its worker still lives), and one tick of the router every ``IDLE_TICK_S`` wakes every such reader, where a
timer per wait would be made and cancelled for every token.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import uuid

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from switchyard.shared import nats_client, subjects
from switchyard.shared.messages import decode_routed

log = logging.getLogger("switchyard.gateway")

# How often a reader waiting with no timeout of its own is woken when nothing came: as often as a worker pings
# that it lives, so a silent stream asks after its worker at that pace.
IDLE_TICK_S = subjects.ALIVE_INTERVAL_S


class DeltaInbox:
    """One request's deltas, as encoded ``TokenDelta`` bytes in arrival order. Made with ``TokenRouter.open``;
    ``close`` stops its routing."""

    __slots__ = ("_router", "request_id", "_items", "pending_bytes", "_waiter", "_idle", "displaced")

    def __init__(self, router: TokenRouter, request_id: str, displaced: DeltaInbox | None = None) -> None:
        self._router = router
        self.request_id = request_id
        self.displaced = displaced  # the request's inbox this one replaced in routing, if any
        self._items: collections.deque = collections.deque()
        self.pending_bytes = 0  # the deltas received and not taken yet, in bytes
        self._waiter: asyncio.Future | None = None
        self._idle = False  # the reader waits for the next tick at most (no timer of its own)

    def put(self, data) -> None:
        self._items.append(data)
        self.pending_bytes += len(data)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def pending(self) -> int:
        """Deltas received and not taken yet."""
        return len(self._items)

    async def next(self, timeout: float | None = None):
        """The next delta's bytes; raises ``TimeoutError`` when none comes within ``timeout`` seconds (None: by the
        router's next idle tick, at most ``IDLE_TICK_S`` away)."""
        if not self._items:
            loop = self._router.loop
            assert loop is not None, "an inbox waits on a started router"
            self._waiter = waiter = loop.create_future()
            expiry = None if timeout is None else loop.call_later(timeout, _expire, waiter)
            self._idle = expiry is None
            try:
                await waiter
            finally:
                if expiry is not None:
                    expiry.cancel()
                self._waiter = None
            if not self._items:
                raise TimeoutError
        data = self._items.popleft()
        self.pending_bytes -= len(data)
        return data

    def tick(self) -> None:
        """The router's idle tick: a reader waiting with no timeout of its own is woken (and finds nothing)."""
        if self._idle and self._waiter is not None:
            _expire(self._waiter)

    def take_pending(self) -> list:
        """Every delta received and not taken yet, taken."""
        items = list(self._items)
        self._items.clear()
        self.pending_bytes = 0
        return items

    async def close(self) -> None:
        self._router.drop(self)


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class TokenRouter:
    """This gateway process's token subject and the inboxes of the requests it relays; ``start`` subscribes."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self.gateway_id = uuid.uuid4().hex
        self.subject = subjects.gateway_token_subject(self.gateway_id)  # this process's alone
        self._inboxes: dict[str, DeltaInbox] = {}  # request id -> the inbox its deltas go to
        self._open: set[DeltaInbox] = set()  # every inbox not closed, displaced ones too: each is ticked
        self._sub: Subscription | None = None
        self._ticking: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the inboxes' (read once here, not per wait)

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._sub = await self._nc.subscribe(self.subject, cb=self._route)
        await nats_client.settled(self._nc)  # the server has the subscription before any request names it
        self._ticking = self.loop.create_task(self._tick())

    async def _tick(self) -> None:
        alive = subjects.gateway_alive_subject(self.gateway_id)
        while True:
            with contextlib.suppress(Exception):  # NATS away: the workers judge this gateway by what they hear
                await self._nc.publish(alive, b"")
            await asyncio.sleep(IDLE_TICK_S)
            for inbox in list(self._open):
                inbox.tick()

    def open(self, request_id: str) -> DeltaInbox:
        """The inbox of ``request_id``'s deltas, from now until it is closed (one already open is displaced: see
        the module docstring)."""
        inbox = DeltaInbox(self, request_id, self._inboxes.get(request_id))
        self._inboxes[request_id] = inbox
        self._open.add(inbox)
        return inbox

    def inbox_of(self, request_id: str) -> DeltaInbox | None:
        """The inbox open for ``request_id``, if any (a second ``open`` replaces it in routing)."""
        return self._inboxes.get(request_id)

    def drop(self, inbox: DeltaInbox) -> None:
        self._open.discard(inbox)
        if self._inboxes.get(inbox.request_id) is not inbox:
            return
        del self._inboxes[inbox.request_id]
        displaced = inbox.displaced
        while displaced is not None and displaced not in self._open:
            displaced = displaced.displaced
        if displaced is not None:
            self._inboxes[inbox.request_id] = displaced
            for data in inbox.take_pending():
                displaced.put(data)

    @property
    def num_open(self) -> int:
        return len(self._inboxes)

    async def _route(self, msg) -> None:
        try:
            batch = decode_routed(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            # Whose deltas they were is unknown: each such request sees a gap at its next delta, or its worker's
            # silence, and ends (or goes on elsewhere) as after any lost message.
            log.error("an undecodable message (%d bytes) on this gateway's token subject; dropped", len(msg.data))
            return
        inboxes = self._inboxes
        for routed in batch:
            inbox = inboxes.get(routed.request_id)
            if inbox is not None:
                inbox.put(routed.delta)

    async def stop(self) -> None:
        if self._ticking is not None:
            self._ticking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticking
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:  # the connection may already be closing; nothing left to release then
                pass
