"""What a request costs the worker to prepare (its chat template rendered, its text tokenized, its grammar
compiled), told from its size before any of it runs.

A cheap request's preparation is bounded by its size to about a millisecond: no grammar to compile, no tools in
its template, at most ``CHEAP_MESSAGES`` messages and ``CHEAP_CHARS`` characters. What a hostile tenant sends to be
slow (a huge schema, thousands of messages: tests/support/slow_prompts.py) is none of these. The intake takes a
tenant's cheap requests several at a time (capacity.py, tenant_queues.py) and its others one at a time.
"""

from __future__ import annotations

import msgspec

from switchyard.shared.messages import GenerateRequest, decode

CHEAP_MESSAGES = 16
CHEAP_CHARS = 16_000


def is_cheap_to_prepare(request: GenerateRequest) -> bool:
    if request.response_format is not None or request.tool_use is not None or request.embed is not None:
        return False
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids) <= CHEAP_CHARS // 4
    messages = request.messages or ()
    return len(messages) <= CHEAP_MESSAGES and (
        len(request.prompt or "") + sum(len(m.content) for m in messages) <= CHEAP_CHARS)


def is_cheap_message(data: bytes) -> bool:
    """``is_cheap_to_prepare`` of a queued request's message (one that does not decode is not)."""
    try:
        return is_cheap_to_prepare(decode(data, GenerateRequest))
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
