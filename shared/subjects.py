"""Every NATS subject, stream and bucket name, defined once.

| name                       | kind                         | carries                                   |
|----------------------------|------------------------------|-------------------------------------------|
| llm.req.<model>.<tier>.<tenant> | JetStream REQUESTS_<TIER> | GenerateRequest (work queue, capped per tier, tenant) |
| llm.req.<model>~prefill.<tier>.<tenant> | the same streams | GenerateRequest with ``handover``: the prefill pool's |
| llm.aff.<worker>.<tier>    | JetStream AFFINITY, 5 min    | GenerateRequest for the worker holding its prefix |
| llm.tok.gw.<gateway_id>    | core NATS                    | RoutedDelta list: a step's deltas of one gateway |
| llm.tok.<request_id>       | core NATS                    | TokenDelta, for a request that names no reply subject |
| llm.cancel.<request_id>    | core NATS                    | empty body: stop this request             |
| llm.gw.alive.<gateway_id>  | core NATS                    | empty: a gateway reads its token subject (each second) |
| llm.resume.<request_id>    | core NATS request            | StreamResume → ResumeAnswer, from the worker holding it |
| llm.usage                  | JetStream USAGE, limits      | UsageRecord (one per finished request)    |
| llm.events.rejected.<m>.<t>| JetStream EVENTS, 5 min      | empty: one 429 queue_full, for ops counts |
| llm.result.<batch_id>      | JetStream BATCH_RESULTS, 7 d | BatchResult (a batch line's outcome)      |
| KV bucket `workers`        | JetStream KV, TTL            | WorkerInfo, key <model>.<worker_id>       |
| KV bucket `tiers`          | JetStream KV, file           | TierPolicy, key <tier>                    |
| KV bucket `affinity`       | JetStream KV, memory, TTL    | worker id, key <hash of a conversation prefix> |
"""

from __future__ import annotations

import re

REQUEST_PREFIX = "llm.req"
AFFINITY_PREFIX = "llm.aff"  # llm.aff.<worker_id>.<tier>: a request offered to the worker that holds its prefix
AFFINITY_STREAM = "AFFINITY"
AFFINITY_BUCKET = "affinity"
EVENTS_STREAM = "EVENTS"
EVENTS_PREFIX = "llm.events"
TOKEN_PREFIX = "llm.tok"
CANCEL_PREFIX = "llm.cancel"
USAGE_STREAM = "USAGE"
USAGE_SUBJECT = "llm.usage"
USAGE_CONSUMER = "usage-writer"
WORKERS_BUCKET = "workers"
RESULT_PREFIX = "llm.result"
BATCH_RESULTS_STREAM = "BATCH_RESULTS"
BATCH_RESULTS_CONSUMER = "batch-runner"
ALIVE_PREFIX = "llm.alive"  # llm.alive.<worker_id>: a worker's liveness ping, its seats free (core NATS)
ALIVE_INTERVAL_S = 1.0
GATEWAY_ALIVE_PREFIX = "llm.gw.alive"  # llm.gw.alive.<gateway_id>: a gateway's liveness ping (core NATS)
RESUME_PREFIX = "llm.resume"  # llm.resume.<request_id>: a gateway asks for a stream whose gateway died
HELD_WRITES_STREAM = "HELD_WRITES"
HELD_PREFIX = "llm.held"
HELD_TURN_SUBJECT = "llm.held.turn"  # a conversation turn Postgres could not take when it ended (jobs/held_writes.py)
HELD_RESPONSE_SUBJECT = "llm.held.response"  # a Responses API response Postgres could not take (the same writer)
HELD_WRITES_CONSUMER = "held-writer"
DEAD_LETTER_STREAM = "DEAD_LETTERS"
DEAD_LETTER_PREFIX = "llm.dead"  # llm.dead.<consumer>: records a durable writer could never write, kept for a human

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
# A model's prefill queue is named as the model with this suffix (``prefill_queue``): queues, consumers and
# doorbells of its own, through every function here. "~" never survives ``model_token`` in a model's own name.
PREFILL_SUFFIX = "~prefill"


