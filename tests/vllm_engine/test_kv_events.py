"""vLLM's KV events in our hash domain (workers/vllm_engine/kv_events.py), without vLLM: batches shaped as vLLM 0.32's
ZmqEventPublisher sends them (``[ts, [event, ...], rank]``, each event a map tagged by ``type``, its fields at
their defaults left out) are translated into the blocks our chain names, the same hashes ``KVCacheManager.chain``
gives for the same tokens and cache salt; removals, clears, lost parents and payloads that do not fit. One test
runs the subscriber against vLLM's own publisher (the vLLM environment, no model)."""

from __future__ import annotations

import json
import logging
import subprocess

import msgspec
import pytest

from switchyard.scheduler.kv_cache_manager import KVCacheManager
from switchyard.scheduler.request import Sequence
from switchyard.shared.kv_events import DISK, HOST, POOL
from switchyard.workers.vllm_engine.kv_events import KVEventTranslator

B = 16  # vLLM's GPU block size (128 on a CPU): small keeps the token lists short
SALT = "tenant:acme"
TOKENS = list(range(1000, 1000 + 3 * B + 5))  # three full blocks and a partial one


def chain(tokens: list[int], salt: str = SALT, block_size: int = B) -> list[int]:
    """Our engine's hashes of the full blocks a prefix lookup for ``tokens`` may hit."""
    seq = Sequence("s", list(tokens), max_tokens=1, cache_salt=salt)
    return [h for h, _ in KVCacheManager(num_blocks=8, block_size=block_size).chain(seq)]


def stored(hashes, tokens, parent=None, salt: str | None = SALT, medium="GPU", block_size=B, **fields) -> dict:
    """A BlockStored as vLLM sends it: the salt untagged on the first block of a chain, no extra keys otherwise."""
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
             "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": 0}
    if parent is None and salt is not None:
        event["extra_keys"] = [[salt]] + [None] * (len(hashes) - 1)
    return event | fields


def removed(hashes, medium="GPU") -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": 0}


def batch(*events) -> bytes:
    return msgspec.msgpack.encode([1795882375.43, list(events), 0])


@pytest.fixture
def translator() -> KVEventTranslator:
    return KVEventTranslator(B)


def test_stored_blocks_are_named_by_our_chain_over_the_events_tokens_and_salt(translator):
    ours = chain(TOKENS)
    translator.apply(batch(stored([11, 12], TOKENS[:2 * B])))
    # A later step continues the chain from vLLM's hash of its parent.
    translator.apply(batch(stored([13], TOKENS[2 * B:3 * B], parent=12)))
    changes = translator.take()
    assert changes.block_size == B
    assert changes.stored == {POOL: ours}
    assert changes.removed == {POOL: []}
    assert translator.listing() == {POOL: ours}
    assert translator.take().is_empty  # each change handed out once


def test_the_salt_scopes_the_chain_as_ours_does(translator):
    translator.apply(batch(stored([21], TOKENS[:B], salt="tenant:a"), stored([22], TOKENS[:B], salt="tenant:b"),
                           stored([23], TOKENS[:B], salt=None)))
    assert translator.take().stored[POOL] == [chain(TOKENS, "tenant:a")[0], chain(TOKENS, "tenant:b")[0],
                                              chain(TOKENS, "")[0]]


def test_the_digest_hashes_vllm_sends_without_int_hashes_translate_alike(translator):
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: the 32-byte digests.
    first, second = b"\x01" * 32, b"\x02" * 32
    translator.apply(batch(stored([first], TOKENS[:B]), stored([second], TOKENS[B:2 * B], parent=first)))
    assert translator.take().stored[POOL] == chain(TOKENS)[:2]
    translator.apply(batch(removed([second])))
    assert translator.take().removed[POOL] == [chain(TOKENS)[1]]


def test_a_removed_block_is_handed_out_as_removed_and_leaves_the_listing(translator):
    ours = chain(TOKENS)
    translator.apply(batch(stored([11, 12, 13], TOKENS[:3 * B])))
    translator.take()
    translator.apply(batch(removed([13]), removed([12]), removed([999])))  # 999: never heard of, ignored
    changes = translator.take()
    assert changes.removed == {POOL: [ours[2], ours[1]]} and changes.stored == {POOL: []}
    assert translator.listing() == {POOL: [ours[0]]}


