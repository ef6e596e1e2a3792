"""The fleet's KV index: which worker (or which node's shared tiers) holds which block, from the workers' KV events,
and the worker a chat request should be offered to.

    llm.kv.<model> ──▶ on_batch: per model, block hash ─▶ the workers whose pool holds it
                                             block hash ─▶ node ─▶ host or disk (the node's shared tiers)
                                             message-prefix key ─▶ (parent key, its blocks)
                                             worker ─▶ node, load, last batch (a gap: ask for a snapshot)
    a request ──▶ its message-prefix keys (shared/kv_events.py) ─▶ the longest known prefix's blocks ─▶ each live
                  worker's cost, in blocks' worth of prefill: the blocks it would compute (its pool 0, its node's host
                  tier 0.1, disk tier 0.4, counted from the first block while it holds them; 1 each past that), plus
                  the prefill queued there already (its backlog, and what this gateway sent it since), plus its load
                  ─▶ the cheapest one, if it would save any
              ──▶ the node (a live worker's) whose tiers hold the longest run of the prefix, if any: named in the
                  request (``kv_source``), so whichever worker takes it, on another node, may fetch the blocks from
                  there rather than compute them (workers/kv_tiers/remote.py decides)

Lost or reordered events cost at most an offer that saves less than it promised: the worker verifies whatever it
loads by hash and tokens, and an offer to a busy worker falls back to the shared queue after ``affinity_wait_s``.
The index knows nothing until workers publish: a gateway starting asks every model's workers for a snapshot when
it first hears of them.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from switchyard.shared import subjects
from switchyard.shared.kv_events import (
    DISK,
    HOST,
    KV_EVENTS_PREFIX,
    POOL,
    KVEventBatch,
    request_prefix_keys,
    snapshot_subject,
    split_hashes,
)
from switchyard.shared.messages import GenerateRequest, KVSource

log = logging.getLogger("switchyard.gateway")

TIER_WEIGHTS = {POOL: 1.0, HOST: 0.9, DISK: 0.6}  # a block in a tier saves about this much of computing it
LOAD_BLOCKS = 1.0  # load (0: idle, 1: every seat taken) costs this many blocks' prefill: it breaks near-ties
SILENT_AFTER_S = 5.0  # a worker not heard for this long (it beats every second) is left out of routing
FORGET_AFTER_S = 60.0
_SNAPSHOT_EVERY_S = 2.0  # at most one snapshot request per model this often
# A message prefix neither announced by a worker nor asked for by a request this long is forgotten: a worker
# announces each key its requests use at least every ``REANNOUNCE_S`` (workers/serving/kv_changes.py), so only a
# conversation idle this long is, and a follow-up after that finds it again once a worker announces it anew.
PREFIX_IDLE_S = 900.0
_SEGMENT_BYTES = 288  # what one segment holds here beside its hashes (key, parent, entry): ~230 measured, by a test
_MAX_PREFIX_BYTES = 32 << 20  # per model, however fast prefixes come: least recently used dropped first


@dataclass(slots=True)
class _Worker:
    node: str
    epoch: str
    seq: int
    block_size: int
    load: float = 0.0
    backlog_blocks: float = 0.0  # prefill queued there, as of its last batch
    placed_blocks: float = 0.0  # prefill this gateway has sent it since that batch
    heard: float = 0.0
    role: str = "both"  # a prefill worker is never offered a request: its blocks are a source for the others


@dataclass(slots=True)
class _Segment:
    parent: bytes | None
    hashes: bytes
    used: float  # last announced or asked for


@dataclass(slots=True)
class _Model:
    workers: dict[str, _Worker] = field(default_factory=dict)
    pool: dict[bytes, set[str]] = field(default_factory=dict)  # block -> workers whose pool holds it
    nodes: dict[bytes, dict[str, str]] = field(default_factory=dict)  # block -> node -> best tier holding it there
    prefixes: OrderedDict[bytes, _Segment] = field(default_factory=OrderedDict)  # least recently used first
    prefix_bytes: int = 0  # what ``prefixes`` holds, as _SEGMENT_BYTES each plus their hashes
    snapshot_asked: float = 0.0


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request is offered, and why (for logs and tests)."""

    worker_id: str | None  # None: no live worker with a seat holds any of it (the shared queue)
    saved_blocks: float  # weighted blocks it would not compute
    prefix_blocks: int  # blocks of the longest known prefix
    source: KVSource | None = None  # the node whose tiers hold the longest run of the prefix


