"""Wire messages, encoded as msgpack through msgspec structs.

Every message that crosses a process boundary is defined here and nowhere else. Fields have defaults so that an
older reader tolerates a newer writer (msgspec ignores unknown fields).
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec


class ToolCall(msgspec.Struct, frozen=True):
    """A function call the model made (an assistant message's ``tool_calls``), OpenAI's shape flattened."""

    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str
    tool_calls: list[ToolCall] | None = None  # an assistant message that called tools
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None


class ToolSpec(msgspec.Struct, frozen=True):
    """A function the model may call (``tools[].function``)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)  # JSON schema of the arguments object
    strict: bool = False


class ResponseFormat(msgspec.Struct, frozen=True):
    """What the output must be (``response_format``): decoding is constrained to it on the worker."""

    type: str  # json_object | json_schema
    schema: dict[str, Any] | None = None  # json_schema only
    name: str = ""
    strict: bool = False


class ToolUse(msgspec.Struct, frozen=True):
    """The request's tools and how the model may use them (``tools``, ``tool_choice``, ``parallel_tool_calls``)."""

    tools: list[ToolSpec]
    choice: str = "auto"  # none | auto | required | function (then ``function`` names it)
    function: str | None = None
    parallel: bool = True


class SamplingParams(msgspec.Struct):
    """OpenAI sampling semantics; ``temperature == 0`` means greedy."""

    max_tokens: int | None = None  # None: up to the model's context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before anything else
    echo: bool = False  # the prompt's text comes first in each choice's text (legacy completions)


class Resume(msgspec.Struct):
    """A continuation: the request ran on a worker that died, and another goes on from where the client is.

    ``token_ids`` are the tokens generated so far (their text was sent, or held back for a possible stop
    string), ``text_len`` the characters of text the client has received. The new worker computes them like a
    preempted sequence's outputs, sends only text beyond ``text_len``, and bills them with its own.
    """

    token_ids: list[int]
    text_len: int
    attempt: int = 1  # 1 for the first continuation, 2 if that worker died too, ...
    handovers: int = 0  # of those attempts, the ones a prefill worker handed over (not failures)
    # Disaggregated serving: the prefill worker that handed the request over (its usage record names both), and,
    # from a vLLM prefill worker, its KV connector's ``kv_transfer_params`` (where the prompt's blocks wait to be
    # pulled), for the decode side's vLLM. Only the continuation right after the hand-over carries them: after a
    # failover the blocks may be gone from the prefill side.
    prefill_worker: str | None = None
    kv_transfer: dict[str, Any] | None = None


class EmbedInput(msgspec.Struct, frozen=True):
    """What an embeddings request asks (``/v1/embeddings``): one vector per input, in order. Exactly one of
    ``texts`` and ``token_ids`` is set."""

    texts: list[str] | None = None
    token_ids: list[list[int]] | None = None
    dimensions: int | None = None  # None: the model's own size

    @property
    def num_inputs(self) -> int:
        return len(self.texts if self.texts is not None else self.token_ids or ())


class SafetyPolicy(msgspec.Struct):
    """How a worker filters a request's output as it is generated (workers/serving/output_filter.py): set by the
    gateway from the tenant's policy, with the deployment's whole rule set, so every worker applies the same."""

    mode: str  # block: halt the choice (finish_reason content_filter) | log: let it through, count it
    rules: dict[str, list[str]] = msgspec.field(default_factory=dict)  # category -> regexes (case-insensitive)
    classifier_threshold: float | None = None  # the profanity classifier flags at this probability; None: off
    version: str = ""  # a digest of the rules and threshold: a worker compiles each rule set once


class KVSource(msgspec.Struct, array_like=True, frozen=True):
    """A node whose shared KV tiers hold a request's prompt blocks ``[0, blocks)`` of the salted hash chain, as the
    gateway's fleet index knows it (gateway/kv_index.py): a worker elsewhere may fetch them from there rather than
    compute them (workers/kv_tiers/remote.py). A hint only: the worker verifies every block it loads."""

    node: str
    blocks: int


