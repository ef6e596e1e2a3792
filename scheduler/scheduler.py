"""Continuous batching by token budget: each step, decide which sequences advance by how many tokens.

There are no prefill and decode phases. A step has ``max_num_batched_tokens`` to share; running sequences
take theirs first (a decode is 1 token, a partly prefilled prompt continues with a chunk), then waiting
sequences are admitted with whatever is left. Prefix-cache hits simply start a sequence with
``num_computed_tokens > 0``::

    schedule()            -> SchedulerOutput  (who runs, from which position, with which blocks)
    <engine runs the model, samples for entries with needs_sample>
    update_from_output()  -> sequences that got a token (the engine checks EOS / stop strings)
"""

from __future__ import annotations

import sys
from bisect import insort

from switchyard.scheduler.block_pool import Block
from switchyard.scheduler.config import SchedulerConfig
from switchyard.scheduler.kv_cache_manager import KVCacheManager
from switchyard.scheduler.output import ScheduledSeq, SchedulerOutput
from switchyard.scheduler.pausing import PauseRule, pause_victim
from switchyard.scheduler.request import RequestStatus, Sequence
from switchyard.scheduler.request_queue import WaitingQueue
from switchyard.scheduler.seats import TenantSeats, outranks


def _sort_key(seq: Sequence) -> tuple[int, float, str]:
    return seq.sort_key


def _tenant_of(seq: Sequence) -> str:
    return seq.tenant


def _progress_of(seq: Sequence) -> tuple[int, int]:
    return seq.num_tokens_since_start, seq.num_pauses


