"""Our engine's sequences for a request: one per choice, each carrying its ``Choice`` (workers/serving/choice.py)
as the scheduler's untyped ``Sequence.data``, built whole before the scheduler sees any (a request that fails
leaves nothing behind); a continuation's one choice goes on from the tokens its first worker generated."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, TypeAlias, cast

from switchyard.scheduler import Sequence
from switchyard.shared.kv_events import cache_salt
from switchyard.shared.messages import ErrorInfo, GenerateRequest
from switchyard.workers.engine.sampling import GREEDY_TEMPERATURE
from switchyard.workers.serving.choice import Choice, RequestState, check_continuable, make_choice
from switchyard.workers.serving.output_filter import OutputSafety
from switchyard.workers.serving.prompts import PreparedPrompt, RequestRejected

if TYPE_CHECKING:
    import llguidance

# A prompt prepared by our engine: its grammar, if any, as an llguidance matcher (guided.Grammars).
MatcherPrompt: TypeAlias = "PreparedPrompt[llguidance.LLMatcher]"


def choice_of(seq: Sequence) -> Choice:
    """The engine's state of ``seq``: the scheduler keeps it untyped (``Sequence.data``), and every sequence this
    engine makes carries a ``Choice`` (``new_request``)."""
    return cast(Choice, seq.data)


def resume(seq: Sequence, token_ids: list[int], text_len: int) -> None:
    """Make a new sequence go on from ``token_ids`` generated elsewhere, of whose text the client has
    ``text_len`` characters."""
    choice = choice_of(seq)
    try:
        seq.resume(token_ids)
    except ValueError as exc:
        raise RequestRejected(ErrorInfo(str(exc), code="invalid_value", param="resume")) from exc
    choice.take_up(token_ids, text_len)
    if choice.generator is not None and choice.request.params.temperature >= GREEDY_TEMPERATURE:
        # One uniform per sampled token: a seeded request goes on as it would have on the first worker.
        for _ in token_ids:
            choice.generator.random()


def new_request(req: GenerateRequest, prepared: MatcherPrompt, tokenizer, safety: OutputSafety, priority: int,
                ) -> tuple[RequestState, list[Sequence]]:
    """``req``'s state and a sequence per choice, all built before the scheduler sees any of it: a request that
    fails here (``RequestRejected``) leaves nothing behind. A continuation's one choice goes on from its tokens."""
    params, prompt_ids, max_tokens = req.sampling, prepared.token_ids, prepared.max_tokens
    check_continuable(req)
    state = RequestState(req.request_id, params, len(prompt_ids), seq_ids=[], handover=req.handover)
    arrival = time.monotonic()
    salt = cache_salt(req)
    seqs = []
    for index in range(params.n):
        seq_id = req.request_id if params.n == 1 else f"{req.request_id}#{index}"
        matcher = None
        if prepared.matcher is not None:  # each choice follows the grammar on its own
            matcher = prepared.matcher if index == 0 else prepared.matcher.deep_copy()
        choice = make_choice(req, state, index, prompt_ids, tokenizer, safety, matcher)
        seqs.append(Sequence(seq_id, list(prompt_ids), max_tokens, priority=priority, arrival=arrival, data=choice,
                             cache_salt=salt, tenant=req.tenant_id or ""))
        state.seq_ids.append(seq_id)
    if req.resume is not None:
        resume(seqs[0], req.resume.token_ids, req.resume.text_len)
    return state, seqs
