"""The fleet's KV index from workers' KV events: a request goes to the worker that holds most of its prefix (its
pool first, then its node's shared tiers), never to a busy, silent or dead one, never by another tenant's blocks;
lost, duplicated or reordered batches only ask for a snapshot or are ignored."""

from __future__ import annotations

import gc
import tracemalloc

import msgspec

from switchyard.gateway.kv_index import PREFIX_IDLE_S, KVIndex
from switchyard.shared.kv_events import DISK, HOST, POOL, KVEventBatch, PrefixSegment, request_prefix_keys
from switchyard.shared.messages import ChatMessage, GenerateRequest, KVSource, SamplingParams

MODEL = "m"


def request(*contents: str, tenant: str = "a") -> GenerateRequest:
    roles = ["system", "user", "assistant", "user", "assistant", "user"]
    return GenerateRequest(request_id="r", model=MODEL, tier="pro", sampling=SamplingParams(), created_at=0.0,
                           deadline_at=0.0, tenant_id=tenant,
                           messages=[ChatMessage(roles[i], c) for i, c in enumerate(contents)])


def blocks(tag: str, n: int) -> list[bytes]:
    return [f"{tag}{i}".encode().ljust(16, b".") for i in range(n)]


def segments(req: GenerateRequest, per_message: list[list[bytes]]) -> list[PrefixSegment]:
    keys = request_prefix_keys(req)
    return [PrefixSegment(key, keys[i - 1] if i else None, b"".join(hashes))
            for i, (key, hashes) in enumerate(zip(keys, per_message))]


class Worker:
    """A worker's side of the events: numbered batches of one epoch."""

    def __init__(self, index: KVIndex, worker_id: str, node: str = "n1") -> None:
        self.index, self.worker_id, self.node, self.seq = index, worker_id, node, 0
        self.send(snapshot=True)  # the empty snapshot a worker starts with

    def batch(self, **fields) -> KVEventBatch:
        self.seq += 1
        packed = {k: {t: b"".join(h) for t, h in v.items()} for k, v in fields.items() if k in ("stored", "removed")}
        rest = {k: v for k, v in fields.items() if k not in ("stored", "removed")}
        return KVEventBatch(self.worker_id, self.node, "e1", self.seq, 16, **packed, **rest)

    def send(self, **fields) -> bool:
        return self.index.apply(MODEL, self.batch(**fields))


def conversation() -> tuple[GenerateRequest, list[bytes]]:
    """A first turn whose two messages come to 5 + 2 blocks, as its worker published them."""
    first = request("You are a railway archivist. " * 20, "Tell me about yards.")
    return first, blocks("c", 7)


def test_a_follow_up_goes_to_the_worker_holding_its_history_and_not_to_another_tenants():
    index = KVIndex()
    a, b = Worker(index, "a"), Worker(index, "b")
    first, held = conversation()
    a.send(stored={POOL: held}, prefixes=segments(first, [held[:5], held[5:]]))
    b.send(stored={POOL: blocks("other", 9)})
    follow_up = request(first.messages[0].content, first.messages[1].content, "Yards sort cars.", "And humps?")
    placed = index.place(follow_up)
    assert placed is not None and placed.worker_id == "a"
    assert (placed.saved_blocks, placed.prefix_blocks) == (7, 7)
    stranger = msgspec.structs.replace(follow_up, tenant_id="b")
    assert index.place(stranger) is None, "another tenant's identical messages name other keys"
    assert index.place(request("Something new.")) is None


