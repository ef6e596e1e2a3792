"""Several prompts in one legacy completions request: one wire request per prompt, seen as one.

    prompt 0 ─▶ request <id>-p0 (n choices) ─┐
    prompt 1 ─▶ request <id>-p1 (n choices) ─┼─▶ MergedRelay: choices 0..n-1, n..2n-1, ... ; usage summed
    ...                                      ┘

Each prompt is its own request on the wire, so workers, failover and billing need nothing new (each part has
its usage row); the client gets OpenAI's one response whose choice ``p * n + i`` is prompt ``p``'s ``i``-th.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec

from switchyard.gateway.relayed_request import RelayedRequest
from switchyard.shared.messages import GenerateRequest, TokenDelta, Usage

MERGE_QUEUE = 64  # deltas merged ahead of the reader

class MergedRelay:
    """Relayed requests of the same client request, read as one with ``len(parts) * n`` choices."""

    def __init__(self, request: GenerateRequest, parts: list[RelayedRequest]) -> None:
        """``request``: what the client asked, as one request (its id, and n across every prompt)."""
        self.request = request
        self._parts = parts
        self._per_part = parts[0].request.sampling.n
        self._usage = [Usage() for _ in parts]
        self._queued: list[TokenDelta] = []  # the other parts' first messages, sent after the first's

    @property
    def is_finished(self) -> bool:
        return all(p.is_finished for p in self._parts)

    @property
    def next_delta_waits(self) -> bool:
        # Its parts are read by tasks of their own: until every part has finished, a chunk is written as it comes.
        return not self.is_finished

    def _rebased(self, part: int, delta: TokenDelta) -> TokenDelta:
        changes = {"index": part * self._per_part + delta.index, "request_id": self.request.request_id}
        if delta.usage is not None:
            self._usage[part] = delta.usage
            changes["usage"] = Usage(sum(u.prompt_tokens for u in self._usage),
                                     sum(u.completion_tokens for u in self._usage),
                                     sum(u.cached_tokens for u in self._usage))
        return msgspec.structs.replace(delta, **changes)

    async def first(self) -> TokenDelta:
        """Every part's first message (each may raise, as RelayedRequest.first does); returns the first part's."""
        firsts = await asyncio.gather(*(p.first() for p in self._parts), return_exceptions=True)
        failed = [f for f in firsts if isinstance(f, BaseException)]
        if failed:  # one prompt refused (too long, ...): the whole request is, and the others stop
            await self.cancel()
            raise failed[0]
        rebased = [self._rebased(i, d) for i, d in enumerate(firsts) if not isinstance(d, BaseException)]
        self._queued = rebased[1:]
        return rebased[0]

    async def deltas(self) -> AsyncIterator[TokenDelta]:
        for delta in self._queued:
            yield delta
        # Bounded: a reader that falls behind leaves the rest in the parts' subscriptions, where the stream's bound on
        # buffered bytes counts it (gateway/client_watch.py).
        merged: asyncio.Queue[tuple[int, TokenDelta] | None] = asyncio.Queue(maxsize=MERGE_QUEUE)

        async def pump(i: int, part: RelayedRequest) -> None:
            try:
                async for delta in part.deltas():
                    await merged.put((i, delta))
            except asyncio.CancelledError:
                raise  # the reader is gone: nobody waits for this part's end (and a full queue would never take it)
            except BaseException:
                await merged.put(None)
                raise
            await merged.put(None)

        pumps = [asyncio.create_task(pump(i, p)) for i, p in enumerate(self._parts)]
        try:
            running = len(pumps)
            while running:
                item = await merged.get()
                if item is None:
                    running -= 1
                    continue
                yield self._rebased(*item)
        finally:
            for task in pumps:
                task.cancel()
            for task in pumps:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    @property
    def buffered_bytes(self) -> int:
        """Deltas received and not yet read, in bytes, over every part."""
        return sum(p.buffered_bytes for p in self._parts)

    async def cancel(self) -> None:
        await asyncio.gather(*(p.cancel() for p in self._parts if not p.is_finished))

    async def close(self) -> None:
        await asyncio.gather(*(p.close() for p in self._parts))