class GenerateRequest(msgspec.Struct):
    """Published by the gateway on ``llm.req.<model>.<tier>``.

    Exactly one of ``prompt`` or ``prompt_token_ids`` (completions) and ``messages`` (chat; the worker applies the
    chat template) is set.
    A worker that takes the request after ``deadline_at`` does not run it and answers ``queue_timeout``.
    """

    request_id: str
    model: str
    tier: str
    sampling: SamplingParams
    created_at: float  # unix seconds, when the gateway accepted it
    deadline_at: float  # unix seconds: start it before this or not at all
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tenant_id: str | None = None
    api_key_id: str | None = None
    # A server-side conversation: drop the oldest turns (never system messages) to fit the context.
    truncate_history: bool = False
    # A batch line: besides the token deltas, the worker publishes its outcome as one durable ``BatchResult``
    # to this JetStream subject (``llm.result.<batch_id>``), so results survive a restart of the batch runner.
    result_subject: str | None = None
    # Prefix-cache scope: False (the default) shares cached blocks only within the tenant, so no tenant's
    # cached_tokens reveals another's prompts; True (an operator's opt-in, GatewayConfig.shared_prefix_cache)
    # shares them with every request that opted in too.
    shared_prefix_cache: bool = False
    resume: Resume | None = None  # set on a continuation after its first worker died (gateway/failover.py)
    response_format: ResponseFormat | None = None  # None: free text
    tool_use: ToolUse | None = None  # None: no tools
    prompt_token_ids: list[int] | None = None  # a completions prompt given as token ids
    # An offer to the worker that holds the request's prefix (gateway/affinity.py): taken after this unix time, it
    # is dropped (the gateway has given it to the shared queue by then). 0: not an offer.
    affinity_until: float = 0.0
    end_user: str | None = None  # the client's ``user`` (or ``safety_identifier``), kept with its usage record
    metadata: dict[str, str] | None = None  # the client's ``metadata``, kept with its usage record
    safety: SafetyPolicy | None = None  # the output filter; None: the tenant's policy is off
    embed: EmbedInput | None = None  # an embeddings request (an embedding engine's only kind); None: generate
    # Where the deltas go: the gateway's own subject (``llm.tok.gw.<gateway_id>``), where a worker sends a step's
    # deltas of every request naming it in one message (``RoutedDelta`` lists). None: one ``TokenDelta`` a message
    # on ``llm.tok.<request_id>`` (a client of the wire protocol that subscribes per request).
    reply_subject: str | None = None
    kv_source: KVSource | None = None  # another node holding the prompt's first blocks (set by the gateway's index)
    # Disaggregated serving: in its model's prefill queue, a prefill worker runs it to its first token and ends it
    # with finish_reason HANDOVER, billing nothing; the gateway continues it on a decode worker
    # (gateway/relayed_request.py).
    handover: bool = False
    # A resumable stream (gateway/stream_resume.py): the worker keeps the deltas it sent, and if the gateway
    # relaying them dies it goes on for this long for a client to resume on another gateway. 0: not resumable.
    resumable_s: float = 0.0

    @property
    def continuable(self) -> bool:
        """Whether a run of it can be continued from the tokens it streamed (gateway/failover.py; not the stream
        resume of ``resumable_s``): one choice and no tools, as its deltas say where in the output they are for one
        choice, not for each choice or call."""
        return self.sampling.n == 1 and self.tool_use is None

    @property
    def attempt(self) -> int:
        """Which run of the request this is: 0 the first, a continuation its ``resume.attempt`` (every delta says
        it, so a gateway tells a superseded run's apart)."""
        return self.resume.attempt if self.resume is not None else 0


# The finish reason of a prefill worker's part of a request (``GenerateRequest.handover``): never a client's.
HANDOVER = "handover"


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # KV bytes the worker loaded into its pool for the prompt (from a KV tier or another host) instead of computing
    # them: on a decode worker, what a prefill worker's hand-over moved. Not a client's field.
    kv_loaded_bytes: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class ErrorInfo(msgspec.Struct):
    """An OpenAI-shaped error the gateway turns into ``{"error": {...}}`` with ``status``."""

    message: str
    code: str
    type: str = "invalid_request_error"
    param: str | None = None
    status: int = 400


