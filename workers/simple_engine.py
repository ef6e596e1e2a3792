"""The simple engine: continuous batching at request granularity, one HF forward per running request per step.

Each request keeps its own ``DynamicCache``, so a step runs one prefill (new requests) or one decode token (the
others) per request, then samples all of them in one batched call. It is correct and easy to check against HF
``generate``, but slow at batch > 1; the paged engine replaces it behind the same interface::

    add_request(GenerateRequest) -> prompt tokens      (raises RequestRejected)
    abort_request(request_id)
    step() -> list[TokenDelta]                         (at most one per running request)
    has_unfinished_requests(), num_free_slots, max_context
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from shared.messages import ErrorInfo, GenerateRequest, SamplingParams, TokenDelta, Usage
from workers.detokenizer import IncrementalDetokenizer
from workers.sampling import make_generator, sample


class RequestRejected(Exception):
    """The request cannot run on this engine; ``error`` is what the client gets."""

    def __init__(self, error: ErrorInfo) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(slots=True)
class _Sequence:
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    max_tokens: int  # resolved: never past the model's context
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    cache: object | None = None  # the request's HF KV cache, created by its prefill
    num_unreported_tokens: int = 0  # generated since the last TokenDelta (held-back text sends no message)
    is_aborted: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class SimpleEngine:
    """Runs up to ``max_num_seqs`` requests at once on a Hugging Face causal LM."""

    def __init__(self, model, tokenizer, max_num_seqs: int = 16) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self._device = next(model.parameters()).device
        self._eos_token_ids = _eos_token_ids(model, tokenizer)
        self._running: dict[str, _Sequence] = {}  # insertion order = arrival order

    @property
    def max_context(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def num_free_slots(self) -> int:
        return self.max_num_seqs - len(self._running)

    def has_unfinished_requests(self) -> bool:
        return bool(self._running)

    def add_request(self, req: GenerateRequest) -> int:
        """Tokenize and admit ``req``; returns its prompt token count.

        Raises ``RequestRejected`` for requests that can never run here (too long for the context, n > 1,
        no prompt), before any compute. Raises ``RuntimeError`` when called without a free slot.
        """
        params = req.sampling
        if params.n != 1:
            raise RequestRejected(ErrorInfo(
                message=f"n={params.n} is not supported by this worker; only n=1 is.",
                code="unsupported_value", param="n"))
        if params.max_tokens is not None and params.max_tokens < 1:
            raise RequestRejected(ErrorInfo(
                message=f"max_tokens must be at least 1, got {params.max_tokens}.",
                code="invalid_value", param="max_tokens"))
        if req.request_id in self._running:
            raise ValueError(f"request {req.request_id!r} is already running")
        if self.num_free_slots <= 0:
            raise RuntimeError("add_request called with no free slot; check num_free_slots first")

        prompt_ids, param = self._tokenize_prompt(req)
        num_prompt = len(prompt_ids)
        requested = num_prompt + (params.max_tokens or 0)
        # max_tokens None means "up to the context", which still needs room for one token.
        if requested > self.max_context or num_prompt >= self.max_context:
            raise RequestRejected(ErrorInfo(message=self._context_message(num_prompt, params.max_tokens, param),
                                            code="context_length_exceeded", param=param))

        max_tokens = self.max_context - num_prompt if params.max_tokens is None else params.max_tokens
        self._running[req.request_id] = _Sequence(
            request_id=req.request_id,
            params=params,
            prompt_token_ids=prompt_ids,
            max_tokens=max_tokens,
            detokenizer=IncrementalDetokenizer(self.tokenizer, stop=params.stop, prompt_token_ids=prompt_ids),
            generator=make_generator(params.seed, self._device),
        )
        return num_prompt

    def abort_request(self, request_id: str) -> bool:
        """Finish ``request_id`` with ``cancelled`` at the next step; False if it is not running."""
        seq = self._running.get(request_id)
        if seq is None:
            return False
        seq.is_aborted = True
        return True

    def step(self) -> list[TokenDelta]:
        """Advance every running request by one token; returns at most one delta per request.

        Aborted requests finish first (``cancelled``, no compute); a request whose new text is all held back
        (split character, possible stop string) gets no delta this step, and its token is counted in the next.
        """
        outputs: list[TokenDelta] = []
        active: list[_Sequence] = []
        for seq in list(self._running.values()):
            if seq.is_aborted:
                outputs.append(self._finish(seq, "cancelled", ""))
            else:
                active.append(seq)
        if not active:
            return outputs

        with torch.inference_mode():
            logits = torch.cat([self._forward(seq) for seq in active])
            token_ids = sample(
                logits,
                [seq.params for seq in active],
                [seq.generator for seq in active],
                prompt_token_ids=[seq.prompt_token_ids for seq in active],
                output_token_ids=[seq.output_token_ids for seq in active],
            ).tolist()

        for seq, token_id in zip(active, token_ids):
            delta = self._append_token(seq, token_id)
            if delta is not None:
                outputs.append(delta)
        return outputs

    # -- internals ---------------------------------------------------------------------------------------------

    def _tokenize_prompt(self, req: GenerateRequest) -> tuple[list[int], str]:
        if req.messages is not None:
            messages = [{"role": m.role, "content": m.content} for m in req.messages]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            # The template already wrote every special token it wants (BOS included, if any).
            return self.tokenizer.encode(text, add_special_tokens=False), "messages"
        if req.prompt is not None:
            return self.tokenizer.encode(req.prompt), "prompt"
        raise RequestRejected(ErrorInfo(message="Either prompt or messages is required.",
                                        code="invalid_request", param="prompt"))

    def _context_message(self, num_prompt: int, max_tokens: int | None, param: str) -> str:
        # OpenAI's wording, so clients that parse it keep working.
        head = f"This model's maximum context length is {self.max_context} tokens. However, "
        if max_tokens is None:
            return (head + f"your {param} resulted in {num_prompt} tokens, which leaves no room for the completion. "
                    f"Please reduce the length of the {param}.")
        return (head + f"you requested {num_prompt + max_tokens} tokens ({num_prompt} in the {param}, {max_tokens} "
                f"in the completion). Please reduce the length of the {param} or completion.")

    def _forward(self, seq: _Sequence) -> torch.Tensor:
        """Last-position logits ``[1, V]``: the whole prompt on the first step, then the last sampled token."""
        if seq.cache is None:
            seq.cache = DynamicCache(config=self.model.config)
            input_ids = seq.prompt_token_ids
        else:
            input_ids = seq.output_token_ids[-1:]
        out = self.model(
            input_ids=torch.tensor([input_ids], device=self._device),
            past_key_values=seq.cache,
            use_cache=True,
            logits_to_keep=1,  # skip the vocab projection for every prompt position but the last
        )
        return out.logits[:, -1, :]

    def _append_token(self, seq: _Sequence, token_id: int) -> TokenDelta | None:
        seq.output_token_ids.append(token_id)
        seq.num_unreported_tokens += 1
        if token_id in self._eos_token_ids and not seq.params.ignore_eos:
            return self._finish(seq, "stop", seq.detokenizer.flush())
        text = seq.detokenizer.add_token(token_id)
        if seq.detokenizer.is_stopped:
            return self._finish(seq, "stop", text)
        if len(seq.output_token_ids) >= seq.max_tokens:
            return self._finish(seq, "length", text + seq.detokenizer.flush())
        if not text:
            return None  # held back (split character or possible stop string): nothing worth a message
        return self._delta(seq, text)

    def _delta(self, seq: _Sequence, text: str, finish_reason: str | None = None,
               usage: Usage | None = None) -> TokenDelta:
        delta = TokenDelta(request_id=seq.request_id, text=text, num_tokens=seq.num_unreported_tokens,
                           finish_reason=finish_reason, usage=usage)
        seq.num_unreported_tokens = 0
        return delta

    def _finish(self, seq: _Sequence, finish_reason: str, text: str) -> TokenDelta:
        del self._running[seq.request_id]
        seq.cache = None
        usage = Usage(prompt_tokens=seq.num_prompt_tokens, completion_tokens=len(seq.output_token_ids))
        return self._delta(seq, text, finish_reason, usage)


def _eos_token_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (generation_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, Sequence):
            ids.update(int(v) for v in value)
    return frozenset(ids)
