"""Cache-aware placement: which worker already holds a request's prefix in its KV cache.

    reply ends ──▶ record: hash(scope, messages + reply) ──▶ the worker that served it     (KV bucket `affinity`,
                   and, for a long system prompt, hash(scope, system prompt) ──▶ that worker  10 min, every gateway)
    next turn  ──▶ lookup: hash(scope, messages[:-1]) (the history, the last reply included), else the system
                   prompt's ──▶ a live worker of the model? offer it there first (relay.submit: llm.aff.<worker>)

A chat client sends the whole history each turn, so the history of turn n+1 is turn n's messages and reply: the
hash of one is the hash of the other, and the worker that answered turn n has all of it cached. The scope is the
prefix cache's own (the tenant, or everyone for a shared cache), so placement never tells one tenant what another
sent. The offer lasts ``affinity_wait_s``: a busy preferred worker does not hold the request up, it goes to the
shared queue (pull-based admission and tier order unchanged), as does anything whose prefix no one holds.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict

import msgspec
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError
from nats.js.kv import KeyValue

from switchyard.shared import subjects
from switchyard.shared.messages import ChatMessage, GenerateRequest, ToolCall

AFFINITY_TTL_S = 600.0
LONG_SYSTEM_PROMPT = 1024  # characters: a system prompt this long is worth placing by
_LOOKUP_TIMEOUT_S = 0.05  # a KV read that slow is not worth waiting for: the request goes to the shared queue
_LOCAL = 4096  # this gateway's own records, kept to answer without a KV read

log = logging.getLogger("switchyard.gateway")
_encoder = msgspec.msgpack.Encoder()


def scope(request: GenerateRequest) -> str:
    """The prefix cache's scope (workers/engine: the cache salt): a tenant's own, or shared."""
    return "shared" if request.shared_prefix_cache else f"tenant:{request.tenant_id or ''}"


def prefix_key(request: GenerateRequest, messages: list[ChatMessage]) -> str:
    digest = hashlib.sha256(scope(request).encode())
    digest.update(_encoder.encode([request.model, [(m.role, m.content, m.tool_calls) for m in messages]]))
    return digest.hexdigest()[:40]


def system_key(request: GenerateRequest) -> str | None:
    if not request.messages:
        return None
    first = request.messages[0]
    if first.role != "system" or len(first.content) < LONG_SYSTEM_PROMPT:
        return None
    return prefix_key(request, [first])


class AffinityIndex:
    """Prefix hash -> the worker that last served it, shared by every gateway through NATS KV."""

    def __init__(self, js: JetStreamContext, replicas: int = 1) -> None:
        self._js = js
        self._replicas = replicas
        self._kv: KeyValue | None = None
        self._local: OrderedDict[str, str] = OrderedDict()

    def tenant_state(self) -> dict[str, int]:
        """This gateway's own records (conversation turns, long system prompts), shared/tenant_state.py."""
        return {"affinity_records": len(self._local)}

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            try:
                self._kv = await self._js.key_value(subjects.AFFINITY_BUCKET)
            except BucketNotFoundError:
                self._kv = await self._js.create_key_value(KeyValueConfig(
                    bucket=subjects.AFFINITY_BUCKET, storage=StorageType.MEMORY, ttl=AFFINITY_TTL_S,
                    history=1, replicas=self._replicas))
        return self._kv

    async def lookup(self, request: GenerateRequest) -> str | None:
        """The worker that holds the longest known prefix of ``request`` (chat only), or None."""
        if not request.messages or request.sampling.n != 1:
            return None
        # Only a history that ends with a reply can have been recorded (record keys end with one): a first turn
        # costs no KV read for it.
        follows_a_reply = len(request.messages) > 1 and request.messages[-2].role == "assistant"
        keys = [k for k in (prefix_key(request, request.messages[:-1]) if follows_a_reply else None,
                            system_key(request)) if k]
        for key in keys:
            worker = self._local.get(key) or await self._read(key)
            if worker:
                return worker
        return None

    async def _read(self, key: str) -> str | None:
        try:
            kv = await self._bucket()
            entry = await asyncio.wait_for(kv.get(key), _LOOKUP_TIMEOUT_S)
            return entry.value.decode() if entry.value else None
        except (TimeoutError, KeyNotFoundError):
            return None
        except Exception as exc:  # NATS away: placement is a hint, the request goes to the shared queue
            log.debug("affinity lookup failed: %r", exc)
            return None

    async def record(self, request: GenerateRequest, reply: str, tool_calls: list[ToolCall], worker_id: str | None
                     ) -> None:
        """``worker_id`` served ``request`` with ``reply``: the next turn's history, and a long system prompt,
        are found there."""
        if not worker_id or not request.messages or request.sampling.n != 1:
            return
        history = [*request.messages, ChatMessage("assistant", reply, tool_calls=tool_calls or None)]
        keys = [k for k in (prefix_key(request, history), system_key(request)) if k]
        for key in keys:
            self._local[key] = worker_id
            self._local.move_to_end(key)
        while len(self._local) > _LOCAL:
            self._local.popitem(last=False)
        try:
            kv = await self._bucket()
            for key in keys:
                await kv.put(key, worker_id.encode())
        except Exception as exc:  # a hint lost: the next turn goes to the shared queue
            log.debug("affinity record failed: %r", exc)