def model_token(model: str) -> str:
    """Map a served model name (or a model's prefill queue) to one NATS subject token ('.', '*', '>' and spaces
    are not allowed)."""
    if model.endswith(PREFILL_SUFFIX):
        return _UNSAFE.sub("_", model.removesuffix(PREFILL_SUFFIX)) + PREFILL_SUFFIX
    return _UNSAFE.sub("_", model)


def prefill_queue(model: str) -> str:
    """What a prefill worker of ``model`` serves instead of it: the requests to hand over after their first token."""
    return model + PREFILL_SUFFIX


def request_subject(model: str, tier: str, tenant: str | None) -> str:
    """A tenant's queue of ``model`` in ``tier``: its own subject, so JetStream caps it on its own and a worker
    picks which tenant to serve next (fair share, scheduler/tenant_share.py)."""
    return f"{REQUEST_PREFIX}.{model_token(model)}.{tier}.{tenant_token(tenant)}"


def tenant_token(tenant: str | None) -> str:
    """A tenant id as one subject token ("_" for a request without a tenant)."""
    return model_token(tenant) if tenant else "_"


def affinity_subject(worker_id: str, tier: str) -> str:
    return f"{AFFINITY_PREFIX}.{worker_id}.{tier}"


def affinity_consumer(worker_id: str, tier: str) -> str:
    return f"aff-{worker_id}-{tier}"


def model_tier_subjects(model: str, tier: str) -> str:
    """Every tenant's queue of ``model`` in ``tier``."""
    return f"{REQUEST_PREFIX}.{model_token(model)}.{tier}.*"


def request_stream(tier: str) -> str:
    """One stream per tier, so each tier has its own JetStream-enforced queue cap."""
    return f"REQUESTS_{tier.upper()}"


def tier_subjects(tier: str) -> str:
    return f"{REQUEST_PREFIX}.*.{tier}.*"


def rejected_subject(model: str, tier: str) -> str:
    return f"{EVENTS_PREFIX}.rejected.{model_token(model)}.{tier}"


def request_consumer(model: str, tier: str, tenant: str | None) -> str:
    """Durable pull consumer of one tenant's queue, shared by every worker of ``model``."""
    return f"req-{model_token(model)}-{tier}-{tenant_token(tenant)}"


def token_subject(request_id: str) -> str:
    """Where a request that names no ``reply_subject`` gets its deltas, one ``TokenDelta`` per message."""
    return f"{TOKEN_PREFIX}.{request_id}"


def gateway_token_subject(gateway_id: str) -> str:
    """One gateway process's token subject: the deltas of every request it relays, a worker's step of them per
    message (``RoutedDelta`` lists; gateway/token_router.py)."""
    return f"{TOKEN_PREFIX}.gw.{gateway_id}"


def gateway_of(token_subject: str) -> str | None:
    """The gateway id of a gateway's token subject (None: not one, e.g. a wire client's own subject)."""
    prefix = f"{TOKEN_PREFIX}.gw."
    return token_subject[len(prefix):] if token_subject.startswith(prefix) else None


def gateway_alive_subject(gateway_id: str) -> str:
    return f"{GATEWAY_ALIVE_PREFIX}.{gateway_id}"


def resume_subject(request_id: str) -> str:
    return f"{RESUME_PREFIX}.{request_id}"


def cancel_subject(request_id: str) -> str:
    return f"{CANCEL_PREFIX}.{request_id}"


def worker_key(model: str, worker_id: str) -> str:
    return f"{model_token(model)}.{worker_id}"


def alive_subject(worker_id: str) -> str:
    return f"{ALIVE_PREFIX}.{worker_id}"


def held_writes_consumer(subject: str) -> str:
    """The durable consumer of one kind of held write: turns keep the name they always had."""
    if subject == HELD_TURN_SUBJECT:
        return HELD_WRITES_CONSUMER
    return f"{HELD_WRITES_CONSUMER}-{subject.rsplit('.', 1)[-1]}"


def dead_letter_subject(consumer: str) -> str:
    return f"{DEAD_LETTER_PREFIX}.{model_token(consumer)}"


def result_subject(batch_id: str) -> str:
    """Where workers publish the outcomes of one batch's lines."""
    return f"{RESULT_PREFIX}.{batch_id}"
