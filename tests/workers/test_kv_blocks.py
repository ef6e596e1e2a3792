"""KV blocks between nodes over real NATS (workers/service/kv_blocks.py): a node's block files, whole and in order,
in as many replies as a message allows; a block a node lacks ends the fetch there; a node that is gone, or one that
never answers, costs a quick None, never a hang; and a request of another shape reads nothing."""

from __future__ import annotations

import asyncio
import os
import time

import msgspec
import nats
import pytest

from switchyard.shared.kv_events import blocks_subject
from switchyard.workers.service.kv_blocks import KVBlockExchange

SCOPE = "0123456789abcdef"
LAYOUT = "smollm2-float32-abcdef"


@pytest.fixture
async def nc(nats_url):
    nc = await nats.connect(nats_url)
    yield nc
    await nc.close()


def _files(n: int, size: int) -> dict[tuple[str, int], bytes]:
    return {(SCOPE, 1000 + i): os.urandom(size) for i in range(n)}


async def _node(nc, name: str, files: dict, **kwargs) -> KVBlockExchange:
    node = KVBlockExchange(nc, "tiny", name, **kwargs)
    reads: list[tuple[str, int]] = []

    def read(layout: str, scope: str, block_hash: int) -> bytes | None:
        reads.append((scope, block_hash))
        return files.get((scope, block_hash)) if layout == LAYOUT else None

    await node.start(read)
    node.reads = reads  # type: ignore[attr-defined]  # what it was asked to read, for the test
    return node


async def test_a_nodes_blocks_arrive_whole_in_order_and_in_parts(nc):
    files = _files(6, 5_000)
    a = await _node(nc, f"host-a.example.com:{os.getpid()}", files, chunk_bytes=1_024)  # 5 replies a block
    b = await _node(nc, f"host-b:{os.getpid()}", {})
    try:
        hashes = [h for _, h in files]
        got = await asyncio.to_thread(b.fetch, a.node, LAYOUT, SCOPE, hashes, 10.0)
        assert got == [files[SCOPE, h] for h in hashes]
        assert a.num_served == 6 * 5

        # A block the node lacks ends the chain there: nothing after it is used, even where the node has it.
        got = await asyncio.to_thread(b.fetch, a.node, LAYOUT, SCOPE, [hashes[0], 999, hashes[2]], 10.0)
        assert got[0] == files[SCOPE, hashes[0]] and got[1:] == [None, None]
        # A node of another layout (other weights, dtype or block shape) has nothing to give.
        assert await asyncio.to_thread(b.fetch, a.node, "other-layout", SCOPE, hashes[:2], 10.0) == [None, None]
    finally:
        await a.stop()
        await b.stop()


async def test_a_node_that_is_gone_or_silent_costs_a_quick_none(nc):
    b = await _node(nc, f"host-b:{os.getpid()}", {}, timeout_s=0.5)
    silent = await nc.subscribe(blocks_subject("tiny", "host-silent"))  # takes requests, never answers
    try:
        t0 = time.monotonic()
        assert await asyncio.to_thread(b.fetch, "host-gone", LAYOUT, SCOPE, [1, 2, 3], 10.0) == [None] * 3
        assert time.monotonic() - t0 < 0.5, "no responders: known at once"
        t0 = time.monotonic()
        assert await asyncio.to_thread(b.fetch, "host-silent", LAYOUT, SCOPE, [1, 2, 3], 10.0) == [None] * 3
        assert time.monotonic() - t0 < 2.0, "a silent node: one timeout, then the rest is not asked for"
    finally:
        await silent.unsubscribe()
        await b.stop()


async def test_a_fetch_past_its_time_budget_asks_for_no_more_blocks(nc):
    files = _files(10, 1_000)
    slow = dict(files)

    class Slow(dict):
        def get(self, key, default=None):
            time.sleep(0.3)  # a node that takes 0.3 s a block: four at a time, two rounds before 0.5 s is up
            return slow.get(key, default)

    a = await _node(nc, f"host-a:{os.getpid()}", Slow())
    b = await _node(nc, f"host-b:{os.getpid()}", {})
    try:
        hashes = [h for _, h in files]
        t0 = time.monotonic()
        got = await asyncio.to_thread(b.fetch, a.node, LAYOUT, SCOPE, hashes, 0.5)
        received = [g for g in got if g is not None]
        assert 4 <= len(received) < 10 and got[:len(received)] == [files[SCOPE, h] for h in hashes[:len(received)]]
        assert got[len(received):] == [None] * (10 - len(received)), "a chain: what was not fetched is computed"
        assert time.monotonic() - t0 < 3.0
    finally:
        await a.stop()
        await b.stop()


async def test_a_request_of_another_shape_reads_nothing(nc):
    files = _files(1, 100)
    a = await _node(nc, f"host-a:{os.getpid()}", files)
    try:
        subject = blocks_subject("tiny", a.node)
        for bad in (b"not msgpack", msgspec.msgpack.encode((LAYOUT, "../../etc", bytes(16), 0)),  # a path for a scope
                    msgspec.msgpack.encode((LAYOUT, SCOPE, b"ab", 0)),  # a hash of 2 bytes
                    msgspec.msgpack.encode((LAYOUT, SCOPE, bytes(16), -1))):  # an offset before the start
            reply = await nc.request(subject, bad, timeout=2)
            assert reply.data == bytes(8), "size 0: nothing"
        assert a.reads == []
    finally:
        await a.stop()