def test_changes_are_net_between_takes_as_our_pool_reports_them(translator):
    ours = chain(TOKENS)
    # Stored and evicted before the worker asked: only a removal (harmless to an index that never heard of it).
    translator.apply(batch(stored([11], TOKENS[:B]), removed([11])))
    assert translator.take().stored[POOL] == [] and translator.listing()[POOL] == []
    # Evicted and computed again: only stored.
    translator.apply(batch(stored([11], TOKENS[:B])))
    translator.take()
    translator.apply(batch(removed([11]), stored([11], TOKENS[:B])))
    changes = translator.take()
    assert (changes.stored[POOL], changes.removed[POOL]) == ([ours[0]], [])


def test_a_hash_vllm_caches_twice_is_removed_with_its_last_copy(translator):
    # Two requests computing one prefix at once: two blocks of one hash, each evicted alone.
    translator.apply(batch(stored([11], TOKENS[:B]), stored([11], TOKENS[:B])))
    translator.take()
    translator.apply(batch(removed([11])))
    assert translator.take().removed[POOL] == [] and translator.listing()[POOL] == chain(TOKENS)[:1]
    translator.apply(batch(removed([11])))
    assert translator.take().removed[POOL] == chain(TOKENS)[:1]


def test_all_blocks_cleared_removes_the_pool_and_keeps_the_tiers_below(translator):
    ours = chain(TOKENS)
    translator.apply(batch(stored([11, 12], TOKENS[:2 * B]), stored([11], TOKENS[:B], medium="CPU")))
    translator.take()
    translator.apply(batch({"type": "AllBlocksCleared"}))
    changes = translator.take()
    assert changes.removed[POOL] == ours[:2]
    assert translator.listing() == {POOL: [], HOST: ours[:1]}
    # A chain stored after the clear still finds its parent: the translation is of content, not of residence.
    translator.apply(batch(stored([13], TOKENS[2 * B:3 * B], parent=12)))
    assert translator.take().stored[POOL] == [ours[2]]


def test_vllms_offloading_media_are_the_host_and_disk_tiers(translator):
    ours = chain(TOKENS)
    translator.apply(batch(stored([11, 12], TOKENS[:2 * B], medium="CPU"),
                           stored([11], TOKENS[:B], medium="STORAGE"), stored([11], TOKENS[:B], medium="GPU")))
    assert translator.take().stored == {POOL: ours[:1], HOST: ours[:2], DISK: ours[:1]}
    translator.apply(batch(removed([12], medium="CPU")))
    assert translator.take().removed == {POOL: [], HOST: [ours[1]]}
    assert translator.listing() == {POOL: ours[:1], HOST: ours[:1], DISK: ours[:1]}


def test_a_chain_whose_parent_was_never_heard_of_is_skipped(translator):
    # The parent's batch was lost (or vLLM started before the subscriber): the blocks cannot be named in our
    # chain, nor can the blocks that continue from them.
    translator.apply(batch(stored([13], TOKENS[2 * B:3 * B], parent=12)))
    translator.apply(batch(stored([14], TOKENS[3 * B:3 * B + B], parent=13)))
    assert translator.take().is_empty and translator.listing() == {POOL: []}
    assert translator.num_skipped == 2
    translator.apply(batch(removed([13])))  # its removal is no one's business either
    assert translator.take().is_empty


def test_the_held_blocks_are_bounded_and_what_is_dropped_is_removed():
    translator = KVEventTranslator(B, max_blocks=2)
    ours = chain(TOKENS)
    translator.apply(batch(stored([11, 12, 13], TOKENS[:3 * B])))
    changes = translator.take()
    assert changes.stored[POOL] == ours[1:] and changes.removed[POOL] == ours[:1]
    assert translator.listing() == {POOL: ours[1:]}


BAD_EVENTS = {
    "an unknown event type": {"type": "BlockMoved", "block_hashes": [1]},
    "a field of the wrong type": stored("eleven", TOKENS[:B]),
    "a missing field": {"type": "BlockStored", "block_hashes": [1], "block_size": B},
    "a partial block (prefix_match_unit)": stored([31], TOKENS[:8], block_size=8),
    "tokens that are not the blocks'": stored([32, 33], TOKENS[:B]),
    "a LoRA adapter's blocks": stored([34], TOKENS[:B], lora_name="sql-adapter", lora_id=1),
    "multimodal extra keys": stored([35], TOKENS[:B], extra_keys=[[["img-1", 0], SALT]]),
    "extra keys past the first block": stored([36, 37], TOKENS[:2 * B], extra_keys=[[SALT], [b"\x00" * 32]]),
    "extra keys not one per block": stored([38], TOKENS[:B], extra_keys=[[SALT], None]),
    "an unknown medium": stored([39], TOKENS[:B], medium="REMOTE_GPU"),
    "a token id past int64": stored([40], [2**63] + TOKENS[1:B]),
    "not a map": [1, 2, 3],
}


