"""A request as the scheduler sees it: its tokens, how many of them have KV in the cache, and its status.

The scheduler has no prefill or decode phase. Every sequence only moves ``num_computed_tokens`` toward
``num_tokens``; a prompt is "prefilled" when that gap closes, and each sampled token reopens it by one::

    token_ids   p0 p1 p2 p3 p4 p5 o0 o1 o2
    prompt      └───────────────┘
    outputs                       └──────┘
    computed    └─────────────────────┘    o2 was just sampled: the next step writes its KV
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.IntEnum):
    """Lifecycle of a sequence; ordered so that every finished state compares greater than ``PREEMPTED``."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PAUSED = enum.auto()  # gave its seat to a waiting tenant (scheduler/pausing.py): KV and tokens kept, waiting
    PREEMPTED = enum.auto()
    # Finished states: keep them after PREEMPTED, is_finished() relies on the order.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_FILTERED = enum.auto()  # halted by the output safety filter

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """True for every ``FINISHED_*`` state."""
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        """The OpenAI ``finish_reason`` for a finished status; None while the sequence is still live."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "cancelled",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_FILTERED: "content_filter",
}


def finish_reason(status: RequestStatus) -> str | None:
    """Module-level alias of ``RequestStatus.finish_reason``."""
    return _FINISH_REASONS.get(status)


@dataclass(slots=True, eq=False)  # eq=False: identity equality and hashable, two requests are never "equal"
class Sequence:
    """One request's token state.

    ``prompt_token_ids`` is copied once into ``token_ids`` (prompt followed by outputs), so appending a
    token is O(1) and the model runner can slice one list without concatenating prompt and outputs.
    ``data`` is an opaque slot for the engine's own per-request state (sampling params, detokenizer, ...);
    the scheduler never reads it.
    """

    seq_id: str
    prompt_token_ids: list[int]
    max_tokens: int  # max new tokens
    priority: int = 0  # lower = more important
    arrival: float = 0.0
    data: object = None
    cache_salt: str = ""  # prefix-cache scope: blocks are shared only between sequences of one salt
    # Who it serves: with every seat taken, a tenant holding two seats more than this one at its priority gives
    # one up (Scheduler._yield_to), so one tenant's flood cannot keep the others' requests out of the batch.
    tenant: str = ""
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (hits included)
    num_cached_tokens: int = 0  # prefix-cache hit on first admission, for usage reporting
    num_preemptions: int = 0
    num_pauses: int = 0  # times it gave its seat up to a waiting tenant, its KV kept (scheduler/pausing.py)
    num_output_at_start: int = 0  # output tokens when it last started running: its turn's progress is counted from it
    last_scheduled_step: int = -1  # the scheduler's step count when it last ran: background seats take turns
    # Tokens guessed to follow (speculative decoding, proposed by the engine): the next step computes them with the
    # last token, and keeps those its model agrees with (update_from_output). Consumed by that step.
    draft_token_ids: list[int] = field(default_factory=list, repr=False)
    token_ids: list[int] = field(init=False, repr=False)
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            # With no token there are no logits to sample the first output from.
            raise ValueError(f"sequence {self.seq_id!r} has an empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"sequence {self.seq_id!r}: max_tokens must be >= 1, got {self.max_tokens}")
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the generated tokens (O(outputs): prefer ``last_token_id`` in per-step code)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def all_token_ids(self) -> list[int]:
        """The live prompt + output list, not a copy: read it, never mutate it."""
        return self.token_ids

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still without KV: the rest of the prompt, or 1 for a decoding sequence."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_tokens_since_start(self) -> int:
        """Tokens generated since it last started running (admitted, or resumed after a pause)."""
        return self.num_output_tokens - self.num_output_at_start

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def sort_key(self) -> tuple[int, float, str]:
        """Scheduling order: priority first, then arrival; the id breaks ties deterministically."""
        return (self.priority, self.arrival, self.seq_id)

    def resume(self, output_token_ids: list[int]) -> None:
        """Continue from outputs another worker generated (a failover): they count as outputs (``max_tokens``,
        penalties, usage) and are computed on admission like a preempted sequence's."""
        if self.num_computed_tokens or self.num_output_tokens:
            raise ValueError(f"sequence {self.seq_id!r} has started; only a new sequence can resume")
        if len(output_token_ids) >= self.max_tokens:
            raise ValueError(f"sequence {self.seq_id!r}: {len(output_token_ids)} resumed tokens leave none of "
                             f"max_tokens={self.max_tokens}")
        self.token_ids.extend(output_token_ids)

    def append_token(self, token_id: int) -> None:
        """Add a sampled token; its KV is written when the next step computes it."""
        self.token_ids.append(token_id)

    def drop_tokens_after(self, num_tokens: int) -> None:
        """Forget the tokens past the first ``num_tokens``: a step that kept several (speculative decoding) ended
        the sequence at an earlier one (EOS, a stop string). For a sequence about to finish: its KV is not kept."""
        if num_tokens < self.num_prompt_tokens:
            raise ValueError(f"sequence {self.seq_id!r}: cannot drop prompt tokens")
        del self.token_ids[num_tokens:]
        self.num_computed_tokens = min(self.num_computed_tokens, num_tokens)
