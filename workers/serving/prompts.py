"""Turning a wire request into prompt token ids, and the checks that reject it before any compute.

The chat template is applied here, on the worker: the gateway stays model-agnostic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from jinja2 import TemplateError

from switchyard.shared.kv_events import PrefixSegment, cache_salt
from switchyard.shared.messages import ErrorInfo, GenerateRequest
from switchyard.shared.safety import filter_for
from switchyard.workers.serving.guided import GrammarError, response_format_grammar
from switchyard.workers.serving.prefix_segments import prefix_segments
from switchyard.workers.serving.tool_calls import call_grammar, chat_messages

MAX_N = 16

MatcherT = TypeVar("MatcherT")
MatcherT_co = TypeVar("MatcherT_co", covariant=True)


class RequestRejected(Exception):
    """The request cannot run on this engine; ``error`` is what the client gets."""

    def __init__(self, error: ErrorInfo) -> None:
        super().__init__(error.message)
        self.error = error


def _render_chat(tokenizer, messages: list[dict], tools: list | None = None) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except TemplateError as exc:  # e.g. "roles must alternate": the template's own check of the conversation
        raise RequestRejected(ErrorInfo(f"The model's chat template rejected the messages: {exc}",
                                        code="invalid_request", param="messages")) from exc


def _encode_chat(tokenizer, messages: list[dict], tools: list | None = None) -> list[int]:
    # The template already wrote every special token it wants (BOS included, if any).
    return tokenizer.encode(_render_chat(tokenizer, messages, tools), add_special_tokens=False)


def _encode_chat_segmented(tokenizer, req: GenerateRequest, block_size: int) -> tuple[list[int], list[PrefixSegment]]:
    """As ``_encode_chat``, with the blocks each message prefix comes to (prefix_segments.py); a tokenizer that
    gives no character offsets (not a fast one) gives no segments."""
    assert req.messages is not None
    messages, tools = chat_messages(tokenizer, req.messages, req.tool_use)
    text = _render_chat(tokenizer, messages, tools)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer.encode(text, add_special_tokens=False), []
    encoding = backend.encode(text, add_special_tokens=False)
    ids = list(encoding.ids)
    return ids, prefix_segments(req, messages, text, ids, encoding.offsets, cache_salt(req), block_size)


def tokenize_prompt(tokenizer, req: GenerateRequest) -> tuple[list[int], str]:
    """Prompt token ids, and the request parameter they came from (for error messages)."""
    if req.messages is not None:
        return _encode_chat(tokenizer, *chat_messages(tokenizer, req.messages, req.tool_use)), "messages"
    if req.prompt is not None:
        return tokenizer.encode(req.prompt), "prompt"
    if req.prompt_token_ids is not None:
        return list(req.prompt_token_ids), "prompt"
    raise RequestRejected(ErrorInfo(message="Either prompt or messages is required.", code="invalid_request",
                                    param="prompt"))


def fit_history(tokenizer, req: GenerateRequest, max_context: int) -> tuple[list[int], int]:
    """Chat prompt ids for a server-side conversation, dropping its oldest turns until the prompt and the
    requested completion fit the context; system messages and the newest message are always kept.

    Returns the ids and how many messages were dropped (0 when it fit). If even the shortest history does not
    fit, the shortest is returned and the usual context check rejects it. The number to drop is found by bisection
    (dropping more never lengthens the prompt): a few renders of the template, not one per message dropped.
    """
    messages, tools = chat_messages(tokenizer, req.messages or [], req.tool_use)
    room = max_context - (req.sampling.max_tokens or 1)
    droppable = [i for i, m in enumerate(messages[:-1]) if m["role"] != "system"]

    def without_oldest(k: int) -> list[int]:
        gone = set(droppable[:k])
        return _encode_chat(tokenizer, [m for i, m in enumerate(messages) if i not in gone], tools)

    ids = without_oldest(0)
    if len(ids) <= room or not droppable:
        return ids, 0
    low, high = 0, len(droppable)  # dropping `low` does not fit; dropping `high` fits, or is all there is to drop
    fitting = without_oldest(high)
    while high - low > 1:
        middle = (low + high) // 2
        candidate = without_oldest(middle)
        if len(candidate) <= room:
            high, fitting = middle, candidate
        else:
            low = middle
    return fitting, high


class GrammarCompiler(Protocol[MatcherT_co]):
    """What compiles the grammar a request's output must follow: ours hands out an llguidance matcher
    (guided.Grammars); the vLLM engine hands out the grammar's text once it compiles here (vLLM compiles its own)."""

    def matcher(self, grammar: str) -> MatcherT_co:
        """The compiled ``grammar``, at its start; raises ``GrammarError`` (or ``ValueError``) when it cannot be."""
        ...


@dataclass(frozen=True, slots=True)
class PreparedPrompt(Generic[MatcherT]):
    """A request's prompt, tokenized and checked against the context: what ``Engine.add_request`` needs from the
    tokenizer, made before the step thread sees the request (``prepare_prompt``). ``MatcherT``: what the engine's
    ``GrammarCompiler`` makes of a grammar."""

    token_ids: list[int]
    max_tokens: int  # new tokens the request may produce
    num_dropped_messages: int = 0  # conversation turns dropped to fit the context
    matcher: MatcherT | None = None  # the grammar its output must follow, at its start (workers/serving/guided.py)
    # The blocks each message prefix comes to, for the worker's KV events (asked for with segment_block_size).
    prefix_segments: list[PrefixSegment] = field(default_factory=list)


def request_grammar(req: GenerateRequest) -> str | None:
    """The grammar ``req``'s output must follow (its tool use and response format), None for free text."""
    content = None
    if req.response_format is not None and req.response_format.type != "text":
        content = response_format_grammar(req.response_format)
    if req.tool_use is not None and (grammar := call_grammar(req.tool_use, req.response_format)) is not None:
        return grammar
    return content


