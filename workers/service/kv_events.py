"""A worker's KV events: after each step, what its KV cache gained and lost, out on ``llm.kv.<model>``.

    step thread: engine.take_kv_changes() ──▶ StepResult ──▶ publish() ──▶ KVEventBatch (core NATS, seq + 1)
    every second with nothing else to say ──▶ an empty batch: the worker's load, and proof that no batch was lost
    llm.kvsnap.<model> (a gateway starting, or one that saw a gap) ──▶ snapshot batches: everything held now

The wire format and the meaning of the tiers are shared/kv_events.py's. A snapshot larger than a NATS message is
sent in parts: the first replaces what the index knew of this worker, the rest add to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import socket
import time
import uuid
from pathlib import Path

import msgspec

from switchyard.shared import kv_events, subjects
from switchyard.shared.kv_events import KVEventBatch, pack_hashes
from switchyard.workers.serving.interface import EngineCapacity, ServingEngine
from switchyard.workers.serving.kv_changes import KVChanges

log = logging.getLogger("switchyard.worker")

HEARTBEAT_S = 1.0
_SNAPSHOT_PART_HASHES = 32_768  # 512 KiB of hashes a message, under NATS's default 1 MiB payload


def node_id(host_dir: Path | None, disk_dir: Path | None) -> str:
    """The host tiers' identity: the host and the tier directories, so only workers that really share a tier
    share a node (two systems on one machine, each with a tier of its own, are two nodes)."""
    where = repr((str(host_dir or ""), str(disk_dir or ""))).encode()
    return f"{socket.gethostname()}:{hashlib.blake2b(where, digest_size=6).hexdigest()}"


class KVEventPublisher:
    """Publishes one worker's KV events and answers snapshot requests (see the module docstring)."""

    def __init__(self, nc, engine: ServingEngine, model: str, worker_id: str, node: str, role: str = "both") -> None:
        self._nc = nc
        self._engine = engine
        self._subject = kv_events.events_subject(subjects.model_token(model))
        self._snapshot_subject = kv_events.snapshot_subject(subjects.model_token(model))
        self._worker_id = worker_id
        self._node = node
        self._role = role
        self._block_size = engine.kv_block_size  # the engine's own (vLLM's is not the worker's block_size)
        self._epoch = uuid.uuid4().hex[:8]
        self._seq = 0
        self._last_sent = 0.0
        self._load = (0.0, 0.0, 0)
        self._sent_load = 0.0  # the load (seats taken) in the last batch sent
        self._sub = None
        self._heartbeat: asyncio.Task | None = None

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self._snapshot_subject, cb=self._on_snapshot_request)
        self._heartbeat = asyncio.create_task(self._beat())
        await self._send(KVEventBatch(**self._head(), snapshot=True, **self._load_fields()))  # "I start empty"

    async def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def publish(self, changes: KVChanges | None, capacity: EngineCapacity | None) -> None:
        """One step's changes, or its load when a seat was taken or freed (a step that changed neither sends
        nothing: the heartbeat carries the rest of the load)."""
        if capacity is not None:
            seats = max(1, capacity.max_num_seqs)
            self._load = ((capacity.num_running + capacity.num_waiting) / seats, capacity.kv_cache_usage,
                          capacity.prefill_backlog_tokens)
        if changes is None or changes.is_empty:
            # A freed seat is news at once: the index leaves a full worker out, and a second's stale "full" after
            # a request ends would send its conversation's next turn elsewhere.
            if self._load[0] != self._sent_load:
                await self._send(KVEventBatch(**self._head(), **self._load_fields()))
            return
        await self._send(KVEventBatch(
            **self._head(), stored={t: pack_hashes(h) for t, h in changes.stored.items() if h},
            removed={t: pack_hashes(h) for t, h in changes.removed.items() if h}, prefixes=changes.prefixes,
            **self._load_fields()))

    async def _on_snapshot_request(self, _msg) -> None:
        listing = self._engine.kv_listing()
        held = [(tier, h) for tier, hashes in listing.items() for h in hashes]
        parts = [held[i:i + _SNAPSHOT_PART_HASHES] for i in range(0, len(held), _SNAPSHOT_PART_HASHES)] or [[]]
        for i, part in enumerate(parts):
            # The first part names every tier, empty ones too: it replaces what the index knew of each.
            by_tier: dict[str, list[int]] = {tier: [] for tier in listing} if i == 0 else {}
            for tier, h in part:
                by_tier.setdefault(tier, []).append(h)
            await self._send(KVEventBatch(**self._head(), stored={t: pack_hashes(hs) for t, hs in by_tier.items()},
                                          snapshot=i == 0, **self._load_fields()))

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S / 2)
            if time.monotonic() - self._last_sent >= HEARTBEAT_S:
                await self._send(KVEventBatch(**self._head(), **self._load_fields()))

    def _head(self) -> dict:
        self._seq += 1
        return {"worker_id": self._worker_id, "node": self._node, "epoch": self._epoch, "seq": self._seq,
                "block_size": self._block_size, "role": self._role}

    def _load_fields(self) -> dict:
        self._sent_load = self._load[0]
        return {"load": self._load[0], "kv_usage": self._load[1], "backlog_tokens": self._load[2]}

    async def _send(self, batch: KVEventBatch) -> None:
        self._last_sent = time.monotonic()
        try:
            await self._nc.publish(self._subject, msgspec.msgpack.encode(batch))
        except Exception as exc:  # NATS away: the index sees the gap in seq and asks for a snapshot
            log.debug("KV events not sent: %r", exc)
