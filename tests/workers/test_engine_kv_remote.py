"""Our engine fetching a prefix another node's tiers hold (``GenerateRequest.kv_source``): loaded instead of
computed when fetching is cheaper, counted in ``cached_tokens``, kept in this node's tier for its next request, and
exactly the tokens a recompute gives; a block that arrives damaged, a node that is gone, a tenant that does not hold
the blocks, and a link slower than computing all end as a recompute. The transport here is the other engine's own
block reader, called in place; over NATS it is workers/service/kv_blocks.py (tests/workers/test_kv_blocks.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from switchyard.shared.messages import KVSource
from switchyard.workers.engine.config import EngineConfig
from switchyard.workers.kv_tiers.remote import TransferCost
from tests.workers.test_engine import RecordingEngine, run
from tests.workers.test_engine_kv_tiers import A, _seq_of, _tier


class Peers:
    """Another node, reached through its engine's block reader; ``damage`` alters what it sends."""

    def __init__(self, read: Callable, damage: Callable[[bytes], bytes] = lambda data: data) -> None:
        self.node = "node-b"
        self._read = read
        self._damage = damage
        self.asked: list[tuple[str, int]] = []  # (node, blocks) of each fetch

    def fetch(self, node: str, layout: str, scope: str, block_hashes: list[int], budget_s: float,
              ) -> list[bytes | None]:
        self.asked.append((node, len(block_hashes)))
        files: list[bytes | None] = []
        for h in block_hashes:
            data = self._read(layout, scope, h) if node == "node-a" else None
            if data is None:
                break
            files.append(self._damage(bytes(data)))
        return files + [None] * (len(block_hashes) - len(files))


class FetchAlways(TransferCost):
    """The choice made for fetching whatever the speeds: the tiny test model computes a block faster than any link
    could bring it (the choice itself is tested on its own, below)."""

    def worth(self, num_blocks: int, block_tokens: int, block_bytes: int) -> bool:
        return True


def _connect(engine, peers: Peers, cost: TransferCost | None = None) -> None:
    engine.connect_kv_peers(peers)
    engine.tiers.tiers.cost = cost or FetchAlways()


def _config(directory: Path) -> EngineConfig:
    return EngineConfig(max_num_seqs=2, kv_cache_bytes=1, max_model_len=128, kv_offload_gib=0.01,
                        kv_offload_host_dir=directory)


@pytest.fixture
def node_a(tiny, make_request, tmp_path):
    """An engine on node a that computed A (its blocks in node a's host tier), its tokens, and its reader."""
    engine = RecordingEngine(*tiny, _config(tmp_path / "a"))
    tokens, _ = _ask(engine, make_request, A)
    read = engine.connect_kv_peers(Peers(lambda *_: None))
    assert read is not None
    yield engine, tokens, read
    engine.shutdown()


def _ask(engine, make_request, prompt: str, tenant: str = "a", source: KVSource | None = None):
    request = msgspec.structs.replace(make_request(prompt=prompt, temperature=0, max_tokens=8, ignore_eos=True),
                                      tenant_id=tenant, kv_source=source)
    engine.add_request(request)
    usage = run(engine)[request.request_id].final.usage
    assert engine.tiers.tiers.flush()
    return engine.token_ids[request.request_id], usage.cached_tokens


def _num_blocks(engine) -> int:
    return len(engine.scheduler.kv_cache.chain(_seq_of(engine, A)))


def _node_b(tiny, node_a, tmp_path):
    """An engine on node b that reaches node a through ``Peers``: A's expected tokens, the engine, its peers, and
    how many blocks A's prompt comes to."""
    _, expected, read = node_a
    engine = RecordingEngine(*tiny, _config(tmp_path / "b"))
    peers = Peers(read)
    _connect(engine, peers)
    return expected, engine, peers, _num_blocks(engine)