class TokenLogprob(msgspec.Struct, array_like=True):
    """One generated token's log-probability under the model (raw logits, before penalties and temperature, as
    vLLM reports them), with the ``top_logprobs`` most likely tokens at that position, most likely first."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = msgspec.field(default_factory=list)


class ToolCallDelta(msgspec.Struct):
    """Part of a tool call as it is generated (OpenAI's streamed ``tool_calls`` item): the first part of a call
    has its ``id`` and ``name``, later parts more ``arguments`` text; joined, the arguments are the call's JSON."""

    index: int  # the call's position among the message's calls
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def add_tool_call_parts(calls: list[ToolCall], parts: list[ToolCallDelta] | None) -> None:
    """Fold streamed parts into whole calls, in place: a part with an id starts a call, the others add to the
    arguments of the last one."""
    for part in parts or ():
        if part.id is not None:
            calls.append(ToolCall(part.id, part.name or "", part.arguments))
        elif calls:
            last = calls[-1]
            calls[-1] = ToolCall(last.id, last.name, last.arguments + part.arguments)


class TokenDelta(msgspec.Struct, omit_defaults=True):
    """Published by the worker for each request on each engine step: in a ``RoutedDelta`` on the request's
    ``reply_subject`` (batched with the step's other deltas to that gateway), or alone on ``llm.tok.<request_id>``.
    Fields at their defaults are left out of the encoding (a token's delta sets five of them: half the bytes).

    The first message (``text == ""``, ``num_tokens == 0``) says the worker took the request. The last one has
    ``finish_reason`` (stop, length, cancelled, error) and ``usage``; an ``error`` may come instead of any text.
    With ``n`` > 1 each choice's last has ``finish_reason``; the request's last also has ``is_last``.
    """

    request_id: str
    text: str = ""
    num_tokens: int = 0
    index: int = 0  # choice index, for n > 1
    finish_reason: str | None = None
    usage: Usage | None = None
    error: ErrorInfo | None = None
    dropped_messages: int = 0  # on the first message: turns dropped to fit the context (truncate_history)
    # When the request asked for logprobs: one entry per content token since the last delta (not the EOS token).
    logprobs: list[TokenLogprob] | None = None
    # 0, 1, 2, ... per request, in publish order (the worker's Publisher numbers them): core NATS drops a message
    # rather than block, so the gateway checks for a gap instead of streaming a text with a hole in it.
    seq: int = 0
    # The worker sending it (its liveness is watched; after a failover, a superseded worker's late deltas are told
    # apart by it).
    worker_id: str | None = None
    token_ids: list[int] | None = None  # the ids of this delta's tokens, so a continuation can go on from them
    attempt: int = 0  # the run it comes from: 0, then the ``resume.attempt`` of each continuation
    prompt_tokens: int = 0  # on the first message: the prompt's tokens, for billing a request whose worker died
    tool_calls: list[ToolCallDelta] | None = None  # tool calls found in this delta's tokens (``text`` is content)
    # The request's last delta: every choice has ended (the engine counts them, nobody else need) or it failed.
    is_last: bool = False
    # An embeddings request's vectors, in input order, each little-endian float32 (OpenAI's base64 is exactly
    # these bytes): the next inputs' after those of the deltas before, as many per delta as fit a NATS message.
    embeddings: list[bytes] | None = None
    # On a vLLM prefill worker's HANDOVER delta: its KV connector's ``kv_transfer_params`` (Resume.kv_transfer).
    kv_transfer: dict[str, Any] | None = None


class RoutedDelta(msgspec.Struct, array_like=True):
    """One item of a message on a gateway's token subject (a list of them, one worker step's deltas of that
    gateway's requests): ``delta`` is an encoded ``TokenDelta``, routed by ``request_id`` without being decoded, so
    the gateway decodes it on the request's own turn and counts what waits for a slow reader in bytes."""

    request_id: str
    delta: msgspec.Raw


class UsageRecord(msgspec.Struct):
    """Published by the worker on ``llm.usage`` (durable): exactly one row per request id in Postgres."""

    request_id: str
    model: str
    tier: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    created_at: float
    queue_ms: float
    first_token_ms: float | None
    total_ms: float
    cached_tokens: int = 0
    tenant_id: str | None = None
    api_key_id: str | None = None
    worker_id: str | None = None
    end_user: str | None = None
    metadata: dict[str, str] | None = None
    prefill_worker_id: str | None = None  # disaggregated: the worker that prefilled it (``worker_id`` decoded it)
    kv_loaded_bytes: int = 0  # Usage.kv_loaded_bytes: the KV the request's worker loaded rather than computed


class ConversationTurn(msgspec.Struct):
    """A conversation's new user message and the reply, as stored when the reply ends; held on
    ``llm.held.turn`` (durable) when Postgres could not take it then, and written exactly once when it returns."""

    request_id: str
    conversation_id: str
    user_content: str
    assistant_content: str
    status: str  # completed | incomplete
    user_role: str = "user"  # or "tool": the new message answers one of the reply's earlier tool calls
    tool_call_id: str | None = None  # a tool message's call
    assistant_tool_calls: list[ToolCall] = msgspec.field(default_factory=list)


class StoredResponse(msgspec.Struct):
    """A Responses API response as stored when it ends (or, in the background, as it goes): held on
    ``llm.held.response`` (durable) when Postgres could not take it then, and written once when it returns, with
    what it adds to its conversation."""

    response_id: str
    tenant_id: str
    request_id: str
    status: str  # queued | in_progress | completed | incomplete | failed | cancelled
    body: str  # the response object, as JSON text
    input_items: str  # this request's input items, as JSON text
    background: bool = False
    previous_response_id: str | None = None
    conversation_id: str | None = None
    conversation_messages: list[ChatMessage] = msgspec.field(default_factory=list)  # appended once it ends


class BatchChoice(msgspec.Struct):
    index: int = 0
    text: str = ""
    finish_reason: str | None = None
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)


