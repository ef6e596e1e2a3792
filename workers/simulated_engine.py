"""A test double of an engine, for load tests of everything but the model: ``--engine simulated``.

It implements ``ServingEngine`` (workers/serving/interface.py) exactly as the worker service uses it, so a worker
over it pulls, admits by tier and tenant, heartbeats, publishes deltas with sequence numbers and usage, cancels,
drains and fails over like a real one; only the tokens are made up. Nothing here runs a model:

* time: a sequence's first token is due ``prefill_us_per_token`` x its prompt tokens after it is added, the next
  ones at ``tokens_per_s`` each, sent ``tokens_per_delta`` at a time (when the last of them is due). ``step()``
  emits what is due (several tokens of a sequence that fell behind go in one delta, as a real step never sends
  more than one per choice) and otherwise waits for the next due token, at most ``_IDLE_WAIT_S``, so requests
  added meanwhile start promptly. Due times sit in a heap: a step costs what it emits, not what runs, so
  thousands of seats are cheap.
* steps: with ``step_s`` 0 a token goes out as soon as it is due, so at a thousand sequences the engine steps
  hundreds of times a second, a few tokens each. A real engine with that batch steps every few tens of
  milliseconds and sends a token of every sequence in each step: with ``step_s`` set, a sequence's later tokens
  go out at the first multiple of ``step_s`` after they are due (its first token still as soon as it is due:
  the prefill's time is ``prefill_us_per_token``'s), so a step carries what a real one would.
* text: words of a fixed list, chosen by the prompt and the choice's index, so the same request gives the same
  text on any worker (a continuation after a failover goes on with the very words the first worker would have
  sent) and a different prompt gives a different text. Prompt tokens are counted as about four bytes each.
* seats: a request added with every seat taken runs anyway (the worker pulls beyond the seats only what the seat
  rule lets take one: where the real engine preempts, this one runs a seat over), unless the seat rule would give it
  none and its tier pauses (``set_pause_rules``): then, by the rule the real engine's scheduler follows
  (scheduler/pausing.py), it pauses a running choice of its tier past the quantum whose tenant holds more seats; the
  paused choice sends nothing until a seat frees, then resumes where it was, first of those paused.
* limits: ``max_tokens`` (or ``output_tokens`` when unset, ending with ``stop``), stop strings, ``n`` choices and
  resumed requests behave as on the real engine; what it cannot imitate honestly (logprobs, tools, response
  formats, echo) is refused with a 400 naming the parameter; sampling parameters do not change its text.

Every place that shows which engine runs says it is this one: the worker's start log, its heartbeat
(``WorkerInfo.engine``) and ``/v1/models`` (``engine: simulated``, ``test_double: true``).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import NoReturn

from switchyard.scheduler.pausing import PauseRule, pause_victim
from switchyard.scheduler.seats import TenantSeats
from switchyard.shared.messages import ErrorInfo, GenerateRequest, TokenDelta, Usage
from switchyard.workers.serving.interface import (
    EngineCapabilities,
    EngineCapacity,
    EngineStats,
    RequestRejected,
    SafetyEvent,
)
from switchyard.workers.serving.prompts import MAX_N, resolve_max_tokens

MAX_CONTEXT = 32768
_IDLE_WAIT_S = 0.002  # the longest a step waits for a due token: how late an added request may start
WORDS = ("alpha bravo river stone cloud amber maple orbit lumen cedar harbor meadow quartz signal willow ember "
         "falcon prairie copper violet summit lantern thistle marble breeze canyon hollow juniper saffron tundra "
         "beacon glacier").split()


@dataclass(frozen=True, slots=True)
class SimulatedPrompt:
    """What ``prepare`` makes of a request: its counted prompt and the seed of its text."""

    num_prompt_tokens: int
    max_tokens: int
    seed: int
    num_dropped_messages: int = 0


@dataclass(slots=True)
class _Choice:
    request: _Request
    index: int
    position: int  # tokens generated (resumed ones included)
    due: float  # when the next token is due (time.monotonic)
    num_deltas: int = 0  # sent so far: the first goes alone, as soon as its token is due
    owed: str = ""  # text of resumed tokens the client does not have yet, sent first
    text: str = ""  # generated so far, kept only to find stop strings
    finished: bool = False
    paused: bool = False  # gave its seat to a waiting tenant (scheduler/pausing.py): sends nothing until resumed
    started_at: int = 0  # ``position`` when it last started (added, or resumed): its turn's progress counts from it
    num_pauses: int = 0
    epoch: int = 0  # bumped by a pause: its heap entries from before are stale


@dataclass(slots=True)
class _Request:
    request: GenerateRequest
    prepared: SimulatedPrompt
    choices: list[_Choice] = field(default_factory=list)
    num_finished: int = 0
    completion_tokens: int = 0
    order: int = 0  # when it was added, as a count: paused choices resume oldest request first


class SimulatedEngine:
    """See the module docstring."""

    device_type = "simulated"  # a step's cost does not grow with its batch (workers/service/capacity.py)

    def __init__(self, max_num_seqs: int, tokens_per_s: float, prefill_us_per_token: float = 0.0,
                 output_tokens: int = 128, tokens_per_delta: int = 1, step_s: float = 0.0) -> None:
        self.max_num_seqs = max_num_seqs
        self.tokens_per_s = tokens_per_s
        self.prefill_s_per_token = prefill_us_per_token / 1e6
        self.output_tokens = output_tokens
        self.tokens_per_delta = tokens_per_delta
        self.step_s = step_s
        self._requests: dict[str, _Request] = {}
        self._due: list[tuple[float, int, _Choice, int]] = []  # (due, tie-breaker, choice, its epoch)
        self._tie = 0
        self._pending: list[TokenDelta] = []  # finals of aborted requests, sent with the next step
        self._running: Counter[str] = Counter()  # tier -> sequences
        self._num_seqs = 0  # running choices (not the paused)
        self._last_batch = (0, 0)
        self._pause_rules: dict[str, PauseRule] = {}  # tier -> its pausing; absent: off
        self._paused: list[_Choice] = []
        self._num_added = 0
        self.num_pauses = 0

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(background_limit=False, pausing=True)

    def set_pause_rules(self, after_tokens: dict[str, int]) -> None:
        self._pause_rules = {tier: rule for tier, n in after_tokens.items() if (rule := PauseRule(n)).is_on}

    @property
    def max_context(self) -> int:
        return MAX_CONTEXT

    # -- the intake's side -------------------------------------------------------------------------------------
    def prepare(self, request: GenerateRequest) -> SimulatedPrompt:
        """Count the prompt and check what the real engine checks; refuse what this double cannot imitate."""
        params = request.sampling
        for name, asked in (("logprobs", params.logprobs), ("tools", request.tool_use is not None),
                            ("response_format", request.response_format is not None
                             and request.response_format.type != "text"), ("echo", params.echo)):
            if asked:
                raise RequestRejected(ErrorInfo(f"The simulated engine (a test double) does not support {name}.",
                                                code="unsupported_parameter", param=name))
        if not 1 <= params.n <= MAX_N:
            raise RequestRejected(ErrorInfo(f"n must be between 1 and {MAX_N}, got {params.n}.",
                                            code="invalid_value", param="n"))
        if request.resume is not None and params.n != 1:
            raise RequestRejected(ErrorInfo("A request with n set cannot be resumed.", code="invalid_value",
                                            param="n"))
        text, param = _prompt_text(request)
        num_prompt = (len(request.prompt_token_ids) if request.prompt_token_ids is not None
                      else len(text.encode()) // 4 + 1)
        max_tokens = resolve_max_tokens(request, num_prompt, MAX_CONTEXT, param)
        if params.max_tokens is None:
            max_tokens = min(max_tokens, self.output_tokens)
        seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")
        return SimulatedPrompt(num_prompt, max_tokens, seed)

    # -- the step thread's side --------------------------------------------------------------------------------
    def add_request(self, request: GenerateRequest, prepared: SimulatedPrompt) -> int:
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already running")
        self._num_added += 1
        state = _Request(request, prepared, order=self._num_added)
        # Resumed tokens are the continuation's outputs (and bill with them), as on the real engine.
        state.completion_tokens = len(request.resume.token_ids) if request.resume is not None else 0
        start = time.monotonic() + prepared.num_prompt_tokens * self.prefill_s_per_token
        resume = request.resume
        resumed = list(resume.token_ids) if resume is not None else []
        text_len = resume.text_len if resume is not None else 0
        for index in range(request.sampling.n):
            choice = _Choice(state, index, len(resumed), start, started_at=len(resumed))
            if resumed:  # the client has text_len characters of what these tokens spell
                sent = "".join(self._word(state, index, p) for p in range(len(resumed)))
                choice.owed = sent[text_len:]
                choice.text = sent
            state.choices.append(choice)
            if self._num_seqs >= self.max_num_seqs:
                self._pause_for(request)
            self._push(choice)
            self._running[request.tier] += 1
            self._num_seqs += 1
        self._requests[request.request_id] = state
        return prepared.num_prompt_tokens

    def _pause_for(self, request: GenerateRequest) -> None:
        """Every seat taken: pause a running choice of ``request``'s tier for it, if the tier's rule lets one."""
        rule = self._pause_rules.get(request.tier)
        if rule is None:
            return
        running = [c for state in self._requests.values() if state.request.tier == request.tier
                   for c in state.choices if not c.finished and not c.paused]
        seats = TenantSeats(_tenant(c) for c in running)
        if seats.may_take(request.tenant_id or ""):
            return  # the seat rule gives it a seat (here: one beyond them, as without pausing), as it comes first
        victim = pause_victim(running, seats, request.tenant_id or "", rule, _tenant,
                              lambda c: (c.position - c.started_at, c.num_pauses))
        if victim is None:
            return
        victim.paused = True
        victim.num_pauses += 1
        victim.epoch += 1
        self.num_pauses += 1
        self._running[request.tier] -= 1
        self._num_seqs -= 1
        self._paused.append(victim)

    def _resume_paused(self) -> None:
        """Seats free: the paused choices of the oldest requests go on where they were, at once."""
        now = time.monotonic()
        while self._paused and self._num_seqs < self.max_num_seqs:
            choice = min(self._paused, key=lambda c: (c.request.order, c.index))
            self._paused.remove(choice)
            choice.paused = False
            choice.started_at = choice.position
            choice.due = max(choice.due, now)
            self._running[choice.request.request.tier] += 1
            self._num_seqs += 1
            self._push(choice)

    def abort_request(self, request_id: str, error: ErrorInfo | None = None) -> bool:
        state = self._requests.get(request_id)
        if state is None:
            return False
        reason = "cancelled" if error is None else "error"
        for choice in state.choices:
            if not choice.finished:
                self._pending.append(self._finish(choice, reason, "", error))
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    def step(self, background_limit: int | None = None) -> list[TokenDelta]:
        """Every token due by now, at most one delta per choice; waits (briefly) when none is due yet."""
        out, self._pending = self._pending, []
        now = time.monotonic()
        if not out and self._due and self._due[0][0] > now:
            time.sleep(min(self._due[0][0] - now, _IDLE_WAIT_S))
            now = time.monotonic()
        num_seqs = num_tokens = 0
        while self._due and self._due[0][0] <= now:
            _, _, choice, epoch = heapq.heappop(self._due)
            if choice.finished or choice.paused or epoch != choice.epoch:
                continue  # aborted or paused after it was pushed
            count = min(int((now - choice.due) * self.tokens_per_s + 1e-9) + 1,
                        choice.request.prepared.max_tokens - choice.position)
            out.append(self._advance(choice, count))
            num_seqs, num_tokens = num_seqs + 1, num_tokens + count
        if num_seqs:
            self._last_batch = (num_seqs, num_tokens)
        if self._paused:
            self._resume_paused()
        return out

    def _advance(self, choice: _Choice, count: int) -> TokenDelta:
        state = choice.request
        ids = list(range(choice.position, choice.position + count))
        words = "".join(self._word(state, choice.index, p) for p in ids)
        choice.position += count
        state.completion_tokens += count
        text, choice.owed = choice.owed + words, ""
        stops = state.request.sampling.stop
        if stops:
            before = len(choice.text)
            choice.text += words
            found = [i for s in stops if (i := choice.text.find(s, max(0, before - len(s) + 1))) >= 0]
            if found:  # the text up to the stop string (what was sent before it cannot be taken back)
                return self._finish(choice, "stop", text[:max(0, len(text) - (len(choice.text) - min(found)))],
                                    positions=ids)
        if choice.position >= state.prepared.max_tokens:
            reason = "length" if state.request.sampling.max_tokens is not None else "stop"
            return self._finish(choice, reason, text, positions=ids)
        choice.due += count / self.tokens_per_s
        choice.num_deltas += 1
        self._push(choice)
        return TokenDelta(state.request.request_id, text=text, num_tokens=count, index=choice.index,
                          token_ids=[self._token_id(state, choice.index, p) for p in ids])

    def _finish(self, choice: _Choice, reason: str, text: str, error: ErrorInfo | None = None,
                positions: list[int] | None = None) -> TokenDelta:
        state = choice.request
        choice.finished = True
        state.num_finished += 1
        if choice.paused:
            self._paused.remove(choice)
        else:
            self._running[state.request.tier] -= 1
            self._num_seqs -= 1
        is_last = state.num_finished == len(state.choices)
        if is_last:
            del self._requests[state.request.request_id]
        usage = Usage(prompt_tokens=state.prepared.num_prompt_tokens, completion_tokens=state.completion_tokens)
        ids = [self._token_id(state, choice.index, p) for p in positions] if positions else None
        return TokenDelta(state.request.request_id, text=text, num_tokens=len(positions or ()), index=choice.index,
                          finish_reason=reason, usage=usage, error=error, token_ids=ids, is_last=is_last)

    def _push(self, choice: _Choice) -> None:
        """Into the heap, keyed by when its next delta goes: when the last token of that delta is due."""
        self._tie += 1
        group = 1 if choice.num_deltas == 0 else min(self.tokens_per_delta,
                                                     choice.request.prepared.max_tokens - choice.position)
        goes_at = choice.due + (group - 1) / self.tokens_per_s
        if self.step_s and choice.num_deltas:  # on the step grid (see the module docstring)
            goes_at = math.ceil(goes_at / self.step_s) * self.step_s
        heapq.heappush(self._due, (goes_at, self._tie, choice, choice.epoch))

    @staticmethod
    def _token_id(state: _Request, index: int, position: int) -> int:
        return (state.prepared.seed + 7 * index + 13 * position) % len(WORDS)

    def _word(self, state: _Request, index: int, position: int) -> str:
        return " " + WORDS[self._token_id(state, index, position)]

    # -- what the worker reads ---------------------------------------------------------------------------------
    def capacity(self) -> EngineCapacity:
        held = self._num_seqs + len(self._paused)  # a paused choice holds its place (and, on a real engine, its KV)
        return EngineCapacity(self.max_num_seqs, max(0, self.max_num_seqs - held), self._num_seqs, len(self._paused),
                              0, min(1.0, held / self.max_num_seqs))

    def stats(self) -> EngineStats:
        waiting: Counter[str] = Counter(c.request.request.tier for c in self._paused)
        return EngineStats(running={tier: n for tier, n in self._running.items() if n}, waiting=dict(waiting),
                           kv_cache_usage=min(1.0, (self._num_seqs + len(self._paused)) / self.max_num_seqs),
                           prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                           batch_size=self._last_batch[0], num_batched_tokens=self._last_batch[1],
                           num_pauses=self.num_pauses)

    def take_safety_events(self) -> list[SafetyEvent]:
        return []  # no output filter: its text is made up

    @property
    def kv_block_size(self) -> int:
        return 16  # no KV cache: its (empty) KV events need some size

    def take_kv_changes(self) -> None:
        """No KV events from this engine."""
        return None

    def kv_listing(self) -> dict[str, list[int]]:
        return {}

    def connect_kv_peers(self, peers) -> NoReturn:
        """Never called: no KV tiers to fetch into or serve from (``capabilities``)."""
        raise NotImplementedError("the simulated engine exchanges no KV blocks")

    def shutdown(self) -> None:
        pass


def _tenant(choice: _Choice) -> str:
    return choice.request.request.tenant_id or ""


def _prompt_text(request: GenerateRequest) -> tuple[str, str]:
    if request.messages is not None:
        return "\n".join(f"{m.role}: {m.content or ''}" for m in request.messages), "messages"
    if request.prompt_token_ids is not None:
        return " ".join(map(str, request.prompt_token_ids)), "prompt"
    if request.prompt is not None:
        return request.prompt, "prompt"
    raise RequestRejected(ErrorInfo("Either prompt or messages is required.", code="invalid_request", param="prompt"))


