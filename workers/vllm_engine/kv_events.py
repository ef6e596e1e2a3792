"""vLLM's own KV events, turned into ours: what the vLLM engine's ``take_kv_changes`` and ``kv_listing`` hand out.

    vLLM's scheduler, each step that changed its cache ── KVEventBatch (msgpack) ──▶ ZMQ PUB (vLLM's publisher thread)
                                         ipc://<a private temporary directory>/events.sock
    VllmKVEvents: a SUB socket on a thread of its own ──▶ KVEventTranslator.apply ──▶ held blocks, changes
    step thread   take()    ──▶ KVChanges: stored / removed per tier, and the prefix segments of requests added
    any thread    listing() ──▶ every block held now, per tier

**The endpoint** is an ``ipc://`` socket in a directory ``mkdtemp`` made (mode 0700) and the engine removes at its
shutdown: vLLM binds it whether its engine core runs in the worker's process or in one of its own
(``engine_core_process``), which ``inproc://`` cannot reach; only the worker's user can open it, nothing on the
network can, and two workers on one host never share it (vLLM's default ``tcp://*:5557`` would be open to the
network and taken by the first worker only). A batch is one small message per step: the kernel's copy is nothing.

**Translation.** vLLM names blocks by its own chain (sha256 of pickled tuples, cut to 64 bits in events); the fleet
index names them by ours (``scheduler/kv_cache_manager.hash_block``, blake2b-128, salted on the first block), as our
engine does. A ``BlockStored`` carries the blocks' token ids, so their hashes are recomputed in our chain, parent
first; a map from vLLM's hashes to ours (bounded, least recently stored dropped) finds the parent of a chain that
continues, and the blocks a ``BlockRemoved`` names::

    BlockStored  parent_block_hash=P   block_hashes=[V1, V2]   token_ids=[t0 .. t(2B-1)]   extra_keys=[[salt], None]
    ours         p  = ours[P]          (P None: the chain starts here, salted with the request's cache salt)
                 h1 = hash_block(p, (t0 .. t(B-1)), salt)     h2 = hash_block(h1, (tB .. t(2B-1)))
                 ours[V1] = h1, ours[V2] = h2;   held["pool"] += {V1, V2}
    BlockRemoved block_hashes=[V2]    ──▶ held["pool"] -= {V2}: h2 removed
    AllBlocksCleared                  ──▶ every pool block removed

vLLM's ``medium`` is the tier: ``GPU`` (its pool, on a CPU too) is ``pool``, ``CPU`` and ``STORAGE`` (its offloading
connectors) are ``host`` and ``disk``. vLLM may cache two blocks of one hash (two requests computing one prefix at
once) and removes each alone, so a hash counts its copies and is removed with its last. Blocks our chain cannot name
are skipped: a LoRA adapter's, a multimodal or prompt-embeddings block (their KV is not their tokens'), a partial
block (``prefix_match_unit``), a chain whose parent was never heard of. A payload that does not decode, or an event
that does not fit, is logged and skipped: KV events only steer routing, and the worker that is offered a request
verifies what it has by hash and tokens, so a lost or wrong event costs an offer, never an answer.

**Delivery.** vLLM publishes a step's batch at the step's end, from the step thread (with its engine core in the
worker's process), and its publisher thread sends it a moment later. ``take`` waits for the batches published so far
(``watch``: a count kept around the scheduler's publisher) so that a step's changes go out with that step, the last
one before the worker idles too, as our engine's do. With the engine core in a process of its own there is nothing to
count: a step's changes go out with a later step.

msgspec decodes the payloads and zmq is imported only by the subscriber, so the translation is tested where neither
vLLM nor zmq is installed.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from switchyard.scheduler.kv_cache_manager import hash_chain
from switchyard.shared.kv_events import DISK, HOST, POOL, PrefixSegment
from switchyard.workers.serving.kv_changes import KVChanges, PrefixSegmentLog

log = logging.getLogger("switchyard.engine")

VllmHash = int | bytes  # an int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, the default) or the 32-byte digest
TIER_OF_MEDIUM: dict[str | None, str] = {"GPU": POOL, None: POOL, "CPU": HOST, "STORAGE": DISK}
MAX_BLOCKS = 1 << 18  # blocks held per tier, and twice as many hashes translated, when the engine names no bound
DELIVERY_WAIT_S = 0.25  # the longest ``take`` waits for batches published and not yet translated


# vLLM's event structs (vllm/distributed/kv_events.py), as far as the translation reads them: each a map tagged by
# "type"; fields it adds later are ignored, a field of the wrong type fails that event alone.
class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[VllmHash]
    token_ids: list[int]
    block_size: int
    parent_block_hash: VllmHash | None = None
    medium: str | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None  # per block, untagged: the first block's [cache_salt], ...


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[VllmHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


VllmEvent = BlockStored | BlockRemoved | AllBlocksCleared


class Skipped(ValueError):
    """An event (or payload) the translation leaves out: ``kind`` says which rule (each kind is logged once at
    warning), the message what was seen."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


