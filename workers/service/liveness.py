"""A worker's liveness: how the gateways and operators know it is there and what it does.

    heartbeat  every heartbeat_s, and at once after a reconnect ──▶ KV workers/<model>.<worker_id>: WorkerInfo
               (which model, what runs per tier, step counters); the bucket made again if a restart lost it
    pings      every ALIVE_INTERVAL_S ──▶ llm.alive.<worker_id>, its body the seats free now (a relay whose worker
               is silent for 3 s ends its stream, gateway/liveness.py; a hedge goes where a seat is free,
               gateway/hedging.py), and pulled-but-not-started requests marked in progress
    state      a one-line summary logged whenever it changes: what an operator (or a failing test's log) needs to
               see a stall

Both go on through a drain: a draining worker still serves its model, and the batch runner must not take its
running lines for lost. ``stop`` ends them and takes the worker out of the bucket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from nats.js.kv import KeyValue

from switchyard.shared import subjects
from switchyard.shared.jetstream import workers_bucket
from switchyard.shared.messages import WorkerInfo, encode
from switchyard.workers.service.waiting import first_of, set_within

log = logging.getLogger("switchyard.worker")

_RETRY_S = 0.5  # between heartbeats that fail


class Liveness:
    """See the module docstring. ``info`` makes the heartbeat's ``WorkerInfo``, ``state`` the summary line, and
    ``mark_in_progress`` marks the requests pulled but not started, ``free_seats`` counts the requests it could
    take now."""

    def __init__(self, nc, js, model_name: str, worker_id: str, heartbeat_s: float, nats_replicas: int,
                 info: Callable[[], WorkerInfo], state: Callable[[], str],
                 mark_in_progress: Callable[[], Awaitable[None]], free_seats: Callable[[], int] = lambda: 0) -> None:
        self._nc = nc
        self._js = js
        self._key = subjects.worker_key(model_name, worker_id)
        self._alive_subject = subjects.alive_subject(worker_id)
        self._heartbeat_s = heartbeat_s
        self._nats_replicas = nats_replicas
        self._info = info
        self._state = state
        self._mark_in_progress = mark_in_progress
        self._free_seats = free_seats
        self.reconnected = asyncio.Event()  # set by the NATS client's reconnect callback
        self._done = asyncio.Event()
        self._kv: KeyValue | None = None  # the heartbeat bucket, opened by start
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Beat once (so the worker is listed before it pulls), then keep beating and pinging."""
        self._kv = await workers_bucket(self._js)
        await self._beat()
        self._tasks = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self._alive_loop())]

    async def stop(self) -> None:
        self._done.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._kv is not None:
            with contextlib.suppress(Exception):
                await self._kv.delete(self._key)

    async def beat_on(self, event: asyncio.Event) -> None:
        """Beat as soon as ``event`` is set (a drain: the gateways should know before the next heartbeat)."""
        await event.wait()
        with contextlib.suppress(Exception):  # NATS away: the next heartbeat says it
            await self._beat()

    async def _beat(self) -> None:
        assert self._kv is not None  # opened by start before the first beat
        await self._kv.put(self._key, encode(self._info()))

    async def _try_beat(self, warn: bool) -> bool:
        """Beat, opening the bucket again if the first try fails; False if both fail (``warn``: log the first)."""
        try:
            await self._beat()
            return True
        except Exception as exc:  # the bucket gone with a restarted server, or NATS still reconnecting
            if warn:
                log.warning("heartbeat failed: %s", exc)
        try:
            self._kv = await workers_bucket(self._js, self._nats_replicas)
            await self._beat()
            return True
        except Exception:  # a stream without a leader yet: the next try, soon
            return False

    async def _alive_loop(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # NATS away: the gateways' relays time out on their own
                await self._nc.publish(self._alive_subject, str(max(0, self._free_seats())).encode())
                await self._mark_in_progress()
            if await set_within(self._done, subjects.ALIVE_INTERVAL_S):
                return

    async def _heartbeat_loop(self) -> None:
        """Beat every ``heartbeat_s``, and at once after a reconnect: a restarted NATS lost the in-memory bucket
        (made again if need be), and the gateways list this worker only while its pings come, until it beats."""
        last_state, beaten = "", True
        while True:
            # After a failed beat, try again soon: the entry may be about to expire (or gone), and until it is
            # back only this worker's pings keep it listed.
            wait_s = self._heartbeat_s if beaten else min(self._heartbeat_s, _RETRY_S)
            await first_of(self._done, self.reconnected, timeout=wait_s)
            if self._done.is_set():
                return
            self.reconnected.clear()
            beaten = await self._try_beat(warn=beaten)
            state = self._state()
            if state != last_state:
                log.info("state: %s", state)
                last_state = state
