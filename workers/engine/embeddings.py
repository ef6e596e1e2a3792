"""The embeddings engine: a ``ServingEngine`` (workers/serving/interface.py) over a sentence-embedding model, so a
worker serves ``/v1/embeddings`` with the same intake, tiers, tenants, usage records and drain as chat.

    intake thread  prepare: tokenize the texts (or frame the token ids), check lengths and ``dimensions``
    step thread    add_request ─▶ queue (tier order, then arrival)
                   step: the next ``max_num_seqs`` inputs of the queued requests, whoever's ─▶ the embedder
                         (``Embedder.embed``) ─▶ vectors
                         ─▶ one delta per request per step with its new vectors (split where a NATS message
                         would overflow); a request's last has usage and ``is_last``

The embedder runs the model: ours (workers/engine/embedding_model.py: padded forwards of length-sorted inputs) or
vLLM's pooling runner (workers/vllm_engine/embedder.py, ``--engine vllm``). Queue, tiers, deltas and usage are
this module's whichever runs it, so the wire is the same.

A request of many inputs takes several steps, and inputs of several requests share a forward: the step is the
batch, as a decode step is the chat engine's. Nothing is generated, so a request's usage is its prompt tokens.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import NoReturn, Protocol

import numpy as np

from switchyard.shared.config import EngineSettings
from switchyard.shared.messages import ErrorInfo, GenerateRequest, TokenDelta, Usage
from switchyard.shared.tiers import BATCH_TIER, get_tier
from switchyard.workers.serving.interface import EngineCapabilities, EngineCapacity, EngineStats, RequestRejected

log = logging.getLogger("switchyard.engine")

MAX_DELTA_BYTES = 512 * 1024  # vectors per delta: well inside NATS's default 1 MiB message
_INTERNAL = ErrorInfo("The worker had an error processing your request.", code="internal_error",
                      type="server_error", status=500)


class Vocabulary(Protocol):
    """What the engine reads of a tokenizer itself: how many token ids there are (a client's ids are checked)."""

    @property
    def vocab_size(self) -> int: ...


class Embedder(Protocol):
    """What the engine needs of a model: its inputs as token ids (``EmbeddingInputs``), and their vectors."""

    tokenizer: Vocabulary
    max_tokens: int  # the longest input, in tokens (special tokens included)
    dimensions: int

    @property
    def device_type(self) -> str: ...

    def tokenize(self, texts: list[str]) -> list[list[int]]: ...

    def with_special_tokens(self, ids: list[int]) -> list[int]: ...

    def embed(self, batch: list[list[int]]) -> np.ndarray:
        """float32 [len(batch), dimensions], in ``batch``'s order; however many forwards it takes."""
        ...

    def close(self) -> None: ...


@dataclass(slots=True)
class PreparedInputs:
    """A request's inputs as token ids, framed and checked (``EmbeddingEngine.prepare``)."""

    ids: list[list[int]]
    num_dropped_messages: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(i) for i in self.ids)


@dataclass(slots=True)
class _Queued:
    request: GenerateRequest
    inputs: PreparedInputs
    next_input: int = 0  # inputs before it have their vectors sent
    vectors: list[bytes] = field(default_factory=list)  # this step's
    ended: ErrorInfo | str | None = None  # aborted: the error, or "cancelled"


def _rejected(message: str, param: str, code: str = "invalid_request") -> RequestRejected:
    return RequestRejected(ErrorInfo(message, code=code, param=param, status=400))