@pytest.mark.parametrize("kind", sorted(BAD_EVENTS))
def test_an_event_that_does_not_fit_is_logged_and_skipped_and_its_batch_goes_on(translator, kind, caplog):
    with caplog.at_level(logging.WARNING, logger="switchyard.engine"):
        translator.apply(batch(BAD_EVENTS[kind], stored([11], TOKENS[:B])))
    assert translator.take().stored == {POOL: chain(TOKENS)[:1]}
    assert translator.num_skipped == 1
    assert "vLLM KV events: skipped" in caplog.text


@pytest.mark.parametrize("payload", [b"", b"\xc1 not msgpack", msgspec.msgpack.encode({"ts": 1.0}),
                                     msgspec.msgpack.encode([1.0]), msgspec.msgpack.encode([1.0, "events", 0])],
                         ids=["empty", "not msgpack", "a map", "too short", "events not a list"])
def test_a_payload_that_is_not_a_batch_is_skipped(translator, payload):
    translator.apply(payload)
    assert translator.take().is_empty and translator.num_skipped == 1
    translator.apply(batch(stored([11], TOKENS[:B])))  # and the next batch is read as ever
    assert translator.take().stored[POOL] == chain(TOKENS)[:1]


def test_each_kind_of_misfit_warns_once(translator, caplog):
    with caplog.at_level(logging.WARNING, logger="switchyard.engine"):
        for _ in range(3):
            translator.apply(batch(stored([39], TOKENS[:B], medium="REMOTE_GPU")))
    assert caplog.text.count("skipped") == 1 and translator.num_skipped == 3


_SUBSCRIBER_ON_VLLMS_PUBLISHER = """
import json, shutil, sys, tempfile, time
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher
from switchyard.workers.vllm_engine import kv_events
from switchyard.workers.vllm_engine.kv_events import VllmKVEvents

tokens, salt = json.loads(sys.argv[1])
socket_dir = tempfile.mkdtemp()
endpoint = f"ipc://{socket_dir}/events.sock"
publisher = ZmqEventPublisher(0, endpoint=endpoint)
events = VllmKVEvents(endpoint, "", 16)
class Holder: pass
llm = Holder(); llm.engine_core = Holder(); llm.engine_core.engine_core = Holder()
llm.engine_core.engine_core.scheduler = Holder()
llm.engine_core.engine_core.scheduler.kv_event_publisher = publisher  # where vLLM 0.32 keeps it
assert events.watch(llm)
publisher = llm.engine_core.engine_core.scheduler.kv_event_publisher

def stored(hashes, start, parent=None):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens[start:start + 16 * len(hashes)],
                       block_size=16, lora_id=None, medium="GPU", lora_name=None,
                       extra_keys=[(salt,)] + [None] * (len(hashes) - 1) if parent is None else None, group_idx=0)

out = {}
publisher.publish(KVEventBatch(ts=time.time(), events=[stored([5, 6], 0)]))
publisher.publish(KVEventBatch(ts=time.time(), events=[stored([7], 32, parent=6), BlockRemoved(block_hashes=[5],
                                                                                             medium="GPU")]))
t0 = time.perf_counter()
changes = events.take()  # no sleep: take waits for what was published
out["waited_s"] = time.perf_counter() - t0
out["stored"], out["removed"] = [str(h) for h in changes.stored["pool"]], [str(h) for h in changes.removed["pool"]]
publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
out["cleared"] = [str(h) for h in events.take().removed["pool"]]
# A receiver that has stopped holds no step up for long, and the next not at all.
events.close()
publisher.publish(KVEventBatch(ts=time.time(), events=[stored([8], 0)]))
t0 = time.perf_counter()
events.take()
events.take()
out["stopped_s"] = time.perf_counter() - t0
publisher.shutdown()
shutil.rmtree(socket_dir)
print(json.dumps(out))
"""


def test_the_subscriber_reads_vllms_own_publisher_and_each_take_has_every_batch_published(vllm_env_python):
    tokens = list(range(2000, 2000 + 3 * B + 1))
    done = subprocess.run([vllm_env_python, "-c", _SUBSCRIBER_ON_VLLMS_PUBLISHER, json.dumps([tokens, SALT])],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    ours = [str(h) for h in chain(tokens)]
    assert out["stored"] == ours[1:] and out["removed"] == ours[:1]  # block 0 stored and removed: only removed
    assert out["cleared"] == ours[1:]
    assert out["waited_s"] < 0.2 and out["stopped_s"] < 0.5