class Scheduler:
    """Owns the waiting queue, the running list and the KV cache manager."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv_cache = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                       config.record_cached_blocks, config.record_kv_events)
        self._requests: dict[str, Sequence] = {}  # every unfinished sequence, by id
        self._waiting = WaitingQueue()
        self._running: list[Sequence] = []  # kept sorted by sort_key: the tail is the first to preempt
        self._finished_by_length: dict[str, Sequence] = {}  # from the last update, see finish_request
        self._chunk_cap = config.long_prefill_token_threshold or sys.maxsize
        self._num_steps = 0
        self._background_max_seqs: int | None = None
        # After the device ran out of memory: at most this many running until a sequence finishes (shed_one).
        self._memory_seats: int | None = None
        self._pause_rules: dict[int, PauseRule] = {}  # priority -> its pausing (scheduler/pausing.py); absent: off
        # Since start, for the worker's metrics (vLLM's meanings): prompt tokens looked up in the prefix cache at a
        # sequence's first admission, how many of them were found there, and preemptions.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0
        self.num_pauses = 0

    # --- requests -------------------------------------------------------------------------------------

    def add_request(self, seq: Sequence) -> None:
        """Queue a new sequence. Raises ValueError for a duplicate id or a prompt with no room for output."""
        if seq.seq_id in self._requests:
            raise ValueError(f"sequence {seq.seq_id!r} is already scheduled")
        if seq.status != RequestStatus.WAITING or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id!r} is not new (status {seq.status.name})")
        if seq.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"sequence {seq.seq_id!r} has {seq.num_prompt_tokens} prompt tokens, "
                f"max_model_len={self.config.max_model_len} leaves no room for output"
            )
        self._requests[seq.seq_id] = seq
        self._waiting.push(seq)

    def abort_request(self, seq_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Sequence | None:
        """Stop a live sequence now (client gone, or it failed) with ``status``: frees its blocks. Returns it, or None
        if it was not live (a sequence already finished keeps its outcome)."""
        seq = self._requests.get(seq_id)
        if seq is not None:
            self._finish(seq, status)
        return seq

    def finish_request(self, seq_id: str, status: RequestStatus) -> Sequence | None:
        """Finish a sequence the engine decided is done (EOS, stop string, error) and free its blocks.

        A sequence that ``update_from_output`` just finished by length can still be relabelled here, so a
        stop token that happens to be the last allowed one reports "stop". Returns None for unknown ids.
        """
        if not RequestStatus.is_finished(status):
            raise ValueError(f"{status.name} is not a finished status")
        seq = self._requests.get(seq_id)
        if seq is not None:
            self._finish(seq, status)
        elif (seq := self._finished_by_length.get(seq_id)) is not None:
            seq.status = status
        return seq

    def get(self, seq_id: str) -> Sequence | None:
        return self._requests.get(seq_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def prefill_backlog_tokens(self) -> int:
        """Tokens queued to compute before the sequences here produce their next token: waiting ones' and
        prefilling ones' uncomputed prompts (what a new request's first token waits behind, as routing sees it)."""
        return sum(seq.num_uncomputed_tokens - 1 for seqs in (self._running, self._waiting) for seq in seqs
                   if seq.num_uncomputed_tokens > 1)

    @property
    def num_waiting_new(self) -> int:
        """Waiting sequences never admitted yet (the others were preempted and are already counted as pulled)."""
        return sum(1 for seq in self._waiting if seq.status == RequestStatus.WAITING)

    def counts_by_priority(self) -> tuple[dict[int, int], dict[int, int]]:
        """Running and waiting sequences per priority."""
        running: dict[int, int] = {}
        waiting: dict[int, int] = {}
        for seq in self._running:
            running[seq.priority] = running.get(seq.priority, 0) + 1
        for seq in self._waiting:
            waiting[seq.priority] = waiting.get(seq.priority, 0) + 1
        return running, waiting

    # --- background work (batch jobs) -----------------------------------------------------------------

    def is_background(self, seq: Sequence) -> bool:
        bg = self.config.background_priority
        return bg is not None and seq.priority >= bg

    def set_background_limit(self, max_seqs: int | None) -> None:
        """Let at most ``max_seqs`` background sequences run in one step (``None``: no limit). The others keep
        their seats and blocks and take turns, oldest-served first.

        Where a step's cost grows with its batch (CPUs), a step full of batch-job decodes delays the first token
        of an interactive request that arrives meanwhile; the worker sets a small limit while interactive traffic
        is about, and lifts it when there is none."""
        if max_seqs is not None and max_seqs < 1:
            raise ValueError(f"background max_seqs must be >= 1 or None, got {max_seqs}")
        if max_seqs is not None and self.config.background_priority is None:
            raise ValueError("a background limit needs SchedulerConfig.background_priority")
        self._background_max_seqs = max_seqs

    def set_pause_rules(self, rules: dict[int, PauseRule]) -> None:
        """Pausing per priority (scheduler/pausing.py): with every seat taken, a new request of a priority whose
        rule is on may pause a long-running one of that priority held by a tenant with more seats. Applies from the
        next step; requests paused meanwhile still resume into the next free seats."""
        self._pause_rules = {p: r for p, r in rules.items() if r.is_on}

    def _background_turns(self) -> tuple[set[str], int]:
        """(ids of the running background sequences that run this step, seats left for admitting more)."""
        if self._background_max_seqs is None:
            return set(), sys.maxsize
        background = [s for s in self._running if self.is_background(s)]
        background.sort(key=lambda s: s.last_scheduled_step)
        chosen = {s.seq_id for s in background[:self._background_max_seqs]}
        return chosen, self._background_max_seqs - len(chosen)

    # --- admission control (for the worker) -----------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        """How many more sequences may be added now without exceeding ``max_num_seqs``."""
        return max(0, self.config.max_num_seqs - len(self._running) - len(self._waiting))

    def can_admit(self, num_prompt_tokens: int) -> bool:
        """Whether a new prompt fits in free blocks next to what is already queued.

        Counts the prompt, every waiting sequence in full (less the blocks a paused one keeps), and for each running
        sequence the rest of its prompt or at least one block of decode headroom. Prefix-cache hits are ignored:
        conservative.
        """
        kv = self.kv_cache
        needed = kv.num_blocks_for(num_prompt_tokens)
        needed += sum(kv.num_blocks_for(seq.num_tokens) - kv.get_num_blocks(seq.seq_id) for seq in self._waiting)
        for seq in self._running:
            needed += max(1, kv.num_blocks_for(seq.num_tokens) - kv.get_num_blocks(seq.seq_id))
        return needed <= kv.num_free_blocks

    # --- the step -------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and token counts within the token budget, preempting on low memory."""
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledSeq] = {}
        preempted: list[Sequence] = []
        self._num_steps += 1
        background_turns, background_seats = self._background_turns()

        # Running sequences first, most important first. Victims are taken from the tail of the sorted
        # list, so a sequence already scheduled this step (ahead of index i) is never preempted.
        i = 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            if self._background_max_seqs is not None and self.is_background(seq) \
                    and seq.seq_id not in background_turns:
                i += 1  # not its turn: keeps its seat and blocks
                continue
            num_new = min(seq.num_uncomputed_tokens, budget, self._chunk_cap)
            drafts = self._drafts_of(seq, budget)
            block_table = self.kv_cache.allocate_slots(seq, num_new + len(drafts))
            if block_table is None and drafts:  # blocks short: the drafts go before anyone's seat
                drafts = []
                block_table = self.kv_cache.allocate_slots(seq, num_new)
            while block_table is None:
                if self._drop_paused_kv():  # a paused sequence's KV goes before a running one's
                    block_table = self.kv_cache.allocate_slots(seq, num_new)
                    continue
                victim = self._running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
                block_table = self.kv_cache.allocate_slots(seq, num_new)
            if block_table is None:
                break  # seq preempted itself: it was the last one
            scheduled[seq.seq_id] = self._scheduled(seq, num_new, block_table, drafts)
            budget -= num_new + len(drafts)
            i += 1

        # Memory is short if anything was preempted: admitting now would only thrash it back in.
        if not preempted:
            self._admit_waiting(budget, scheduled, preempted, background_seats)
        if self.config.isolate_priority_prefill:
            self._defer_less_important_decodes(scheduled)
        entries = list(scheduled.values())
        for entry in entries:
            entry.seq.last_scheduled_step = self._num_steps
        return SchedulerOutput(
            scheduled=entries,
            preempted_ids=[seq.seq_id for seq in preempted],
            num_batched_tokens=sum(e.num_new_tokens for e in entries),
            is_background_only=bool(entries) and all(self.is_background(e.seq) for e in entries),
        )

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int],
                           accepted: dict[str, list[int]] | None = None) -> list[Sequence]:
        """Apply a finished step: advance computed tokens, cache full blocks, append sampled tokens.

        ``sampled`` maps seq_id to the token sampled for each entry with ``needs_sample``; ``accepted``, for an
        entry with drafts, the drafts kept (a prefix of them), which come before its sampled token: the KV of the
        rejected ones is left to be overwritten. Sequences that reach ``max_tokens`` or ``max_model_len`` finish
        here with FINISHED_LENGTH (blocks freed). Returns the sequences that got a token, finished ones included;
        the engine checks EOS / stop strings and calls ``finish_request``. Entries finished or aborted while the
        step ran are skipped.
        """
        self._finished_by_length.clear()
        max_model_len = self.config.max_model_len
        got_token: list[Sequence] = []
        for entry in output.scheduled:
            seq = entry.seq
            if seq.status != RequestStatus.RUNNING:
                continue
            if seq.num_computed_tokens != entry.start_pos:
                raise RuntimeError(f"stale output for {seq.seq_id!r}: was update_from_output applied twice?")
            kept = accepted.get(seq.seq_id, []) if accepted and entry.draft_token_ids else []
            if kept != entry.draft_token_ids[:len(kept)]:
                raise ValueError(f"{seq.seq_id!r}: accepted tokens are not a prefix of its drafts")
            seq.num_computed_tokens += entry.num_new_tokens - len(entry.draft_token_ids) + len(kept)
            seq.token_ids.extend(kept)  # the scheduler bounded the drafts: max_tokens and the context hold them
            self.kv_cache.cache_blocks(seq, seq.num_computed_tokens)
            if not entry.needs_sample:
                continue
            token_id = sampled.get(seq.seq_id)
            if token_id is None:
                raise KeyError(f"no sampled token for {seq.seq_id!r}, whose step needed one")
            seq.append_token(token_id)
            got_token.append(seq)
            if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= max_model_len:
                self._finish(seq, RequestStatus.FINISHED_LENGTH)
                self._finished_by_length[seq.seq_id] = seq
        return got_token

    # --- internals ------------------------------------------------------------------------------------

    def _admit_waiting(self, budget: int, scheduled: dict[str, ScheduledSeq], preempted: list[Sequence],
                       background_seats: int) -> None:
        """Admit waiting sequences in order while budget, seats and blocks last."""
        while budget > 0 and self._waiting:
            seq = self._waiting.peek()
            assert seq is not None  # the loop runs only while the queue has a member
            if seq in preempted:
                break  # just preempted for memory; everything behind it is less important anyway
            if self.is_background(seq):
                if background_seats <= 0:
                    break  # the rest of the queue is background too
                background_seats -= 1
            if self._memory_seats is not None and len(self._running) >= self._memory_seats:
                break  # the device ran out of memory with one more than this running
            if len(self._running) >= self.config.max_num_seqs:
                # Seats full: a strictly more important request takes the least important one's seat, so a pro
                # request never waits for a free one to finish; at equal priority, a tenant holding far fewer
                # seats takes one from the tenant holding the most (_victim_for). A paused one waits for a free
                # seat: it takes none by force.
                refund = None if seq.status == RequestStatus.PAUSED else self._yield_to(seq, scheduled, preempted)
                if refund is None:
                    # Its tenant has its share of the seats: another tenant's request behind it may not.
                    taker = self._under_share(seq, preempted)
                    if taker is not None:
                        seq = taker
                        refund = self._yield_to(seq, scheduled, preempted)
                        # _under_share picked seq because its tenant may take a seat: _victim_for finds it one.
                        assert refund is not None
                    else:
                        # Or a new request pauses a long generation of a tenant holding more (pausing.py).
                        taker, refund = self._pause_for_waiting(seq, scheduled)
                        if taker is None or refund is None:
                            break
                        seq = taker
                budget += refund  # seq takes the seat now (the one preempted for it waits, perhaps ahead of it)
            is_paused = seq.status == RequestStatus.PAUSED
            if not is_paused and self.kv_cache.is_prefix_in_flight(seq, self._running):
                break  # one step later its next blocks are cache hits instead of computed twice
            computed_blocks: list[Block]
            while True:
                if is_paused:  # resuming: its blocks are its own still, nothing to look up
                    computed_blocks, num_hit = [], seq.num_computed_tokens
                else:
                    computed_blocks, num_hit = self.kv_cache.get_computed_blocks(seq)
                num_new = min(seq.num_tokens - num_hit, budget, self._chunk_cap)
                block_table = self.kv_cache.allocate_slots(seq, num_new, computed_blocks)
                if block_table is not None:
                    break
                if self._drop_paused_kv(keep=seq):
                    continue
                refund = self._yield_to(seq, scheduled, preempted)  # blocks short: same rule
                if refund is None:
                    break
                budget += refund
            if block_table is None:
                break  # strict order: a smaller request behind it must not overtake it
            self._waiting.remove(seq.seq_id)
            if seq.status == RequestStatus.WAITING:
                # First admission only: what usage reports as cached. A continuation's hit may run past its prompt
                # into the tokens its first worker streamed (loaded from a shared KV tier): those are completion
                # tokens, and cached_tokens is a part of prompt_tokens.
                seq.num_cached_tokens = min(num_hit, seq.num_prompt_tokens)
                if self.config.enable_prefix_caching:
                    self.prefix_cache_queries += seq.num_tokens
                    self.prefix_cache_hits += num_hit
            seq.num_computed_tokens = num_hit
            seq.status = RequestStatus.RUNNING
            seq.num_output_at_start = seq.num_output_tokens
            insort(self._running, seq, key=_sort_key)
            scheduled[seq.seq_id] = self._scheduled(seq, num_new, block_table)
            budget -= num_new

    @staticmethod
    def _defer_less_important_decodes(scheduled: dict[str, ScheduledSeq]) -> None:
        """Drop from this step the decodes less important than the most important prefill in it. Their blocks
        stay allocated (allocation is idempotent), and they run again next step."""
        prefilling = [e.seq.priority for e in scheduled.values() if e.start_pos < e.seq.num_prompt_tokens]
        if not prefilling:
            return
        top = min(prefilling)
        for seq_id in [sid for sid, e in scheduled.items()
                       if e.seq.priority > top and e.start_pos >= e.seq.num_prompt_tokens]:
            del scheduled[seq_id]

    def _yield_to(self, seq: Sequence, scheduled: dict[str, ScheduledSeq], preempted: list[Sequence]) -> int | None:
        """Preempt a running sequence for ``seq`` (see ``_victim_for``); returns the tokens its cancelled schedule
        gives back to the budget, or None when nobody yields."""
        victim = self._victim_for(seq)
        if victim is None:
            return None
        self._running.remove(victim)
        self._preempt(victim)
        preempted.append(victim)
        cancelled = scheduled.pop(victim.seq_id, None)
        return 0 if cancelled is None else cancelled.num_new_tokens

    def _under_share(self, head: Sequence, preempted: list[Sequence]) -> Sequence | None:
        """The first waiting sequence of ``head``'s priority, of another tenant, that a seat would be taken for;
        None when there is none (the usual case: one tenant, or seats shared evenly)."""
        if not self._running or self._running[-1].priority != head.priority:
            return None
        seats = self._tenant_seats(head.priority)
        others = sorted((s for s in self._waiting if s.priority == head.priority and s.tenant != head.tenant
                         and s not in preempted and s.status != RequestStatus.PAUSED), key=_sort_key)
        return next((s for s in others if seats.may_take(s.tenant)), None)

    def _victim_for(self, seq: Sequence) -> Sequence | None:
        """Who gives up a seat to ``seq`` (scheduler/seats.py): the least important running sequence if ``seq``
        outranks it; at equal priority, the latest of the tenant holding the most seats of that priority, if
        ``seq``'s tenant may take one of them."""
        if not self._running:
            return None
        least = self._running[-1]
        if least.priority != seq.priority:
            return least if outranks(seq.priority, least.priority) else None
        seats = self._tenant_seats(seq.priority)
        if not seats.may_take(seq.tenant):
            return None
        holder = seats.holder()
        return max((s for s in self._running if s.priority == seq.priority and s.tenant == holder), key=_sort_key)

    def _pause_for_waiting(self, head: Sequence, scheduled: dict[str, ScheduledSeq],
                           ) -> tuple[Sequence | None, int | None]:
        """With every seat taken and nobody yielding by the seat rule: the first new waiting sequence of ``head``'s
        priority that may pause a running one (scheduler/pausing.py), and the tokens the paused one's cancelled
        schedule gives back; (None, None) when there is none."""
        rule = self._pause_rules.get(head.priority)
        if rule is None or not self._running or self._running[-1].priority != head.priority:
            return None, None
        seats = self._tenant_seats(head.priority)
        running = [s for s in self._running if s.priority == head.priority]
        none_for: set[int] = set()  # seats held by tenants found nobody to pause: the answer is the same
        for seq in sorted((s for s in self._waiting if s.priority == head.priority
                           and s.status == RequestStatus.WAITING), key=_sort_key):
            held = seats.held.get(seq.tenant, 0)
            if held in none_for:
                continue
            victim = pause_victim(running, seats, seq.tenant, rule, _tenant_of, _progress_of)
            if victim is None:
                none_for.add(held)
                continue
            if self.kv_cache.is_prefix_in_flight(seq, self._running):
                continue  # it would not start this step (_admit_waiting): pausing for it would waste the pause
            self._running.remove(victim)
            victim.status = RequestStatus.PAUSED
            victim.num_pauses += 1
            self.num_pauses += 1
            self._waiting.push(victim)  # by its arrival: ahead of the requests that came after it
            cancelled = scheduled.pop(victim.seq_id, None)
            return seq, 0 if cancelled is None else cancelled.num_new_tokens
        return None, None

    def _drop_paused_kv(self, keep: Sequence | None = None) -> bool:
        """Blocks are short: the latest paused sequence (not ``keep``) drops its KV and will recompute it, as a
        preempted one (its tokens are kept); False when no paused sequence holds KV."""
        paused = [s for s in self._waiting if s.status == RequestStatus.PAUSED and s is not keep]
        if not paused:
            return False
        seq = max(paused, key=_sort_key)
        self.kv_cache.free(seq)
        seq.num_computed_tokens = 0
        seq.status = RequestStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        return True

    def _tenant_seats(self, priority: int) -> TenantSeats:
        return TenantSeats(s.tenant for s in self._running if s.priority == priority)

    def _scheduled(self, seq: Sequence, num_new: int, block_table: list[int],
                   drafts: list[int] | None = None) -> ScheduledSeq:
        """``num_new`` of the sequence's tokens and its ``drafts`` after them."""
        start, drafts = seq.num_computed_tokens, drafts or []
        return ScheduledSeq(seq, num_new + len(drafts), start, block_table,
                            needs_sample=start + num_new == seq.num_tokens, draft_token_ids=drafts)

    def _drafts_of(self, seq: Sequence, budget: int) -> list[int]:
        """The drafts a decoding ``seq`` runs this step: as many of its proposed ones as the budget, its
        ``max_tokens`` and the context leave room for, with the token they follow (all kept, and the one sampled
        after them). Taken from the sequence: a proposal is for one step."""
        drafts, seq.draft_token_ids = seq.draft_token_ids, []
        if not drafts or seq.num_uncomputed_tokens != 1:
            return []
        room = min(budget - 1, seq.max_tokens - seq.num_output_tokens - 1,
                   self.config.max_model_len - seq.num_tokens - 1)
        return drafts[:max(0, room)]

    def _preempt(self, seq: Sequence) -> None:
        """Drop a running sequence's KV and requeue it; it recomputes prompt and outputs when readmitted."""
        self.kv_cache.free(seq)
        seq.num_computed_tokens = 0
        seq.status = RequestStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.push(seq)

    def shed_one(self) -> Sequence | None:
        """The step could not run (the device ran out of memory): preempt the least important running sequence
        and admit no more than are left running until a sequence finishes. Returns the preempted sequence, or
        None when at most one was running (shedding cannot help; the caller fails it instead)."""
        if len(self._running) <= 1:
            return None
        victim = self._running.pop()
        self._preempt(victim)
        self._memory_seats = len(self._running)
        return victim

    def _finish(self, seq: Sequence, status: RequestStatus) -> None:
        self._memory_seats = None  # a finish frees memory: try the full batch again
        del self._requests[seq.seq_id]
        if seq.status == RequestStatus.RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq.seq_id)
        self.kv_cache.free(seq)
        seq.status = status
