"""KV events: what each worker's KV cache holds, as it changes, so that a router knows where a prefix is.

    worker ──llm.kv.<model> (core NATS)──▶ every gateway's fleet index (gateway/kv_index.py)
       one KVEventBatch per step that changed anything, and one a second at least (its load)
    gateway ──llm.kvsnap.<model> (request)──▶ every worker of the model answers with a snapshot batch: all it holds
       (at the gateway's start, and for a worker whose batches arrived with a gap)

Blocks are named by the prefix cache's salted hash chain (scheduler/kv_cache_manager.hash_block), 16 bytes each, so
both engines speak of the same blocks and no tenant's prefix is named in another's chain. A worker's ``pool`` is its
own; the ``host`` and ``disk`` tiers are its node's (workers/kv_tiers/: shared by the node's workers of the model),
so a block there serves any worker on that node.

The gateway does not tokenize (the fast tokenizer and the chat template cost several milliseconds for a 4K-token
prompt, ten times the routing budget); it hashes the chat messages instead (``message_prefix_keys``), and workers
publish which blocks each message prefix they tokenized comes to (``PrefixSegment``): message prefix k's blocks are
its parent's blocks and its segment's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from switchyard.shared.messages import GenerateRequest

KV_EVENTS_PREFIX = "llm.kv"
KV_SNAPSHOT_PREFIX = "llm.kvsnap"
KV_BLOCKS_PREFIX = "llm.kvblk"  # a node's block files, asked for by workers of other nodes (request-reply)
HASH_BYTES = 16

POOL, HOST, DISK = "pool", "host", "disk"
TIERS = (POOL, HOST, DISK)


def events_subject(model_token: str) -> str:
    return f"{KV_EVENTS_PREFIX}.{model_token}"


def snapshot_subject(model_token: str) -> str:
    return f"{KV_SNAPSHOT_PREFIX}.{model_token}"


def blocks_subject(model_token: str, node: str) -> str:
    """Where ``node``'s workers serve its tiers' blocks (a node names a host, which may hold dots: a digest)."""
    return f"{KV_BLOCKS_PREFIX}.{model_token}.{hashlib.blake2b(node.encode(), digest_size=8).hexdigest()}"


class PrefixSegment(msgspec.Struct, array_like=True, frozen=True):
    """Message prefix ``key`` (``message_prefix_keys``) comes to its ``parent`` prefix's blocks followed by ``hashes``
    (16 bytes each, concatenated): the full blocks that end within its last message."""

    key: bytes
    parent: bytes | None
    hashes: bytes


class KVEventBatch(msgspec.Struct, frozen=True):
    """One worker's KV changes since its last batch (or, with ``snapshot``, everything it holds)."""

    worker_id: str
    node: str  # the host: the host and disk tiers are shared by its workers
    epoch: str  # the worker process's start: a new epoch means its pool starts empty
    seq: int  # +1 per batch of this epoch; a gap means batches were lost (the index asks for a snapshot)
    block_size: int
    stored: dict[str, bytes] = msgspec.field(default_factory=dict)  # tier -> 16-byte hashes, concatenated
    removed: dict[str, bytes] = msgspec.field(default_factory=dict)
    prefixes: list[PrefixSegment] = msgspec.field(default_factory=list)
    snapshot: bool = False  # stored is all the worker holds: it replaces what the index knew of it
    load: float = 0.0  # (running + waiting) / seats
    kv_usage: float = 0.0  # of the pool
    backlog_tokens: int = 0  # prompt tokens queued to compute: what a new request's first token would wait behind
    role: str = "both"  # the worker's (WorkerConfig.role): a prefill worker's blocks are a source, never a place


def split_hashes(packed: bytes) -> list[bytes]:
    return [packed[i:i + HASH_BYTES] for i in range(0, len(packed), HASH_BYTES)]


def pack_hashes(hashes: list[int]) -> bytes:
    """Block hashes as the scheduler keeps them (ints) to the wire's 16-byte form."""
    return b"".join(h.to_bytes(HASH_BYTES, "little") for h in hashes)


def cache_salt(req: GenerateRequest) -> str:
    """The prefix-cache scope of ``req``'s blocks (vLLM's ``cache_salt`` idea, given to vLLM as is by its engine):
    a tenant's blocks are found only by its own requests, unless the operator shares them (see GenerateRequest)."""
    return "shared" if req.shared_prefix_cache else f"tenant:{req.tenant_id or ''}"


def message_prefix_keys(salt: str, context: bytes, messages: Sequence[tuple[str, str, object]]) -> list[bytes]:
    """``keys[k]`` names the conversation prefix ``messages[:k + 1]`` (each ``(role, content, tool_calls)``) of one
    cache salt, rendered with ``context`` (what else shapes the prompt: the tools offered): the same on the gateway
    and on the worker, chained so that key k depends on every earlier message. The salt keeps one tenant's keys
    from naming another's conversations."""
    keys = []
    digest = hashlib.blake2b(msgspec.msgpack.encode([salt]) + context, digest_size=HASH_BYTES)
    for message in messages:
        digest.update(msgspec.msgpack.encode(message))
        keys.append(digest.copy().digest())
    return keys


def request_prefix_keys(req: GenerateRequest) -> list[bytes]:
    """``message_prefix_keys`` of a chat request: its salt, the tools it offers (they shape the rendered prompt),
    and its messages as the wire has them; the gateway and the worker both compute it so."""
    messages = [(m.role, m.content, m.tool_calls) for m in req.messages or []]
    return message_prefix_keys(cache_salt(req), msgspec.msgpack.encode(req.tool_use), messages)