class KVIndex:
    """See the module docstring. ``is_dead(worker_id)``: the gateway's liveness view (gateway/liveness.py)."""

    def __init__(self, is_dead: Callable[[str], bool] = lambda _: False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._models: dict[str, _Model] = {}
        self._is_dead = is_dead
        self._clock = clock
        self._nc = None
        self._sub = None
        self.num_batches = 0
        self.num_gaps = 0

    def tenant_state(self) -> dict[str, int]:
        """Message-prefix segments (a conversation's, keyed within its tenant's cache scope) and the blocks known in
        workers' pools and nodes' tiers, every model's (shared/tenant_state.py)."""
        models = list(self._models.values())
        return {"kv_index_prefixes": sum(len(m.prefixes) for m in models),
                "kv_index_pool_blocks": sum(len(m.pool) for m in models),
                "kv_index_tier_blocks": sum(len(m.nodes) for m in models)}

    async def start(self, nc) -> None:
        self._nc = nc
        self._sub = await nc.subscribe(f"{KV_EVENTS_PREFIX}.*", cb=self._on_message)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _on_message(self, msg) -> None:
        try:
            batch = msgspec.msgpack.decode(msg.data, type=KVEventBatch)
        except msgspec.DecodeError:
            log.warning("a KV event batch that does not decode, on %s", msg.subject)
            return
        model_token = msg.subject.rsplit(".", 1)[-1]
        if self.apply(model_token, batch) and self._nc is not None:
            await self._ask_snapshot(model_token)

    async def _ask_snapshot(self, model_token: str) -> None:
        model = self._models[model_token]
        now = self._clock()
        if now - model.snapshot_asked < _SNAPSHOT_EVERY_S:
            return
        model.snapshot_asked = now
        assert self._nc is not None  # asked for only once started
        try:
            await self._nc.publish(snapshot_subject(model_token), b"")
        except Exception as exc:
            log.debug("snapshot request failed: %r", exc)

    # -- the index ----------------------------------------------------------------------------------------
    def apply(self, model_token: str, batch: KVEventBatch) -> bool:
        """Take one batch in; returns True when the index lacks something of this worker (a new worker, or
        batches lost in between) and a snapshot should be asked for."""
        self.num_batches += 1
        now = self._clock()
        model = self._models.setdefault(model_token, _Model())
        worker = model.workers.get(batch.worker_id)
        fresh = worker is None or worker.epoch != batch.epoch
        gap = not fresh and worker is not None and batch.seq != worker.seq + 1
        if worker is not None and not fresh and batch.seq <= worker.seq:
            return False  # a duplicate or reordered batch: older than what was applied
        if worker is None or fresh:
            worker = model.workers[batch.worker_id] = _Worker(batch.node, batch.epoch, batch.seq, batch.block_size)
        worker.seq, worker.load, worker.heard, worker.role = batch.seq, batch.load, now, batch.role
        worker.backlog_blocks, worker.placed_blocks = batch.backlog_tokens / max(1, batch.block_size), 0.0
        if batch.snapshot:
            self._forget_pool(model, batch.worker_id)
            for tier in batch.stored.keys() - {POOL}:
                self._forget_node_tier(model, batch.node, tier)
        for tier, packed in batch.removed.items():
            for h in split_hashes(packed):
                if tier == POOL:
                    holders = model.pool.get(h)
                    if holders is not None:
                        holders.discard(batch.worker_id)
                        if not holders:
                            del model.pool[h]
                else:
                    at = model.nodes.get(h)
                    if at is not None and at.get(batch.node) == tier:
                        del at[batch.node]
                        if not at:
                            del model.nodes[h]
        for tier, packed in batch.stored.items():
            for h in split_hashes(packed):
                if tier == POOL:
                    model.pool.setdefault(h, set()).add(batch.worker_id)
                else:
                    at = model.nodes.setdefault(h, {})
                    if TIER_WEIGHTS[tier] > TIER_WEIGHTS.get(at.get(batch.node, ""), 0.0):
                        at[batch.node] = tier
        for segment in batch.prefixes:
            known = model.prefixes.get(segment.key)
            if known is not None:
                self._touch(model, segment.key, known, now)
            else:
                model.prefixes[segment.key] = _Segment(segment.parent, segment.hashes, now)
                model.prefix_bytes += _SEGMENT_BYTES + len(segment.hashes)
        self._forget_prefixes(model, now)
        if gap:
            self.num_gaps += 1
        return (fresh and not batch.snapshot) or gap

    async def lookup(self, request: GenerateRequest) -> str | None:
        """The worker to offer ``request`` to first (``place``), as ``CompletionService`` asks any placement; names
        the node holding more of its prefix in ``request.kv_source``."""
        placement = self.place(request)
        if placement is None:
            return None
        request.kv_source = placement.source
        if placement.worker_id is not None:  # its prefill queues there until the worker's next batch says so
            worker = self._models[subjects.model_token(request.model)].workers[placement.worker_id]
            # What it would compute of the known prefix, and its new messages past it: a block at least.
            worker.placed_blocks += placement.prefix_blocks - placement.saved_blocks + 1
        return placement.worker_id

    def source(self, request: GenerateRequest) -> KVSource | None:
        """The live node whose tiers hold most of ``request``'s prefix (a prefill worker's hand-over: its node)."""
        placement = self.place(request)
        return placement.source if placement is not None else None

    async def record(self, *_args) -> None:
        """Nothing to record: the workers' KV events say where every block is."""

    def place(self, request: GenerateRequest) -> Placement | None:
        """The live worker of ``request``'s model that would compute least of its prompt, load considered, and the
        node whose tiers hold most of it; None when nothing of it is known to be held (the shared queue then)."""
        if not request.messages or request.sampling.n != 1:
            return None
        model = self._models.get(subjects.model_token(request.model))
        if model is None:
            return None
        chain = self._longest_prefix(model, request_prefix_keys(request))
        if not chain:
            return None
        now = self._clock()
        best: tuple[float, str, float] | None = None  # cost, worker, saved
        live_nodes: set[str] = set()
        for worker_id, worker in list(model.workers.items()):
            if now - worker.heard > FORGET_AFTER_S:
                self._forget_worker(model, worker_id)
                continue
            if now - worker.heard > SILENT_AFTER_S or self._is_dead(worker_id):
                continue
            live_nodes.add(worker.node)
            if worker.load >= 1.0 or worker.role == "prefill":
                continue
            saved = 0.0
            for h in chain:
                if worker_id in model.pool.get(h, ()):
                    saved += TIER_WEIGHTS[POOL]
                elif (tier := model.nodes.get(h, {}).get(worker.node)) is not None:
                    saved += TIER_WEIGHTS[tier]
                else:
                    break
            cost = len(chain) - saved + worker.backlog_blocks + worker.placed_blocks + LOAD_BLOCKS * worker.load
            if best is None or cost < best[0]:
                best = (cost, worker_id, saved)
        if best is not None and best[2] <= 0:
            best = None  # the cheapest saves nothing: any worker will do, the shared queue finds one
        # Named whoever takes the request: the offer may fall back to the shared queue, and a worker on another
        # node then fetches what it would otherwise compute (one on the source's own node finds it in its tiers).
        source = self._best_node(model, chain, live_nodes)
        if best is None and source is None:
            return None
        if best is None:
            return Placement(None, 0.0, len(chain), source)
        return Placement(best[1], best[2], len(chain), source)

    @staticmethod
    def _best_node(model: _Model, chain: list[bytes], nodes: set[str]) -> KVSource | None:
        """The node among ``nodes`` whose tiers hold the longest run of ``chain`` from its first block."""
        best: KVSource | None = None
        for i, h in enumerate(chain):
            at = model.nodes.get(h)
            nodes = {n for n in nodes if at is not None and n in at}
            if not nodes:
                break
            best = KVSource(min(nodes), i + 1)
        return best

    def _longest_prefix(self, model: _Model, keys: list[bytes]) -> list[bytes]:
        chain: list[bytes] = []
        parent: bytes | None = None
        now = self._clock()
        for key in keys:
            known = model.prefixes.get(key)
            if known is None or known.parent != parent:
                break
            self._touch(model, key, known, now)
            chain.extend(split_hashes(known.hashes))
            parent = key
        return chain

    @staticmethod
    def _touch(model: _Model, key: bytes, segment: _Segment, now: float) -> None:
        """``key`` was used now: last out of the least-recently-used order, and idle from now."""
        segment.used = now
        model.prefixes.move_to_end(key)

    @staticmethod
    def _forget_prefixes(model: _Model, now: float) -> None:
        """Drop the least recently used segments while they are idle past PREFIX_IDLE_S or too many are held."""
        prefixes = model.prefixes
        while prefixes:
            oldest = next(iter(prefixes.values()))
            if now - oldest.used <= PREFIX_IDLE_S and model.prefix_bytes <= _MAX_PREFIX_BYTES:
                break
            prefixes.popitem(last=False)
            model.prefix_bytes -= _SEGMENT_BYTES + len(oldest.hashes)

    def _forget_pool(self, model: _Model, worker_id: str) -> None:
        for h in [h for h, holders in model.pool.items() if worker_id in holders]:
            holders = model.pool[h]
            holders.discard(worker_id)
            if not holders:
                del model.pool[h]

    def _forget_node_tier(self, model: _Model, node: str, tier: str) -> None:
        for h in [h for h, at in model.nodes.items() if at.get(node) == tier]:
            del model.nodes[h][node]
            if not model.nodes[h]:
                del model.nodes[h]

    def _forget_worker(self, model: _Model, worker_id: str) -> None:
        self._forget_pool(model, worker_id)
        del model.workers[worker_id]