def test_a_prefix_another_node_holds_is_fetched_loaded_and_kept_on_this_node(tiny, make_request, node_a, tmp_path):
    expected, engine, peers, n = _node_b(tiny, node_a, tmp_path)
    tokens, cached = _ask(engine, make_request, A, source=KVSource("node-a", n))
    assert tokens == expected
    assert cached == n * 16, "the whole prefix came from node a"
    assert peers.asked == [("node-a", n)]
    assert _tier(engine, "remote").hits == n
    engine.shutdown()

    # Kept in node b's own host tier: its next worker (no peers at all) loads it from there.
    again = RecordingEngine(*tiny, _config(tmp_path / "b"))
    tokens, cached = _ask(again, make_request, A)
    assert tokens == expected and cached == n * 16
    again.shutdown()


def test_nothing_is_fetched_for_another_tenant_or_from_a_node_that_is_gone(tiny, make_request, node_a, tmp_path):
    expected, engine, peers, n = _node_b(tiny, node_a, tmp_path)
    tokens, cached = _ask(engine, make_request, A, tenant="b", source=KVSource("node-a", n))
    assert (tokens, cached) == (expected, 0), "tenant b's identical prompt names other blocks: node a has none"
    tokens, cached = _ask(engine, make_request, A[::-1], source=KVSource("node-gone", n))
    assert cached == 0 and peers.asked[-1] == ("node-gone", n)
    tokens, cached = _ask(engine, make_request, A, source=KVSource("node-b", n))
    assert cached == 0, "a source naming this node itself: its own tiers were looked in, nothing fetched"
    assert len(peers.asked) == 2
    engine.shutdown()


def test_a_block_damaged_on_the_way_is_recomputed_never_served_nor_kept(tiny, make_request, node_a, tmp_path):
    _, expected, read = node_a

    seen = [0]

    def flip_the_third(data: bytes) -> bytes:
        seen[0] += 1
        return data[:-100] + bytes([data[-100] ^ 1]) + data[-99:] if seen[0] == 3 else data

    engine = RecordingEngine(*tiny, _config(tmp_path / "b"))
    _connect(engine, Peers(read, flip_the_third))
    n = _num_blocks(engine)
    tokens, cached = _ask(engine, make_request, A, source=KVSource("node-a", n))
    assert tokens == expected, "the recomputed blocks give the same tokens"
    assert cached == 2 * 16, "the two blocks before the damaged one were loaded"
    assert _tier(engine, "remote").corrupt == 1
    engine.shutdown()
    again = RecordingEngine(*tiny, _config(tmp_path / "b"))
    tokens, cached = _ask(again, make_request, A)
    assert tokens == expected and cached == n * 16, "node b kept the recomputed block, not the damaged one"
    again.shutdown()


def test_a_link_slower_than_computing_is_not_used(tiny, make_request, node_a, tmp_path):
    _, expected, read = node_a
    engine = RecordingEngine(*tiny, _config(tmp_path / "b"))
    peers = Peers(read)
    cost = TransferCost()
    _connect(engine, peers, cost)
    _ask(engine, make_request, A[::-1])  # a prompt of its own: the engine measures its prefill speed
    assert cost.prefill_tokens_per_s is not None
    cost.note_transfer(1, 1_000, 1.0)  # and the link is measured at a kilobyte a second
    n = _num_blocks(engine)
    tokens, cached = _ask(engine, make_request, A, source=KVSource("node-a", n))
    assert (tokens, cached) == (expected, 0) and peers.asked == []
    assert _tier(engine, "remote").misses == n
    engine.shutdown()


def test_the_choice_weighs_the_measured_link_against_the_measured_prefill():
    cost = TransferCost()
    assert cost.worth(10, 16, 1_000_000), "nothing measured yet: the first fetch is tried (and measured)"
    cost.note_step(8, 1.0)  # a decode step says nothing of prefill speed
    assert cost.prefill_tokens_per_s is None
    cost.note_step(1_600, 1.0)  # 1,600 prefill tokens a second: a 16-token block takes 10 ms to compute
    cost.note_transfer(1, 1_000_000, 0.002)  # a 1 MB block in 2 ms: 500 MB/s
    assert cost.worth(10, 16, 1_000_000)
    for _ in range(20):
        cost.note_transfer(4, 4_000_000, 1.0)  # 4 MB/s: a block takes 250 ms to come
    assert not cost.worth(10, 16, 1_000_000)
    assert cost.num_declined == 10 and cost.num_fetched == 81