@dataclass(slots=True)
class _Block:
    ours: int
    copies: int


class KVEventTranslator:
    """vLLM's KV events in our hash domain (see the module docstring): ``apply`` a batch's payload, ``take`` the
    changes since the last take, ``listing`` what is held. Thread-safe: a lock around each."""

    def __init__(self, block_size: int, max_blocks: int = MAX_BLOCKS) -> None:
        """``block_size``: vLLM's (events of another size are partial blocks, skipped); ``max_blocks``: blocks held
        per tier before the least recently stored is dropped (and removed: events lost would otherwise leave blocks
        held forever)."""
        self.block_size = block_size
        self._max_blocks = max_blocks
        self._lock = threading.Lock()
        self._ours: OrderedDict[VllmHash, int] = OrderedDict()  # vLLM's hash -> ours, bounded at 2 * max_blocks
        self._held: dict[str, OrderedDict[VllmHash, _Block]] = {}  # tier -> what it holds, least recent first
        self._stored: dict[str, dict[VllmHash, None]] = {}  # since the last take, per tier
        self._removed: dict[str, dict[VllmHash, int]] = {}  # since the last take, per tier: with our hash
        self._warned: set[str] = set()
        self.num_events = 0
        self.num_skipped = 0

    def apply(self, payload: bytes) -> None:
        """One batch as vLLM's publisher sends it (``[ts, [event, ...], data_parallel_rank]``); what does not fit
        is logged and skipped, never raised."""
        try:
            batch = msgspec.msgpack.decode(payload)
            if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list):
                raise Skipped("batch", f"not [ts, events, rank] but {type(batch).__name__} {batch!r:.80}")
        except (msgspec.DecodeError, Skipped) as exc:
            self.skip(exc)
            return
        with self._lock:
            for raw in batch[1]:
                self.num_events += 1
                try:
                    event = msgspec.convert(raw, VllmEvent)
                    if isinstance(event, BlockStored):
                        self._store(event)
                    elif isinstance(event, BlockRemoved):
                        self._remove(event)
                    else:
                        self._clear(POOL)  # the pool's prefix cache reset (BlockPool.reset_prefix_cache)
                except Exception as exc:  # not an event of ours, tokens out of range, ...: this event alone
                    self.skip(exc)

    def take(self, prefixes: list[PrefixSegment] | None = None) -> KVChanges:
        """What was stored and removed since the last call, net (a block stored and removed in between is only
        removed, as our pool reports it), with ``prefixes``."""
        with self._lock:
            changes = KVChanges(self.block_size, {POOL: []}, {POOL: []}, prefixes or [])
            nothing: OrderedDict[VllmHash, _Block] = OrderedDict()
            for tier, hashes in self._stored.items():
                held = self._held.get(tier, nothing)
                changes.stored[tier] = [held[h].ours for h in hashes if h in held]
            for tier, removed in self._removed.items():
                held = self._held.get(tier, nothing)
                changes.removed[tier] = [ours for h, ours in removed.items() if h not in held]
            self._stored, self._removed = {}, {}
            return changes

    def listing(self) -> dict[str, list[int]]:
        """Every block held now, per tier (a KV-events snapshot)."""
        with self._lock:
            listing: dict[str, list[int]] = {POOL: []}
            listing.update((tier, [b.ours for b in held.values()]) for tier, held in self._held.items())
            return listing

    # -- the events ---------------------------------------------------------------------------------------------
    def _store(self, event: BlockStored) -> None:
        tier = TIER_OF_MEDIUM.get(event.medium)
        if tier is None:
            raise Skipped("medium", f"{event.medium!r} is no tier")
        num_blocks, size = len(event.block_hashes), self.block_size
        if event.block_size != size:
            raise Skipped("partial block", f"{event.block_size} tokens, not {size}")
        if len(event.token_ids) != num_blocks * size:
            raise Skipped("token ids", f"{len(event.token_ids)} for {num_blocks} blocks of {size}")
        if event.lora_name is not None or event.lora_id is not None:
            raise Skipped("LoRA", f"blocks of adapter {event.lora_name or event.lora_id!r}")
        extra_keys = event.extra_keys or [None] * num_blocks
        if len(extra_keys) != num_blocks:
            raise Skipped("extra keys", f"{len(extra_keys)} for {num_blocks} blocks")
        salt = ""
        if event.parent_block_hash is None:
            parent = None
            first = extra_keys[0]
            if first is not None:  # the request's cache salt alone, untagged; anything more is not text's
                if len(first) != 1 or not isinstance(first[0], str):
                    raise Skipped("extra keys", f"{first!r:.80} are not a cache salt alone")
                salt = first[0]
            extra_keys = extra_keys[1:]
        else:
            parent = self._ours.get(event.parent_block_hash)
            if parent is None:
                raise Skipped("lost parent", f"{event.parent_block_hash!r} never stored, or long forgotten")
        if any(keys is not None for keys in extra_keys):
            raise Skipped("extra keys", f"{extra_keys!r:.80} (multimodal or prompt embeddings)")
        ours = hash_chain(event.token_ids, size, salt, num_blocks, parent)
        for theirs, mine in zip(event.block_hashes, ours):
            self._translated(theirs, mine)
            self._hold(tier, theirs, mine)

    def _remove(self, event: BlockRemoved) -> None:
        tier = TIER_OF_MEDIUM.get(event.medium)
        held = self._held.get(tier) if tier is not None else None
        if tier is None or held is None:
            return
        for theirs in event.block_hashes:
            block = held.get(theirs)
            if block is None:
                continue  # one the translation skipped (or a copy's removal heard twice)
            block.copies -= 1
            if block.copies <= 0:
                del held[theirs]
                self._removed.setdefault(tier, {})[theirs] = block.ours

    def _clear(self, tier: str) -> None:
        held = self._held.pop(tier, None)
        if held:
            removed = self._removed.setdefault(tier, {})
            for theirs, block in held.items():
                removed[theirs] = block.ours

    def _translated(self, theirs: VllmHash, ours: int) -> None:
        self._ours[theirs] = ours
        self._ours.move_to_end(theirs)
        while len(self._ours) > 2 * self._max_blocks:
            self._ours.popitem(last=False)

    def _hold(self, tier: str, theirs: VllmHash, ours: int) -> None:
        held = self._held.setdefault(tier, OrderedDict())
        block = held.get(theirs)
        if block is not None:
            block.copies += 1
            held.move_to_end(theirs)
        else:
            held[theirs] = _Block(ours, 1)
        self._stored.setdefault(tier, {})[theirs] = None
        while len(held) > self._max_blocks:
            dropped, old = held.popitem(last=False)
            self._removed.setdefault(tier, {})[dropped] = old.ours

    def skip(self, exc: Exception) -> None:
        """Count and log what is left out: each kind once at warning (a misfit repeats every step), then at debug."""
        self.num_skipped += 1
        kind = exc.kind if isinstance(exc, Skipped) else type(exc).__name__
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("vLLM KV events: skipped (later ones of this kind at debug): %s", exc)
        else:
            log.debug("vLLM KV events: skipped: %s", exc)


