"""A worker's side of streams that outlive their gateway: it hears which gateways live, answers a gateway that
asks to take a stream over, and ends what no gateway will read (the bookkeeping is workers/service/stream_replay.py).

    llm.gw.alive.*   ──▶ StreamReplays.heard
    llm.resume.*     ──▶ Publisher.take_over: the owner's ask answered, the kept deltas resent to the asker
    every second     ──▶ StreamReplays.sweep: orphans past their window aborted (HeldRequests.abort: billed for
                         what ran, like a request whose client left)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec

from switchyard.shared import subjects
from switchyard.shared.messages import StreamResume, decode
from switchyard.workers.service.held import HeldRequests
from switchyard.workers.service.publisher import Publisher
from switchyard.workers.service.stream_replay import StreamReplays

log = logging.getLogger("switchyard.worker")


class StreamTakeover:
    """Subscriptions and the sweep of one worker's resumable streams; ``start`` then ``stop``."""

    def __init__(self, nc, replays: StreamReplays, publisher: Publisher, held: HeldRequests) -> None:
        self._nc = nc
        self._replays = replays
        self._publisher = publisher
        self._held = held
        self._subscriptions: list = []
        self._sweeping: asyncio.Task | None = None

    async def start(self) -> None:
        self._subscriptions = [
            await self._nc.subscribe(f"{subjects.GATEWAY_ALIVE_PREFIX}.*", cb=self._on_gateway_alive),
            await self._nc.subscribe(f"{subjects.RESUME_PREFIX}.*", cb=self._on_resume),
        ]
        self._sweeping = asyncio.create_task(self._sweep())

    async def _on_gateway_alive(self, msg) -> None:
        self._replays.heard(msg.subject.rsplit(".", 1)[-1], time.monotonic())

    async def _on_resume(self, msg) -> None:
        try:
            ask = decode(msg.data, StreamResume)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if not msg.reply:
            return
        try:
            await self._publisher.take_over(ask, msg.respond)
        except Exception:  # NATS away: the asking gateway times out and tells its client to retry
            log.exception("could not hand request %s's stream over", ask.request_id)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(subjects.ALIVE_INTERVAL_S)
            for request_id in self._replays.sweep(time.monotonic()):
                if self._held.holds(request_id):
                    log.warning("request %s: no gateway relays its stream and none took it over in time; "
                                "cancelled (billed for what ran)", request_id)
                    self._held.abort(request_id)

    async def stop(self) -> None:
        if self._sweeping is not None:
            self._sweeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeping
        for sub in self._subscriptions:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