def test_evicted_blocks_count_from_the_nodes_shared_tier_which_serves_its_other_workers_too():
    index = KVIndex()
    a, _ = Worker(index, "a", node="n1"), Worker(index, "b", node="n1")
    first, held = conversation()
    a.send(stored={POOL: held, HOST: held}, prefixes=segments(first, [held[:5], held[5:]]))
    assert index.place(first).worker_id == "a"  # its pool (1.0 a block) beats the node's host tier (0.9)
    a.send(removed={POOL: held[3:]})  # a's pool evicted the tail; the host tier still has everything
    placed = index.place(first)
    assert placed.worker_id == "a" and abs(placed.saved_blocks - (3 + 0.9 * 4)) < 1e-9  # the rest from the tier
    a.send(load=0.9)
    placed = index.place(first)  # a busy holder loses to its idle neighbour, which loads it all from the tier
    assert placed.worker_id == "b" and abs(placed.saved_blocks - 0.9 * 7) < 1e-9
    a.send(load=0.0)
    c = Worker(index, "c", node="n2")
    c.send(stored={POOL: held[:2]})
    assert index.place(first).worker_id == "a", "two pool blocks on another node save less"
    a.send(removed={HOST: held}, stored={DISK: held})  # demoted to the node's disk tier
    assert abs(index.place(first).saved_blocks - (3 + 0.6 * 4)) < 1e-9  # a: 3 in its pool, then the disk


def test_busy_silent_and_dead_workers_are_not_offered_anything():
    dead: set[str] = set()
    index = KVIndex(is_dead=dead.__contains__)
    a, b = Worker(index, "a"), Worker(index, "b", node="n2")
    first, held = conversation()
    a.send(stored={POOL: held}, prefixes=segments(first, [held[:5], held[5:]]))
    b.send(stored={POOL: held[:5]})
    assert index.place(first).worker_id == "a"
    a.send(load=1.0)  # every seat taken: an offer would only wait
    assert index.place(first).worker_id == "b"
    a.send(load=0.2)
    dead.add("a")
    assert index.place(first).worker_id == "b"
    dead.add("b")
    assert index.place(first) is None


async def test_prefill_queued_on_a_worker_weighs_against_what_it_would_save():
    index = KVIndex()
    a, b = Worker(index, "a", node="n1"), Worker(index, "b", node="n1")
    first, held = conversation()
    a.send(stored={POOL: held, HOST: held}, prefixes=segments(first, [held[:5], held[5:]]))
    assert index.place(first).worker_id == "a"
    a.send(backlog_tokens=10 * 16)  # ten blocks' prefill queued at a: b loads all seven from the tier sooner
    assert index.place(first).worker_id == "b"
    a.send(backlog_tokens=0)
    # What this gateway sends a counts until a's next batch: two new conversations on one history spread out.
    assert await index.lookup(first) == "a"
    b.send(stored={POOL: held})
    assert await index.lookup(msgspec.structs.replace(first, request_id="r2")) == "b"
    assert await index.lookup(msgspec.structs.replace(first, request_id="r3")) == "a", "b's placement counts too"


async def test_a_request_names_the_live_node_whose_tiers_hold_most_of_it_whoever_takes_it():
    dead: set[str] = set()
    index = KVIndex(is_dead=dead.__contains__)
    a, b, c = Worker(index, "a", node="n1"), Worker(index, "b", node="n2"), Worker(index, "c", node="n3")
    first, held = conversation()
    a.send(stored={POOL: held, HOST: held}, prefixes=segments(first, [held[:5], held[5:]]))
    b.send(stored={DISK: held[:3]})
    placed = index.place(first)
    assert placed.worker_id == "a" and placed.source == KVSource("n1", 7)
    a.send(load=1.0)  # a busy: no worker with a seat holds it, but its node does, for whoever takes the request
    placed = index.place(first)
    assert (placed.worker_id, placed.source) == ("b", KVSource("n1", 7))
    assert await index.lookup(first) == "b" and first.kv_source == KVSource("n1", 7), "named in the request"
    dead.add("a")  # n1's only worker is gone: its tiers cannot be fetched from
    assert index.place(first).source == KVSource("n2", 3)
    c.send(load=1.0)
    assert index.place(request("Something new.")) is None
    stranger = msgspec.structs.replace(first, tenant_id="b")
    assert index.place(stranger) is None, "another tenant is never named a node holding this tenant's blocks"


