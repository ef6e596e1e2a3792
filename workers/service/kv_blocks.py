"""KV blocks between nodes: this node's tiers served to workers elsewhere, and theirs fetched, by NATS request-reply.

    node B's engine (its loader thread)                        any worker of node A (its event loop)
    fetch(A, layout, scope, hashes) ──llm.kvblk.<model>.<A> [layout, scope, hash, offset]──▶ the block file,
                                                                                          as A's tiers hold it
                            ◀──── 8-byte file size, then bytes [offset, offset + a message) ─────
    up to WINDOW blocks in flight; a block larger than a NATS message comes in several replies

A node's workers answer in one queue group: its tiers are theirs in common, so any of them may. No responder (the
node is gone), a timeout, a size that changes mid-block, or the fetch's time budget spent (twice what computing the
blocks would take) ends the fetch at that block, and the engine computes the rest, as after any miss.

The engine checks every block it receives (CRC, hash, token ids) before it loads or keeps it: a wrong answer costs
a recompute, never a wrong token. The layout (weights, dtype, block shape) travels with the request, and a node of
another layout has nothing to give. The scope (a cache salt's digest) travels with every request and the block hash
is salted, so a request names one tenant's block and no other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import struct
import time

import msgspec

from switchyard.shared import subjects
from switchyard.shared.kv_events import HASH_BYTES, blocks_subject
from switchyard.workers.serving.interface import BlockReader

log = logging.getLogger("switchyard.worker")

WINDOW = 4  # blocks asked for at once
_SIZE = struct.Struct("<Q")
_SCOPE = re.compile(r"[0-9a-f]{16}")  # workers/kv_tiers/file_tier.scope_dir: never a path of another shape


class KVBlockExchange:
    """Serves this node's blocks and fetches other nodes' for one worker (see the module docstring); the engine
    holds it as its ``KVPeers`` (workers/kv_tiers/remote.py)."""

    def __init__(self, nc, model: str, node: str, timeout_s: float = 2.0, chunk_bytes: int | None = None) -> None:
        """``chunk_bytes``: the most file bytes a reply carries (None: what the NATS server allows a message, less
        the size header)."""
        self.node = node
        self._nc = nc
        self._model = subjects.model_token(model)
        self._read: BlockReader | None = None
        self._timeout_s = timeout_s
        self._chunk_bytes = chunk_bytes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sub = None
        self.num_served = 0  # block files (or parts of them) sent to other nodes

    async def start(self, read: BlockReader) -> None:
        """Serve this node's blocks through ``read`` (the engine's, from ``connect_kv_peers``), and fetch."""
        self._read = read
        self._loop = asyncio.get_running_loop()
        self._sub = await self._nc.subscribe(blocks_subject(self._model, self.node), queue="kvblk", cb=self._serve)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    # -- serving this node's blocks -----------------------------------------------------------------------
    async def _serve(self, msg) -> None:
        try:
            layout, scope, packed, offset = msgspec.msgpack.decode(msg.data, type=tuple[str, str, bytes, int])
        except (msgspec.DecodeError, msgspec.ValidationError):
            layout, scope, packed, offset = "", "", b"", 0
        data = None
        if self._read is not None and _SCOPE.fullmatch(scope) and len(packed) == HASH_BYTES and offset >= 0:
            data = await asyncio.to_thread(self._read, layout, scope, int.from_bytes(packed, "little"))
        if not data or offset >= len(data):
            reply = _SIZE.pack(0)  # not here (or a request of another shape): the asker computes it
        else:
            chunk = self._chunk_bytes or self._nc.max_payload - _SIZE.size - 1024
            reply = _SIZE.pack(len(data)) + bytes(memoryview(data)[offset:offset + chunk])
            self.num_served += 1
        with contextlib.suppress(Exception):  # the asker gave up meanwhile, or NATS is away: it times out
            await self._nc.publish(msg.reply, reply)

    # -- fetching another node's --------------------------------------------------------------------------
    def fetch(self, node: str, layout: str, scope: str, block_hashes: list[int], budget_s: float,
              ) -> list[bytes | None]:
        """``KVPeers.fetch``: called from the engine's loader thread, run on the worker's event loop."""
        if self._loop is None or not block_hashes:
            return [None] * len(block_hashes)
        deadline = time.monotonic() + budget_s
        future = asyncio.run_coroutine_threadsafe(self._fetch_all(node, layout, scope, block_hashes, deadline),
                                                  self._loop)
        try:
            # Past the budget no block is asked for, and those asked for answer or time out within timeout_s.
            return future.result(timeout=budget_s + 2 * self._timeout_s + 1)
        except Exception as exc:
            future.cancel()
            log.warning("KV blocks from node %s not fetched: %r", node, exc)
            return [None] * len(block_hashes)

    async def _fetch_all(self, node: str, layout: str, scope: str, block_hashes: list[int], deadline: float,
                         ) -> list[bytes | None]:
        subject = blocks_subject(self._model, node)
        results: list[bytes | None] = [None] * len(block_hashes)
        window = asyncio.Semaphore(WINDOW)
        failed = asyncio.Event()

        async def one(i: int, block_hash: int) -> None:
            async with window:
                if failed.is_set() or time.monotonic() > deadline:
                    failed.set()
                    return
                results[i] = await self._fetch_one(subject, layout, scope, block_hash)
                if results[i] is None:
                    failed.set()

        await asyncio.gather(*(one(i, h) for i, h in enumerate(block_hashes)))
        if None in results:  # a chain ends at its first missing block
            cut = results.index(None)
            results[cut:] = [None] * (len(results) - cut)
        return results

    async def _fetch_one(self, subject: str, layout: str, scope: str, block_hash: int) -> bytes | None:
        parts: list[bytes] = []
        offset, size = 0, None
        while size is None or offset < size:
            request = msgspec.msgpack.encode((layout, scope, block_hash.to_bytes(HASH_BYTES, "little"), offset))
            try:
                reply = await self._nc.request(subject, request, timeout=self._timeout_s)
            except Exception as exc:  # no responders (the node is gone), a timeout, NATS away
                log.debug("KV block %032x not fetched: %r", block_hash, exc)
                return None
            if len(reply.data) < _SIZE.size:
                return None
            (total,) = _SIZE.unpack_from(reply.data)
            chunk = reply.data[_SIZE.size:]
            if total == 0 or (size is not None and total != size) or not chunk:
                return None  # not there, or replaced mid-block by another copy: computed instead
            size = total
            parts.append(chunk)
            offset += len(chunk)
        return b"".join(parts)