class EmbeddingEngine:
    """See the module docstring; the worker calls it as workers/serving/interface.py says."""

    def __init__(self, model: Embedder, settings: EngineSettings, name: str = "") -> None:
        self.model = model
        self.name = name
        self.max_num_seqs = settings.max_num_seqs  # inputs per step
        self.kv_block_size = settings.block_size  # no KV cache: its (empty) KV events say the worker's
        self._queue: deque[_Queued] = deque()
        self._ending: list[_Queued] = []  # aborted: their finals go out with the next step
        self.num_steps_run = 0  # steps that ran the model
        self._last_batch = (0, 0)

    # -- what the worker reads ------------------------------------------------------------------------------
    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(background_limit=True)

    @property
    def max_context(self) -> int:
        return self.model.max_tokens

    @property
    def device_type(self) -> str:
        return self.model.device_type

    def capacity(self) -> EngineCapacity:
        # A seat is a request; the step decides how many inputs run. No KV cache to fill.
        waiting = sum(1 for q in self._queue if q.next_input == 0)
        return EngineCapacity(self.max_num_seqs, max(0, self.max_num_seqs - len(self._queue)),
                              len(self._queue) - waiting, waiting, waiting, 0.0)

    def stats(self) -> EngineStats:
        running: dict[str, int] = {}
        for q in self._queue:
            running[q.request.tier] = running.get(q.request.tier, 0) + 1
        return EngineStats(running, {}, 0.0, 0, 0, 0, *self._last_batch)

    def take_safety_events(self) -> list:
        return []  # nothing generated, nothing to judge

    def take_kv_changes(self) -> None:
        """No KV events from this engine."""
        return None

    def kv_listing(self) -> dict[str, list[int]]:
        return {}

    def set_pause_rules(self, after_tokens: dict[str, int]) -> NoReturn:
        """Never called (``capabilities``): an embedding request holds no seat for long."""
        raise NotImplementedError("the embeddings engine does not pause requests")

    def connect_kv_peers(self, peers) -> NoReturn:
        """Never called: an embedding model keeps no KV cache (``capabilities``)."""
        raise NotImplementedError("the embeddings engine exchanges no KV blocks")

    def has_unfinished_requests(self) -> bool:
        return bool(self._queue) or bool(self._ending)

    def shutdown(self) -> None:
        """Release the model (vLLM's engine core; ours holds only memory)."""
        self.model.close()

    # -- requests -------------------------------------------------------------------------------------------
    def prepare(self, request: GenerateRequest) -> PreparedInputs:
        """Tokenize and check ``request``'s inputs (intake thread: the tokenizer is not the step's)."""
        embed = request.embed
        if embed is None:
            raise _rejected(f"The model `{request.model}` is an embedding model: use /v1/embeddings.", "model")
        if embed.dimensions is not None and embed.dimensions != self.model.dimensions:
            raise _rejected(f"The model `{request.model}` gives {self.model.dimensions}-dimensional embeddings and "
                            f"cannot be shortened to {embed.dimensions}.", "dimensions", "unsupported_parameter")
        if embed.texts is not None:
            ids = self.model.tokenize(embed.texts)
        else:
            vocab = self.model.tokenizer.vocab_size
            for i, tokens in enumerate(embed.token_ids or ()):
                if any(not 0 <= t < vocab for t in tokens):
                    raise _rejected(f"input[{i}] holds a token id outside the vocabulary (0..{vocab - 1}).", "input")
            ids = [self.model.with_special_tokens(tokens) for tokens in embed.token_ids or ()]
        for i, tokens in enumerate(ids):
            if len(tokens) > self.model.max_tokens:
                raise _rejected(f"input[{i}] is {len(tokens)} tokens; this model takes at most "
                                f"{self.model.max_tokens} per input.", "input", "context_length_exceeded")
        return PreparedInputs(ids)

    def add_request(self, request: GenerateRequest, prepared: PreparedInputs | None = None) -> int:
        prepared = prepared or self.prepare(request)
        if not prepared.ids:
            raise _rejected("input must not be empty.", "input")
        entry = _Queued(request, prepared)
        # Tier order (lower priority number first), arrival order within a tier.
        priority = get_tier(request.tier).priority
        at = next((i for i, q in enumerate(self._queue) if get_tier(q.request.tier).priority > priority),
                  len(self._queue))
        self._queue.insert(at, entry)
        return prepared.num_tokens

    def abort_request(self, request_id: str, error: ErrorInfo | None = None) -> bool:
        for q in self._queue:
            if q.request.request_id == request_id:
                self._queue.remove(q)
                q.ended = error or "cancelled"
                self._ending.append(q)
                return True
        return False

    # -- the step -------------------------------------------------------------------------------------------
    def step(self, background_limit: int | None = None) -> list[TokenDelta]:
        """The next inputs' vectors, and the finals of what ended."""
        deltas = [self._final(q) for q in self._ending]
        self._ending = []
        picked = self._pick(background_limit)
        if picked and not self._run(picked):
            return deltas + self._fail([q for q, _ in picked])
        self.num_steps_run += bool(picked)
        touched = list(dict.fromkeys(q.request.request_id for q, _ in picked))
        by_id = {q.request.request_id: q for q, _ in picked}
        for request_id in touched:
            q = by_id[request_id]
            done = q.next_input >= len(q.inputs.ids)
            deltas += self._vector_deltas(q, done)
            if done:
                self._queue.remove(q)
        return deltas

    def _pick(self, background_limit: int | None) -> list[tuple[_Queued, int]]:
        """(request, input index) for this step: queue order, up to ``max_num_seqs`` inputs; batch-tier inputs
        at most ``background_limit`` of them (the worker's seat rule)."""
        picked: list[tuple[_Queued, int]] = []
        background = 0
        for q in self._queue:
            is_background = q.request.tier == BATCH_TIER
            while q.next_input < len(q.inputs.ids) and len(picked) < self.max_num_seqs:
                if is_background and background_limit is not None and background >= background_limit:
                    break
                picked.append((q, q.next_input))
                q.next_input += 1
                background += is_background
            if len(picked) >= self.max_num_seqs:
                break
        return picked

    def _run(self, picked: list[tuple[_Queued, int]]) -> bool:
        """The picked inputs' vectors, onto their requests; False when the model failed (the step's requests fail,
        no other)."""
        batch = [q.inputs.ids[i] for q, i in picked]
        try:
            out = self.model.embed(batch).astype("<f4", copy=False)
        except Exception:
            log.exception("an embeddings step of %d inputs failed", len(batch))
            return False
        for (q, _), row in zip(picked, out):
            q.vectors.append(row.tobytes())
        self._last_batch = (len(picked), sum(len(ids) for ids in batch))
        return True

    def _fail(self, requests: list[_Queued]) -> list[TokenDelta]:
        """Finals of the requests a failed step ran (each once, whatever else of theirs is queued)."""
        failed = list({id(q): q for q in requests}.values())
        for q in failed:
            self._queue.remove(q)
            q.ended = _INTERNAL
        return [self._final(q) for q in failed]

    def _vector_deltas(self, q: _Queued, done: bool) -> list[TokenDelta]:
        """``q``'s vectors of this step, as many per delta as fit; the last delta of its last step is final."""
        per_delta = max(1, MAX_DELTA_BYTES // max(1, len(q.vectors[0])))
        parts = [q.vectors[i:i + per_delta] for i in range(0, len(q.vectors), per_delta)]
        q.vectors = []
        deltas = [TokenDelta(q.request.request_id, embeddings=part) for part in parts]
        if done:
            final = deltas[-1]
            final.finish_reason, final.is_last = "stop", True
            final.usage = Usage(prompt_tokens=q.inputs.num_tokens)
        return deltas

    def _final(self, q: _Queued) -> TokenDelta:
        if isinstance(q.ended, ErrorInfo):
            return TokenDelta(q.request.request_id, error=q.ended, finish_reason="error", is_last=True,
                              usage=Usage())
        return TokenDelta(q.request.request_id, finish_reason="cancelled", is_last=True, usage=Usage())