class VllmKVEvents:
    """One vLLM engine's KV events: a SUB socket at vLLM's publisher, read on a thread of its own into a
    ``KVEventTranslator``, and the prefix segments of the requests added (see the module docstring)."""

    def __init__(self, endpoint: str, topic: str, block_size: int, max_blocks: int = MAX_BLOCKS,
                 connect_timeout_s: float = 5.0) -> None:
        """Connects to ``endpoint`` (which vLLM has bound by now) and waits until connected, so the first
        request's batches are not lost to ZMQ's slow joiner; a subscriber not connected by ``connect_timeout_s``
        is kept (it goes on trying) with a warning."""
        import zmq

        self.translator = KVEventTranslator(block_size, max_blocks)
        self._prefixes = PrefixSegmentLog()
        self._delivered = threading.Condition()
        self._num_published = 0  # batches vLLM published (counted by ``watch``), and those translated or lost
        self._num_received = 0
        self._is_waiting = True  # off while batches are overdue, until they come (or are known lost)
        self.num_lost_batches = 0
        self._last_seq: int | None = None
        self._socket = zmq.Context.instance().socket(zmq.SUB)  # the context vLLM's publisher uses too
        self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._socket.setsockopt(zmq.RCVHWM, 0)  # never drop: a batch is one step's, the thread keeps up
        self._socket.setsockopt(zmq.LINGER, 0)
        monitor = self._socket.get_monitor_socket(zmq.EVENT_CONNECTED)
        try:
            self._socket.connect(endpoint)
            if not monitor.poll(int(connect_timeout_s * 1000)):
                log.warning("vLLM KV events: not connected to %s after %.0f s; trying on", endpoint,
                            connect_timeout_s)
        finally:
            self._socket.disable_monitor()
            monitor.close(linger=0)
        self._running = True
        self._thread = threading.Thread(target=self._receive, name="vllm-kv-events", daemon=True)
        self._thread.start()

    def watch(self, llm: Any) -> bool:
        """Count the batches ``llm``'s scheduler publishes, so that ``take`` can wait for them. Reaches into vLLM's
        engine core by its attribute names (``LLMEngine.engine_core.engine_core.scheduler.kv_event_publisher``,
        vLLM 0.32): there only with the engine core in this process; False (no waiting) elsewhere."""
        engine_core = getattr(getattr(llm, "engine_core", None), "engine_core", None)
        publisher = getattr(getattr(engine_core, "scheduler", None), "kv_event_publisher", None)
        publish = getattr(publisher, "publish", None)
        if publish is None:
            return False

        def counted(batch: Any) -> None:
            publish(batch)
            with self._delivered:
                self._num_published += 1

        publisher.publish = counted  # type: ignore[union-attr]
        return True

    def add_prefixes(self, segments: list[PrefixSegment]) -> None:
        self._prefixes.add(segments)

    def take(self) -> KVChanges:
        """The changes since the last call, once every batch published so far is translated. A batch overdue by
        ``DELIVERY_WAIT_S`` is waited for no more, nor are later ones until the receiver has caught up: a step
        never waits on a subscriber that has stopped."""
        with self._delivered:
            caught_up = self._num_received >= self._num_published
            if not caught_up and self._is_waiting and self._thread.is_alive():
                caught_up = self._delivered.wait_for(lambda: self._num_received >= self._num_published,
                                                     DELIVERY_WAIT_S)
                if not caught_up:
                    log.warning("vLLM KV events: %d batches not received %.2f s after vLLM published them; not "
                                "waited for until they are", self._num_published - self._num_received,
                                DELIVERY_WAIT_S)
            self._is_waiting = caught_up
        return self.translator.take(self._prefixes.take())

    def listing(self) -> dict[str, list[int]]:
        return self.translator.listing()

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=2)

    def _receive(self) -> None:
        socket = self._socket
        try:
            while self._running:
                if not socket.poll(100):
                    continue
                frames = socket.recv_multipart()
                try:
                    num_lost = self._on_frames(frames)
                except Exception:  # never the thread's end: the worker serves on, its events are only advice
                    log.exception("vLLM KV events: a batch could not be read")
                    num_lost = 0
                with self._delivered:
                    self._num_received += 1 + num_lost
                    self._delivered.notify_all()
        except Exception:  # the socket itself failed: steps stop waiting for it (take), the worker serves on
            log.exception("vLLM KV events: the subscriber stopped; no more KV events from this worker")
        finally:
            socket.close(linger=0)

    def _on_frames(self, frames: list[bytes]) -> int:
        """``(topic, seq: 8 bytes big-endian, payload)``, as vLLM's ZmqEventPublisher sends them; returns how many
        batches were lost before this one."""
        if len(frames) != 3:
            self.translator.skip(Skipped("frames", f"{len(frames)}, not topic, seq and payload"))
            return 0
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        num_lost = seq - self._last_seq - 1 if self._last_seq is not None else 0
        if num_lost > 0:
            # The PUB socket dropped them (its queue full): what they held stays unknown until it is evicted.
            self.num_lost_batches += num_lost
            log.warning("vLLM KV events: batches %d to %d lost", seq - num_lost, seq - 1)
        self._last_seq = seq
        self.translator.apply(payload)
        return max(num_lost, 0)