class BatchResult(msgspec.Struct):
    """Published by the worker on a request's ``result_subject`` (JetStream ``BATCH_RESULTS``).

    ``started`` marks "worker ``worker_id`` took it" (sent once, when the request is admitted), so the batch
    runner can tell a dead worker's request from a slow one. The final message (``started`` false) has every
    choice with its text and finish reason and the usage, or ``error`` when the request failed or was refused.
    """

    request_id: str
    worker_id: str | None = None
    started: bool = False
    choices: list[BatchChoice] = msgspec.field(default_factory=list)
    usage: Usage | None = None
    error: ErrorInfo | None = None


class StreamResume(msgspec.Struct):
    """A gateway asks for a stream whose gateway died (``llm.resume.<request_id>``): the worker holding it answers
    (``ResumeAnswer``), sends every delta of its run it still holds to ``reply_subject``, then the later ones."""

    request_id: str
    tenant_id: str | None  # only the tenant that made the request may resume it
    reply_subject: str
    # The last delta the client has events of (gateway/stream_ids.py): one the worker never sent is refused.
    attempt: int = 0
    seq: int = 0
    # Only a first run may be taken over (a Responses stream, whose events are made again from the run's first
    # delta): a later attempt is answered ``moved`` and left where it is, its gateway relaying it on.
    first_attempt_only: bool = False


# The error code of the last delta a worker sends the gateway that relayed a stream until another took it over (its
# client came back elsewhere while this one lived): that gateway ends its part quietly, neither cancelling the
# request nor storing an end of its own.
STREAM_TAKEN_OVER = "stream_taken_over"
TAKEN_OVER = ErrorInfo("This stream was taken over by another gateway: the client resumed it there.",
                       code=STREAM_TAKEN_OVER, type="invalid_request_error", status=409)


class ResumeAnswer(msgspec.Struct):
    """The holder's answer to a ``StreamResume``. ``status``: ``ok`` (its deltas follow, from ``first_seq``, the
    client's own; it had sent ``next_seq`` of them), ``gone`` (it ended or was cancelled, its window over, or the
    deltas after the client's are no longer kept: nothing to resume), ``ahead`` (the client names a delta never
    sent), or ``moved`` (a later attempt, asked ``first_attempt_only``: not taken over)."""

    status: str
    request: GenerateRequest | None = None  # ok: the request as the worker runs it (its attempt, its resume)
    worker_id: str = ""
    first_seq: int = 0  # the first delta sent again: the client's own
    next_seq: int = 0
    # Choice 0's token ids and text length in this run before ``first_seq`` (what a continuation goes on from).
    token_ids: list[int] = msgspec.field(default_factory=list)
    text_len: int = 0


class WorkerInfo(msgspec.Struct):
    """A worker's heartbeat in the ``workers`` KV bucket: which model it serves and its limits."""

    worker_id: str
    model: str
    max_context: int
    started_at: float
    running: dict[str, int] = msgspec.field(default_factory=dict)  # tier -> requests running now
    # Since start: engine steps, seconds inside them, and seconds between back-to-back steps (the device idles
    # there while the loop publishes and admits; bench/serve.py reports it as a share of step time).
    num_steps: int = 0
    step_s: float = 0.0
    gap_s: float = 0.0
    host: str = ""  # where the process runs, for an operator (and a test) to find it
    pid: int = 0
    metrics_url: str = ""  # its Prometheus endpoint (worker.metrics_port), "" when it serves none
    aliases: list[str] = msgspec.field(default_factory=list)  # more names of ``model`` (domain/registry.py)
    engine: str = ""  # the engine it runs (workers/service/engines.py)
    role: str = "both"  # WorkerConfig.role: a prefill worker takes only its model's prefill queue
    # Stopped pulling (SIGTERM, /drain), finishing what runs: the gateways send it nothing new (no offer, no
    # prefill, no continuation). Beaten at once when the drain starts.
    draining: bool = False

    @property
    def takes_prefills(self) -> bool:
        """Whether a gateway may send it a prompt to prefill apart: a prefill worker, not draining."""
        return self.role == "prefill" and not self.draining

    @property
    def takes_whole_requests(self) -> bool:
        """Whether a gateway may offer it a request or a continuation to run whole: not a prefill worker, not
        draining."""
        return self.role != "prefill" and not self.draining
    test_double: bool = False  # that engine is a test double (``simulated``): its text is made up


_encoder = msgspec.msgpack.Encoder()

StructT = TypeVar("StructT", bound=msgspec.Struct)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, type_: type[StructT]) -> StructT:
    """Decode ``data`` as ``type_``; raises ``msgspec.ValidationError``/``DecodeError`` on bad input."""
    return msgspec.msgpack.decode(data, type=type_)


_routed_decoder = msgspec.msgpack.Decoder(list[RoutedDelta])


def decode_routed(data: bytes) -> list[RoutedDelta]:
    """A message on a gateway's token subject; raises ``msgspec.ValidationError``/``DecodeError`` on bad input."""
    return _routed_decoder.decode(data)