def prepare_prompt(tokenizer, req: GenerateRequest, max_context: int,
                   grammars: GrammarCompiler[MatcherT] | None = None,
                   vocab_size: int | None = None, segment_block_size: int | None = None) -> PreparedPrompt[MatcherT]:
    """Tokenize ``req`` (chat template included), compile the grammar its output must follow (with
    ``grammars``), and check it can run; raises ``RequestRejected`` for what never can. Touches nothing but
    ``tokenizer`` and ``grammars``: the worker runs it on its intake thread with a tokenizer of its own, so chat
    templates, tokenization and grammar compilation stay out of the engine's step. ``vocab_size``: the model's
    logits; token ids beyond it (in the prompt or ``logit_bias``) are refused, since they would fail its step.
    ``segment_block_size``: a chat request's message prefixes are mapped to the blocks of this size they come to
    (``PreparedPrompt.prefix_segments``), for an engine that publishes KV events."""
    if req.embed is not None:
        raise RequestRejected(ErrorInfo(f"The model `{req.model}` generates text and gives no embeddings.",
                                        code="invalid_request", param="model"))
    if not 1 <= req.sampling.n <= MAX_N:
        raise RequestRejected(ErrorInfo(f"n must be between 1 and {MAX_N}, got {req.sampling.n}.",
                                        code="invalid_value", param="n"))
    dropped = 0
    segments: list[PrefixSegment] = []
    if req.truncate_history and req.messages:
        prompt_ids, dropped = fit_history(tokenizer, req, max_context)
        param = "messages"
    elif segment_block_size and req.messages is not None:
        (prompt_ids, segments), param = _encode_chat_segmented(tokenizer, req, segment_block_size), "messages"
    else:
        prompt_ids, param = tokenize_prompt(tokenizer, req)
    if not prompt_ids:  # nothing to continue from: no logits to sample a first token from (vLLM refuses it too)
        raise RequestRejected(ErrorInfo(f"The {param} is empty: it has no tokens to continue from.",
                                        code="invalid_value", param=param))
    vocab = _vocabulary_size(tokenizer, vocab_size)
    for name, ids in (("prompt", prompt_ids if req.prompt_token_ids is not None else ()),
                      ("logit_bias", req.sampling.logit_bias or ())):
        if (bad := next((t for t in ids if not 0 <= t < vocab), None)) is not None:
            raise RequestRejected(ErrorInfo(f"Token id {bad} in {name} is not in the model's vocabulary (0 to "
                                            f"{vocab - 1}).", code="invalid_value", param=name))
    max_tokens = resolve_max_tokens(req, len(prompt_ids), max_context, param)
    matcher: MatcherT | None = None
    try:
        grammar = request_grammar(req)
        if grammar is not None:
            if grammars is None:
                raise GrammarError("this engine has no grammar support")
            matcher = grammars.matcher(grammar)
    except (GrammarError, ValueError) as exc:
        param = "tools" if req.tool_use is not None and req.tool_use.choice != "none" else "response_format"
        raise RequestRejected(ErrorInfo(f"The {param} cannot be used for constrained decoding: {exc}",
                                        code="invalid_request", param=param)) from exc
    if req.safety is not None and req.safety.mode in ("log", "block"):
        # Compiled here, off the step thread: the first request whose policy uses the classifier loads it (about
        # a second), and a step must never wait for that.
        filter_for(req.safety)
    return PreparedPrompt(prompt_ids, max_tokens, dropped, matcher, segments)


def _vocabulary_size(tokenizer, vocab_size: int | None) -> int:
    """Token ids a prompt may hold: the model's logits and the tokenizer's vocabulary, whichever is smaller (a
    tokenizer without ``len``, a stand-in for a random-weight model, has the model's)."""
    known = [n for n in (vocab_size, len(tokenizer) if hasattr(tokenizer, "__len__") else None) if n is not None]
    if not known:
        raise ValueError("the vocabulary size is unknown: pass vocab_size for a tokenizer without len()")
    return min(known)


def resolve_max_tokens(req: GenerateRequest, num_prompt: int, max_context: int, param: str) -> int:
    """The number of new tokens the request may produce; raises ``context_length_exceeded`` before compute."""
    max_tokens = req.sampling.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise RequestRejected(ErrorInfo(message=f"max_tokens must be at least 1, got {max_tokens}.",
                                        code="invalid_value", param="max_tokens"))
    # max_tokens None means "up to the context", which still needs room for one token.
    if num_prompt + (max_tokens or 0) > max_context or num_prompt >= max_context:
        raise RequestRejected(ErrorInfo(message=_context_message(max_context, num_prompt, max_tokens, param),
                                        code="context_length_exceeded", param=param))
    return max_context - num_prompt if max_tokens is None else max_tokens


def _context_message(max_context: int, num_prompt: int, max_tokens: int | None, param: str) -> str:
    # OpenAI's wording, so clients that parse it keep working.
    head = f"This model's maximum context length is {max_context} tokens. However, "
    if max_tokens is None:
        return (head + f"your {param} resulted in {num_prompt} tokens, which leaves no room for the completion. "
                f"Please reduce the length of the {param}.")
    return (head + f"you requested {num_prompt + max_tokens} tokens ({num_prompt} in the {param}, {max_tokens} "
            f"in the completion). Please reduce the length of the {param} or completion.")


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    """Every id that ends generation: the generation config's (may be a list) and the tokenizer's."""
    ids: set[int] = set()
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (generation_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, Sequence):
            ids.update(int(v) for v in value)
    return frozenset(ids)
