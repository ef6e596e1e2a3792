"""An engine's tiers below its pool: a host tier (tmpfs) demoting to a disk tier, with a writer and a loader thread.

    step thread                           writer thread                       loader thread
    store(blocks, host copy) ──queue──▶ encode, put in host (full: demote     start_load(chain) ──queue──▶ read host,
      (a block registered in the pool)   its least valuable to disk)            else disk, else (given a node that
                                                                               holds the rest) fetch from it and keep
                                                                               it here; verify; stop at the first
                                                                               miss ──▶ take_loaded() on the step thread

Neither thread holds the step up: a store the writer cannot keep up with is dropped (the block is only not kept),
unless the tiers are the way the KV leaves (a prefill worker's, ``wait_when_behind``: the step then waits for the
writer), and a prefix is imported into the pool by the step only once it has been read and verified whole. Every
failure below the pool (a corrupt file, a full disk, a tier directory gone) ends as a recompute and a counter.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch

from switchyard.workers.kv_tiers.block_file import BlockLayout, CorruptBlock, decode_block, encode_block
from switchyard.workers.kv_tiers.file_tier import FileTier, TierFull, scope_dir
from switchyard.workers.kv_tiers.remote import KVPeers, TransferCost

log = logging.getLogger("switchyard.kv_tiers")

_MAX_PENDING_BYTES = 256 * 2**20  # stores queued for the writer past this are dropped, never waited for


@dataclass(frozen=True, slots=True)
class TierSettings:
    """Where the tiers live and how large they are (0 bytes: that tier is off)."""

    host_dir: Path | None = None
    host_bytes: int = 0
    disk_dir: Path | None = None
    disk_bytes: int = 0
    scope_share: float = 0.5  # of a tier, the most one cache salt (tenant) may hold
    # A store the writer is too far behind to take waits (the step with it) instead of being dropped: a prefill
    # worker's blocks are its handovers, and one dropped is computed again by the decode worker.
    wait_when_behind: bool = False

    @property
    def enabled(self) -> bool:
        return bool((self.host_dir and self.host_bytes) or (self.disk_dir and self.disk_bytes))


@dataclass(frozen=True, slots=True)
class RemoteSource:
    """Another node whose tiers hold the blocks of a load up to (not including) ``upto``, counted in the blocks
    given to ``start_load`` (what the gateway's index said, ``GenerateRequest.kv_source``)."""

    node: str
    upto: int


@dataclass(slots=True)
class _Load:
    key: str
    scope: str
    blocks: list[tuple[int, tuple[int, ...]]]  # from the first block the pool lacks
    remote: RemoteSource | None  # blocks past the local tiers' come from there, up to remote.upto of ``blocks``


class KVTierStats(msgspec.Struct, frozen=True):
    """One tier's size and counters since start (this process's), for metrics."""

    tier: str  # host, disk
    capacity_bytes: int
    used_bytes: int
    blocks: int
    hits: int
    misses: int
    stores: int
    evictions: int
    corrupt: int
    write_errors: int
    dropped: int = 0  # stores the writer was too far behind to take (host tier, or disk when there is no host)


@dataclass(slots=True)
class LoadedPrefix:
    """A request's prefix read back from the tiers, from the first block the pool lacked up to the first miss:
    ``blocks[i]`` is ``(block_hash, token_ids)`` and row ``i`` of ``kv`` its K and V as bytes (``BlockLayout.shape``
    in its dtype), gathered here so the step thread copies them into the pool in one go."""

    key: str
    blocks: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    kv: torch.Tensor | None = None  # uint8, [len(blocks), payload bytes]; on the device once staged
    ready: Any = None  # the staging copy's CUDA event (``to_device``), None where there is none


@dataclass(slots=True)
class _Store:
    scope: str
    blocks: list[tuple[int, tuple[int, ...]]]
    payloads: Callable[[], list[memoryview]]  # waits for the device copy on CUDA; called on the writer thread
    nbytes: int


class KVTiers:
    """The host and disk tiers of one engine (see the module docstring)."""

    def __init__(self, settings: TierSettings, layout: BlockLayout, record_events: bool = False,
                 pin_memory: bool = False,
                 to_device: Callable[[torch.Tensor], tuple[torch.Tensor, Any]] | None = None) -> None:
        """``record_events``: keep what this process writes and removes per tier (``take_events``); ``pin_memory``:
        gather loaded blocks in pinned memory; ``to_device``: start their copy to the device as soon as they are
        gathered, on the loader thread (a CUDA engine's copy stream: ``ModelRunner.blocks_to_device``)."""
        self.layout = layout
        self._pin_memory = pin_memory
        self._to_device = to_device
        self.disk: FileTier | None = None
        self.host: FileTier | None = None
        if settings.disk_dir and settings.disk_bytes:
            self.disk = FileTier("disk", settings.disk_dir / layout.key, settings.disk_bytes, settings.scope_share,
                                 record_events=record_events)
        if settings.host_dir and settings.host_bytes:
            self.host = FileTier("host", settings.host_dir / layout.key, settings.host_bytes, settings.scope_share,
                                 demote=self._demote if self.disk is not None else None, record_events=record_events)
        self._tiers = [t for t in (self.host, self.disk) if t is not None]
        self._top = self._tiers[0]
        self._stores: queue.SimpleQueue[_Store | None] = queue.SimpleQueue()
        self._pending_bytes = 0
        self._pending_lock = threading.Condition()
        self._wait_when_behind = settings.wait_when_behind
        self._dropped = 0
        self._loads: queue.SimpleQueue[_Load | None] = queue.SimpleQueue()
        self.peers: KVPeers | None = None  # other nodes' tiers, when the worker connects them (remote.py)
        self.cost = TransferCost()
        self._remote_corrupt = 0
        self._loaded: list[LoadedPrefix] = []
        self._loaded_lock = threading.Lock()
        self._corrupt_seen = False  # the loader's last read found a damaged block
        self.load_ready = threading.Event()  # set when take_loaded has something
        self._threads = [threading.Thread(target=self._write_loop, name="switchyard-kv-writer", daemon=True),
                         threading.Thread(target=self._load_loop, name="switchyard-kv-loader", daemon=True)]
        for t in self._threads:
            t.start()
        log.info("KV tiers: %s (blocks of %d bytes)", ", ".join(
            f"{t.name} {t.capacity_bytes / 2**30:.1f} GiB at {t.root} ({t.num_blocks} blocks there)"
            for t in self._tiers), layout.block_bytes)

    # -- the step thread's side ---------------------------------------------------------------------------
    def holds(self, salt: str, block_hash: int) -> bool:
        """Whether some tier holds this block (a cheap check before queueing a load)."""
        scope = scope_dir(salt)
        return any(t.contains(scope, block_hash) for t in self._tiers)

    def store(self, salt: str, blocks: list[tuple[int, tuple[int, ...]]],
              payloads: Callable[[], list[memoryview]]) -> None:
        """Keep these blocks (hash, token ids) below the pool; ``payloads()`` gives their K and V on the writer
        thread. Dropped, not waited for, when the writer is too far behind."""
        nbytes = len(blocks) * self.layout.payload_bytes
        with self._pending_lock:
            if self._wait_when_behind:  # (a store larger than the cap alone goes once the queue is empty)
                self._pending_lock.wait_for(lambda: not self._pending_bytes
                                            or self._pending_bytes + nbytes <= _MAX_PENDING_BYTES)
            elif self._pending_bytes + nbytes > _MAX_PENDING_BYTES:
                self._dropped += len(blocks)
                return
            self._pending_bytes += nbytes
        self._stores.put(_Store(scope_dir(salt), blocks, payloads, nbytes))

    def start_load(self, key: str, salt: str, blocks: list[tuple[int, tuple[int, ...]]],
                   remote: RemoteSource | None = None) -> None:
        """Read these blocks (a prefix chain, in order) from the tiers, and past them from ``remote`` (through
        ``peers``); the result comes out of ``take_loaded``."""
        self._loads.put(_Load(key, scope_dir(salt), blocks, remote if self.peers is not None else None))

    def read_block(self, layout: str, scope: str, block_hash: int) -> bytes | bytearray | None:
        """A block file as this node's tiers hold it, unchecked (the node that asked for it checks it), for
        serving another node of the same ``layout`` (``BlockLayout.key``); any thread."""
        if layout != self.layout.key:
            return None
        for tier in self._tiers:
            if (data := tier.get(scope, block_hash)) is not None:
                return data
        return None

    def take_loaded(self) -> list[LoadedPrefix]:
        with self._loaded_lock:
            loaded, self._loaded = self._loaded, []
            self.load_ready.clear()
        return loaded

    def written(self) -> threading.Event:
        """An event set once every store queued so far is written (or dropped): what another worker may read
        then is all there."""
        done = threading.Event()

        def mark() -> list[memoryview]:
            done.set()
            return []

        self._stores.put(_Store("", [], mark, 0))
        return done

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every store queued so far is written (or dropped); False on timeout. For tests and
        benchmarks that need a tier's content settled, and for shutdown."""
        return self.written().wait(timeout)

    def take_events(self) -> dict[str, tuple[list[int], list[int]]]:
        """Per tier, the blocks this process wrote and removed since the last call."""
        return {t.name: t.take_events() for t in self._tiers}

    def listing(self) -> dict[str, list[int]]:
        """Per tier, every block it holds as far as this process knows."""
        return {t.name: t.listing() for t in self._tiers}

    def stats(self) -> list[KVTierStats]:
        out = []
        for t in self._tiers:
            c = t.counters
            out.append(KVTierStats(t.name, t.capacity_bytes, t.used_bytes, t.num_blocks, c.hits, c.misses, c.stores,
                                   c.evictions, c.corrupt, c.write_errors, self._dropped if t is self._top else 0))
        if self.peers is not None:  # other nodes' tiers: blocks fetched, and loads declined as dearer than compute
            out.append(KVTierStats("remote", 0, 0, 0, self.cost.num_fetched, self.cost.num_declined, 0, 0,
                                   self._remote_corrupt, 0))
        return out

    def close(self) -> None:
        """Stop both threads after what they have queued (the files stay: they are the tier)."""
        self._stores.put(None)
        self._loads.put(None)
        for t in self._threads:
            t.join(timeout=30)

    # -- the writer ---------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while (job := self._stores.get()) is not None:
            try:
                self._write(job)
            except Exception:
                log.exception("KV tier write failed")
            finally:
                with self._pending_lock:
                    self._pending_bytes -= job.nbytes
                    self._pending_lock.notify_all()

    def _write(self, job: _Store) -> None:
        payloads = job.payloads()
        for (block_hash, token_ids), payload in zip(job.blocks, payloads):
            if any(t.contains(job.scope, block_hash) for t in self._tiers):
                continue  # computed again after an eviction from the pool, or another worker's already
            self._put(self._top, job.scope, block_hash, encode_block(block_hash, token_ids, payload))

    def _demote(self, block_hash: int, scope: str, data: bytes) -> None:
        assert self.disk is not None
        self._put(self.disk, scope, block_hash, data)

    def _put(self, tier: FileTier, scope: str, block_hash: int, data: bytes | tuple[bytes | memoryview, ...]) -> None:
        try:
            tier.put(scope, block_hash, data)
        except TierFull as exc:
            tier.warn(f"a block was not kept: {exc}")  # counted in write_errors; the block is recomputed when needed

    # -- the loader ---------------------------------------------------------------------------------------
    def _load_loop(self) -> None:
        while (job := self._loads.get()) is not None:
            scope, blocks = job.scope, job.blocks
            loaded = LoadedPrefix(job.key)
            try:
                kv = torch.empty((len(blocks), self.layout.payload_bytes), dtype=torch.uint8,
                                 pin_memory=self._pin_memory)
                for i, (block_hash, token_ids) in enumerate(blocks):
                    payload = self._read(scope, block_hash, token_ids)
                    if payload is None:
                        if self._corrupt_seen:
                            self._sweep(scope, blocks[i + 1:])
                        elif job.remote is not None and i < job.remote.upto:
                            self._fetch(job, i, kv, loaded)
                        break
                    kv[i].copy_(torch.frombuffer(payload, dtype=torch.uint8))
                    loaded.blocks.append((block_hash, token_ids))
                loaded.kv = kv[: len(loaded.blocks)]
                if self._to_device is not None and loaded.blocks:
                    loaded.kv, loaded.ready = self._to_device(loaded.kv)
            except Exception:
                loaded.blocks.clear()
                log.exception("KV tier load failed; the prefix is computed instead")
            with self._loaded_lock:
                self._loaded.append(loaded)
                self.load_ready.set()

    def _fetch(self, job: _Load, start: int, kv: torch.Tensor, loaded: LoadedPrefix) -> None:
        """Blocks ``start`` up to ``job.remote.upto`` from the node holding them: each checked as a local read is,
        kept in this node's top tier (its other workers find it there, and the index hears of it), and loaded;
        the first one missing or damaged ends the load (the rest is computed)."""
        assert job.remote is not None and self.peers is not None
        wanted = job.blocks[start:job.remote.upto]
        t0 = time.monotonic()
        budget = self.cost.budget_s(len(wanted), self.layout.block_size)
        files = self.peers.fetch(job.remote.node, self.layout.key, job.scope, [h for h, _ in wanted], budget)
        received = [f for f in files if f is not None]
        self.cost.note_transfer(len(received), sum(len(f) for f in received), time.monotonic() - t0)
        for i, ((block_hash, token_ids), data) in enumerate(zip(wanted, files), start):
            if data is None:
                return
            try:  # writable, as a file read is: a tensor is made over it without a copy
                payload = decode_block(bytearray(data), block_hash, token_ids, self.layout.payload_bytes)
            except CorruptBlock as exc:
                self._top.warn(f"block {block_hash:032x} from node {job.remote.node} is corrupt ({exc}): recomputed")
                self._remote_corrupt += 1
                return
            kv[i].copy_(torch.frombuffer(payload, dtype=torch.uint8))
            loaded.blocks.append((block_hash, token_ids))
            self._put(self._top, job.scope, block_hash, data)

    def _sweep(self, scope: str, blocks: list[tuple[int, tuple[int, ...]]]) -> None:
        """A block of a chain was corrupt: check the rest of the chain too, so that every damaged block is removed
        now and the recompute that follows writes all of them again (a damaged file left in place would keep its
        block from being written, and fail every later load at the same point)."""
        for block_hash, token_ids in blocks:
            self._read(scope, block_hash, token_ids)

    def _read(self, scope: str, block_hash: int, token_ids: tuple[int, ...]) -> memoryview | None:
        self._corrupt_seen = False
        for tier in self._tiers:
            data = tier.get(scope, block_hash)
            if data is None:
                continue
            try:
                return decode_block(data, block_hash, token_ids, self.layout.payload_bytes)
            except CorruptBlock as exc:
                tier.warn(f"block {block_hash:032x} is corrupt ({exc}): removed, recomputed")
                tier.remove_corrupt(scope, block_hash)
                self._corrupt_seen = True
        return None


def describe(stats: list[KVTierStats]) -> dict[str, Any]:
    """Tier stats as plain data (benchmarks print it)."""
    return {s.tier: msgspec.structs.asdict(s) for s in stats}