def test_lost_batches_ask_for_a_snapshot_and_old_ones_are_ignored():
    index = KVIndex()
    a = Worker(index, "a")
    first, held = conversation()
    a.send(stored={POOL: held}, prefixes=segments(first, [held[:5], held[5:]]))
    late = a.batch(removed={POOL: held})  # built, then overtaken by the next one on the wire
    assert a.send(load=0.1) is True, "reordered looks lost: a snapshot is asked for"
    assert index.apply(MODEL, late) is False and index.place(first).worker_id == "a", "an older batch changes nothing"
    assert a.send(load=0.1) is False
    a.seq += 3  # three batches lost
    assert a.send(stored={POOL: blocks("x", 1)}) is True, "a gap asks for a snapshot"
    assert a.send(snapshot=True, stored={POOL: held[:2]}) is False  # the snapshot replaces what was known
    assert index.place(first).saved_blocks == 2
    stranger = KVIndex()
    assert stranger.apply(MODEL, a.batch(load=0.3)) is True, "a worker first heard mid-stream is asked for all"


def test_a_conversation_idle_past_the_prefix_idle_time_is_forgotten_and_learnt_again_when_announced():
    now = [0.0]
    index = KVIndex(clock=lambda: now[0])
    a = Worker(index, "a")
    first, held = conversation()
    other = request("A second conversation, kept in use.")
    kept = segments(other, [blocks("k", 1)])
    a.send(stored={POOL: held + blocks("k", 1)}, prefixes=segments(first, [held[:5], held[5:]]) + kept)
    now[0] = PREFIX_IDLE_S - 1
    a.send(load=0.1)  # a worker beats every second: any batch lets the index forget what has been idle too long
    assert index.place(other).worker_id == "a"  # asked for: kept another idle time
    now[0] = PREFIX_IDLE_S + 1
    a.send(load=0.1)
    assert index.place(first) is None, "idle past PREFIX_IDLE_S: forgotten, though a's pool still holds it"
    assert index.place(other).worker_id == "a"
    assert index.tenant_state()["kv_index_prefixes"] == 1
    a.send(prefixes=segments(first, [held[:5], held[5:]]))  # a worker announces it again at its next use
    assert index.place(first).worker_id == "a"


def test_prefixes_of_short_messages_that_fill_no_block_are_bounded_too(monkeypatch):
    import switchyard.gateway.kv_index as kv_index

    monkeypatch.setattr(kv_index, "_MAX_PREFIX_BYTES", 1000 * kv_index._SEGMENT_BYTES)
    index = KVIndex()
    a = Worker(index, "a")
    for i in range(30):  # 3,000 conversations of one short message each: no whole block, yet each costs memory
        a.send(prefixes=[p for j in range(100) for p in segments(request(f"hi {i}.{j}"), [[]])])
    assert index.tenant_state()["kv_index_prefixes"] == 1000, "the least recently used go past the bound"


def test_a_segment_costs_no_more_memory_than_the_bound_counts_for_it():
    """_SEGMENT_BYTES must not under-count: the bound is only as honest as it. Measured as the gateway receives
    segments, decoded from the wire."""
    index = KVIndex()
    a = Worker(index, "a")
    n = 2000
    wire = msgspec.msgpack.encode(a.batch(prefixes=[p for i in range(n) for p in segments(
        request(f"system {i}", f"user {i}"), [[], blocks(f"b{i}", 1)])]))
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index.apply(MODEL, msgspec.msgpack.decode(wire, type=KVEventBatch))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert index.tenant_state()["kv_index_prefixes"] == 2 * n
    counted = index._models[MODEL].prefix_bytes
    assert held <= counted, f"{held / (2 * n):.0f} bytes a segment held, {counted / (2 * n):.0f} counted"
