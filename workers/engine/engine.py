"""The serving engine: continuous batching over a paged KV cache.

    add_request ──▶ Scheduler (pure Python: queues, KV blocks, prefix cache, chunked prefill, preemption)
                        │ schedule(): which tokens of which sequences run this step, under a token budget
                        ▼
                    ModelRunner.execute(): one mixed forward (prefill chunks + decodes) over the paged cache
                        │ logits of sequences whose chunk reached their end (and of each of their drafts)
                        ▼
                    next_tokens(): grammar masks, sampling, drafts kept ──▶ Scheduler.update_from_output() ──▶
                    Deltas (deltas.py): eos / stop strings / detokenize ──▶ tool calls ──▶ TokenDelta
                        │
                        ▼ PromptLookup.propose() (speculation.py) or DraftModel.propose() (draft_model.py): the
                          next step's drafts, where the batch's size was measured to gain by them
                          (speculation_gate.py)

``Engine.step()`` is schedule → run → update and does no I/O; the worker's async loop calls it from a thread.
A request with ``n > 1`` becomes n sequences over the same prompt. Only the first is scheduled at once; the
others join when its prefill has produced a token, so they find the prompt's full blocks in the prefix cache
instead of computing them n times.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time

import torch

from switchyard.scheduler import RequestStatus, Scheduler, SchedulerOutput, finish_reason
from switchyard.scheduler.pausing import PauseRule
from switchyard.shared.messages import ErrorInfo, GenerateRequest, TokenDelta
from switchyard.shared.tiers import BATCH_TIER, TIER_NAMES, get_tier
from switchyard.workers.engine.config import EngineConfig
from switchyard.workers.engine.deltas import Deltas
from switchyard.workers.engine.draft_model import DraftModel
from switchyard.workers.engine.kv_change_log import KVChangeLog
from switchyard.workers.engine.logprobs import TokenLogprobs
from switchyard.workers.engine.next_tokens import StepTokens, next_tokens
from switchyard.workers.engine.sequences import MatcherPrompt, choice_of, new_request
from switchyard.workers.engine.speculation import PromptLookup
from switchyard.workers.engine.speculation_gate import SpeculationGate
from switchyard.workers.engine.stats import capacity_of, stats_of
from switchyard.workers.engine.tiered_prefixes import TieredPrefixes
from switchyard.workers.executor.cuda_graphs import GraphPass
from switchyard.workers.executor.model_runner import ForwardPass, ModelRunner, SeqChunk
from switchyard.workers.executor.thread_tuner import ThreadTuner
from switchyard.workers.kv_tiers.remote import KVPeers
from switchyard.workers.serving.choice import RequestState
from switchyard.workers.serving.guided import Grammars
from switchyard.workers.serving.interface import ROLES, BlockReader, EngineCapabilities
from switchyard.workers.serving.kv_changes import KVChanges
from switchyard.workers.serving.output_filter import OutputSafety, SafetyEvent
from switchyard.workers.serving.prompts import eos_token_ids, prepare_prompt
from switchyard.workers.serving.stats import EngineCapacity, EngineStats

log = logging.getLogger("switchyard.engine")

_LOAD_WAIT_S = 0.01  # a step with nothing to run but prefixes loading waits this long for one


class Engine:
    """Runs many requests at once on a Llama-family model; see the module docstring. The worker serves from it
    through ``ServingEngine`` (workers/serving/interface.py); tests and benchmarks also drive it directly."""

    def __init__(self, model, tokenizer, config: EngineConfig | None = None, draft_model=None) -> None:
        """``draft_model``: the model that proposes drafts where ``config.speculative`` is "draft" (draft_model.py),
        of ``tokenizer``'s vocabulary, on the same device."""
        self.config = config = config or EngineConfig()
        self.tokenizer = tokenizer
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        hf_config = model.config
        self.max_context = min(int(hf_config.max_position_embeddings), config.max_model_len or 1 << 30)
        budget = config.kv_budget(device)
        num_blocks = ModelRunner.num_blocks_for_budget(hf_config, dtype, config.block_size, budget,
                                                       config.kv_cache_dtype)
        blocks_per_seq = -(-self.max_context // config.block_size)
        # Never more than every slot at full context twice over (the rest would only hold stale prefixes), and
        # never fewer than one full-context sequence needs, or that sequence could never run.
        num_blocks = min(num_blocks, 2 * config.max_num_seqs * blocks_per_seq)
        num_blocks = max(num_blocks, blocks_per_seq + 1)
        self.runner = ModelRunner(model, num_blocks, config.block_size, device=device, dtype=dtype,
                                  attention_backend=config.attention_backend, quantization=config.quantization,
                                  kv_cache_dtype=config.kv_cache_dtype)
        if config.cuda_graphs and device.type == "cuda" and self.runner.attention.name == "triton":
            self.runner.capture_cuda_graphs(config.max_num_seqs, self.max_context)
        tiers = config.tier_settings(device)
        tiers_on = tiers.enabled and config.enable_prefix_caching
        self.scheduler = Scheduler(dataclasses.replace(
            config.scheduler_config(num_blocks, self.max_context, background_priority=get_tier(BATCH_TIER).priority),
            record_cached_blocks=tiers_on, record_kv_events=config.kv_events))
        # Host and disk tiers below the pool: blocks written through as they are cached, prefixes loaded back.
        self.tiers = TieredPrefixes(tiers, model, self.runner, self.scheduler.kv_cache,
                                    config.kv_events) if tiers_on else None
        self.kv_changes = KVChangeLog(config.block_size, self.scheduler.kv_cache.pool, self.tiers) \
            if config.kv_events else None
        self.vocab_size = int(hf_config.vocab_size)  # the model's logits
        self._grammars: Grammars | None = None
        self._requests: dict[str, RequestState] = {}
        self._deltas = Deltas(self.scheduler, eos_token_ids(model, tokenizer), self._requests)
        self._pending: list[TokenDelta] = []  # finals of aborted requests, sent with the next step's output
        self.safety = OutputSafety()  # output filters; the worker takes their verdicts after each step
        self._logprobs = TokenLogprobs(tokenizer)
        # Speculative decoding (speculation.py, draft_model.py): drafts proposed after each step for the next.
        self._speculator: PromptLookup | DraftModel | None = None
        if config.speculative == "ngram":
            self._speculator = PromptLookup(config.num_speculative_tokens)
        elif config.speculative == "draft":
            if draft_model is None:
                raise ValueError("speculative 'draft' needs a draft model")
            # Its own cache of as many blocks as the pool; its weights as speculative_quantization says.
            self._speculator = DraftModel(ModelRunner(draft_model, num_blocks, config.block_size, device=device,
                                                      dtype=next(draft_model.parameters()).dtype,
                                                      quantization=config.speculative_quantization),
                                          config.num_speculative_tokens, config.max_num_batched_tokens)
        self._threads = ThreadTuner(torch.get_num_threads(), torch.set_num_threads) \
            if config.tune_threads and device.type == "cpu" else None
        # Whether a batch speculates is measured (speculation_gate.py): drafts that pay alone may not in a batch.
        self._gate = (SpeculationGate(self._speculator) if self._speculator is not None and config.speculation_measured
                      else None)
        self.num_draft_tokens = 0  # drafts computed since start, and those kept: the acceptance rate
        self.num_accepted_draft_tokens = 0
        # prepare() runs off the step thread, on up to config.prepare_threads threads at once: each on a tokenizer
        # of its own (a fast tokenizer is not safe to share between threads), made ahead by warmup().
        self._prepare_local = threading.local()
        self._spare_tokenizers: list = []
        self._prepare_lock = threading.Lock()
        self.num_interrupted_steps = 0  # batch-only steps abandoned for an arriving interactive request
        self.num_out_of_memory_steps = 0  # steps the device had no memory for (see _shed_for_memory)
        self.num_failed_steps = 0  # steps that raised and were run sequence by sequence (_compute_each_alone)
        self._last_batch = (0, 0)  # sequences and tokens of the last step that ran, for stats()
        # A background-only step part-way through its layers, and whether it must be dropped at the next call.
        self._in_flight: tuple[SchedulerOutput, ForwardPass | GraphPass] | None = None
        self._drop_in_flight = False
        bytes_per_token = ModelRunner.kv_bytes_per_token(hf_config, dtype, config.kv_cache_dtype)
        log.info(
            "KV cache: %s, %d bytes/token, %d blocks of %d tokens (%.1f MiB), %d tokens, max %d sequences at full "
            "context %d; attention backend %s; linear layers %s (%.0f MiB packed); elementwise ops %s; CUDA graphs %s",
            str(self.runner.kv_dtype).removeprefix("torch."), bytes_per_token, num_blocks, config.block_size,
            num_blocks * config.block_size * bytes_per_token / 2**20,
            num_blocks * config.block_size, num_blocks * config.block_size // self.max_context, self.max_context,
            self.runner.attention.name, self.runner.linear_kernel, self.runner.packed_weight_bytes / 2**20,
            self.runner.ops.name, "on" if self.runner.graphs is not None else "off")

    # -- the interface (workers/serving/interface.py) ------------------------------------------------------
    @property
    def capabilities(self) -> EngineCapabilities:
        """KV exchange when it keeps KV tiers (``kv_offload_*``); the batch limit per step and pausing always (its
        scheduler)."""
        return EngineCapabilities(ROLES, kv_exchange=self.tiers is not None, background_limit=True, pausing=True)

    def set_pause_rules(self, after_tokens: dict[str, int]) -> None:
        """Each tier's pausing quantum, for its scheduler (by the tier's priority)."""
        self.scheduler.set_pause_rules({get_tier(tier).priority: PauseRule(n) for tier, n in after_tokens.items()
                                        if tier in TIER_NAMES})

    @property
    def device_type(self) -> str:
        return self.runner.device.type

    @property
    def kv_block_size(self) -> int:
        return self.config.block_size

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        """Sequences queued inside the engine (not yet running, or preempted, or their prefix loading)."""
        return self.scheduler.num_waiting + self._num_loading

    @property
    def num_free_slots(self) -> int:
        """How many more requests the worker may pull now (the backlog stays in JetStream)."""
        return self.capacity().num_free_seats

    def capacity(self) -> EngineCapacity:
        """Seats, KV use and waiting sequences now; call it where steps run (it reads the scheduler's lists)."""
        return capacity_of(self.scheduler, self._num_loading)

    def stats(self) -> EngineStats:
        """Load per tier and counters since start; call it where steps run (it reads the scheduler's lists)."""
        return stats_of(self.scheduler, *self._last_batch, kv_tiers=self.tiers.stats() if self.tiers else [],
                        drafts=(self.num_draft_tokens, self.num_accepted_draft_tokens,
                                self._gate.num_steps_off if self._gate is not None else 0))

    @property
    def _num_loading(self) -> int:
        return self.tiers.num_loading if self.tiers is not None else 0

    def has_unfinished_requests(self) -> bool:
        return (bool(self._requests) or bool(self._pending) or self._in_flight is not None
                or (self.tiers is not None and self.tiers.num_handovers > 0))

    def prepare(self, req: GenerateRequest) -> MatcherPrompt:
        """``req``'s prompt, tokenized and checked, and its grammar compiled (``prepare_prompt``): safe to call
        off the step thread while steps run, so that none of it delays a step."""
        tokenizer = getattr(self._prepare_local, "tokenizer", None)
        if tokenizer is None:
            with self._prepare_lock:
                tokenizer = self._spare_tokenizers.pop() if self._spare_tokenizers else copy.deepcopy(self.tokenizer)
            self._prepare_local.tokenizer = tokenizer
        return prepare_prompt(tokenizer, req, self.max_context, self.grammars, self.vocab_size,
                              self.config.block_size if self.kv_changes is not None else None)

    def warmup(self) -> None:
        """What would otherwise be made on first use (kernels, allocator, ``prepare``'s tokenizers), made now."""
        self.runner.warmup()
        with self._prepare_lock:
            # One for each prepare thread and one for the intake's slow lane (workers/service/intake.py): a copy
            # made on first use holds the GIL while it is made, and every serving thread waits for it.
            while len(self._spare_tokenizers) < self.config.prepare_threads + 1:
                self._spare_tokenizers.append(copy.deepcopy(self.tokenizer))

    def shutdown(self) -> None:
        """Stop the KV tiers' threads; the rest is memory, which goes with the engine (running requests are the
        worker's to end)."""
        if self.tiers is not None:
            self.tiers.close()

    def take_safety_events(self) -> list[SafetyEvent]:
        return self.safety.take_events()

    def take_kv_changes(self) -> KVChanges | None:
        """What the KV cache gained and lost since the last call (None: this engine was not asked to record it)."""
        return self.kv_changes.take() if self.kv_changes is not None else None

    def kv_listing(self) -> dict[str, list[int]]:
        """Every block held now, per tier (a KV-events snapshot); safe to call from another thread."""
        return self.kv_changes.listing() if self.kv_changes is not None else {}

    def connect_kv_peers(self, peers: KVPeers) -> BlockReader:
        """Fetch prefixes other nodes hold through ``peers``; returns how to read a block this node holds (to
        serve theirs). Only with KV tiers (``capabilities``)."""
        if self.tiers is None:
            raise NotImplementedError("this engine keeps no KV tiers (kv_offload_gib is 0)")
        self.tiers.connect(peers)
        return self.tiers.read_block

    def add_request(self, req: GenerateRequest, prepared: MatcherPrompt | None = None) -> int:
        """Queue ``req``; returns its prompt token count. ``prepared``: its prompt as ``prepare`` made it off the
        step thread; without it the prompt is tokenized here. Raises ``RequestRejected`` before compute for what
        can never run here (over the context, bad n)."""
        if req.request_id in self._requests:
            raise ValueError(f"request {req.request_id!r} is already running")
        if prepared is None:
            prepared = prepare_prompt(self.tokenizer, req, self.max_context, self.grammars, self.vocab_size)
        priority = get_tier(req.tier).priority if req.tier in TIER_NAMES else len(TIER_NAMES)
        state, seqs = new_request(req, prepared, self.tokenizer, self.safety, priority)
        if self.kv_changes is not None:
            self.kv_changes.add_prefixes(prepared.prefix_segments)
        if self.tiers is not None and self.tiers.admit(req.request_id, seqs[0], req.kv_source):
            state.held = seqs  # choice 0 too, until its prefix is loaded into the pool (step)
        else:
            self.scheduler.add_request(seqs[0])
            state.held = seqs[1:]
        if not self.scheduler.is_background(seqs[0]):
            self._drop_in_flight = True  # it must not wait for a batch-only step to finish
        self._requests[req.request_id] = state
        return state.num_prompt_tokens

    @property
    def grammars(self) -> Grammars:
        """Compiled grammars for this engine's tokenizer (made at first use: a large vocabulary takes a moment)."""
        with self._prepare_lock:  # prepare() calls it from several threads
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.vocab_size, lexer_fuel=self.config.grammar_lexer_fuel,
                                          max_bytes=self.config.max_grammar_bytes,
                                          compile_threads=self.config.prepare_threads)
        return self._grammars

    def abort_request(self, request_id: str, error: ErrorInfo | None = None) -> bool:
        """Free the request's KV blocks now; its final deltas come with the next step: ``cancelled``, or with
        ``error`` when one is given (the worker ending it, not the client)."""
        state = self._requests.get(request_id)
        if state is None:
            return False
        self._drop_in_flight = True  # the step in flight may hold its sequences
        status = RequestStatus.FINISHED_ABORTED if error is None else RequestStatus.FINISHED_ERROR
        if self.tiers is not None:
            self.tiers.abort(request_id)
        self._pending.extend(self._end_request(state, status, error))
        return True

    def _end_request(self, state: RequestState, status: RequestStatus,
                     error: ErrorInfo | None = None) -> list[TokenDelta]:
        """End every unfinished choice of a request (held ones too) with ``status``; returns their finals."""
        held, state.held = state.held, []
        live = held + [seq for seq_id in state.seq_ids
                       if (seq := self.scheduler.abort_request(seq_id, status)) is not None]
        reason = finish_reason(status)
        assert reason is not None, status  # an ending status: aborted or error
        return [self._deltas.finish(seq, reason, "", error)
                for seq in sorted(live, key=lambda s: choice_of(s).index)]

    # -- the step -----------------------------------------------------------------------------------------
    def step(self, background_limit: int | None = None) -> list[TokenDelta]:
        """Schedule → run the model → update; returns at most one delta per choice that made progress.

        ``background_limit``: at most this many batch-tier sequences run in this step (None: no limit), the others
        keep their seats and take turns; the worker's ``BackgroundPolicy`` decides it.

        A step that runs batch-tier sequences only is run ``background_layers_per_call`` layers per call, and is
        dropped when an interactive request is added (or a request aborted) between two calls, so that request's
        first token does not wait for it. A dropped step changes nothing but the scheduling it did (admissions,
        block allocations); its sequences run again in the next one.
        """
        outputs, self._pending = self._pending, []
        if self._in_flight is not None and self._drop_in_flight:
            self._in_flight = None
            self.num_interrupted_steps += 1
        self._drop_in_flight = False
        if self.tiers is not None:
            outputs += self.tiers.release_handovers()
            for request_id, loaded_bytes in self.tiers.take_ready():  # prefixes loaded: their requests may start
                state = self._requests[request_id]
                state.kv_loaded_bytes += loaded_bytes
                self.scheduler.add_request(state.held.pop(0))
        if self._in_flight is None:
            self.scheduler.set_background_limit(background_limit)
            plan = self.scheduler.schedule()
            if plan.is_empty:
                if self.tiers is not None and self.tiers.num_loading:
                    self.tiers.wait(_LOAD_WAIT_S)  # nothing else to run: wait for a load rather than spin
                elif self.tiers is not None and not outputs:
                    self.tiers.wait_for_writes(_LOAD_WAIT_S)  # or for a held hand-over's blocks
                return outputs
        else:
            plan = self._in_flight[0]
        # A step run whole in this call times the model's speed (prefill, for the tiers' fetch-or-compute choice).
        started = time.perf_counter() if self._in_flight is None else None
        try:
            computed = self._compute(plan)
        except torch.OutOfMemoryError:
            # Nothing of this step happened but its scheduling, as for a dropped step: shed load and go on.
            self._in_flight = None
            outputs.extend(self._shed_for_memory(plan))
            return outputs
        except Exception:
            log.exception("a step of %d sequences failed; running each alone to find the one that fails",
                          len(plan.scheduled))
            self._in_flight = None
            computed = self._compute_each_alone(plan, outputs)
        if computed is None:
            return outputs
        self._last_batch = (len(plan.scheduled), sum(e.num_new_tokens for e in plan.scheduled))
        if self.tiers is not None and started is not None:
            self.tiers.note_step(self._last_batch[1], time.perf_counter() - started)
        self.num_draft_tokens += computed.num_drafts
        self.num_accepted_draft_tokens += computed.num_kept
        if self._gate is not None and started is not None:
            self._gate.observed(len(plan.scheduled), _is_decode(plan), time.perf_counter() - started,
                                sum(e.needs_sample for e in plan.scheduled) + computed.num_kept)
        for seq in self.scheduler.update_from_output(plan, computed.sampled, computed.accepted):
            if seq.seq_id in computed.logprobs and (unreported := choice_of(seq).unreported_logprobs) is not None:
                unreported.append(computed.logprobs[seq.seq_id])
            delta = self._deltas.on_tokens(seq, 1 + len(computed.accepted.get(seq.seq_id, ())))
            if delta is not None:
                outputs.append(delta)
        if self._speculator is not None:
            sampled = [e.seq for e in plan.scheduled if e.needs_sample]
            (self._gate or self._speculator).propose(sampled)
        if self.tiers is not None:
            self.tiers.store_new()
            outputs = self.tiers.hold_handovers(outputs)  # sent once their blocks are in the tier
        return outputs

    def _compute(self, plan: SchedulerOutput) -> StepTokens | None:
        """Run the model for ``plan`` (or the next layers of the step in flight) and sample; None while a
        batch-only step still has layers to run."""
        timed = None  # (tokens, threads, start) of a step run whole, for the thread tuner
        if self._in_flight is None:
            chunks = [SeqChunk(s.token_ids, s.start_pos, s.block_table, s.needs_sample, len(s.draft_token_ids))
                      for s in plan.scheduled]
            if self._threads is not None and not plan.is_background_only:
                num_tokens = sum(len(c.token_ids) for c in chunks)
                timed = (num_tokens, self._threads.choose(num_tokens), time.perf_counter())
            fwd = self.runner.begin(chunks)
        else:
            fwd = self._in_flight[1]
        logits = self.runner.advance(fwd, self.config.background_layers_per_call if plan.is_background_only else None)
        if logits is None:
            self._in_flight = (plan, fwd)
            return None
        self._in_flight = None
        tokens = next_tokens(logits, [s for s in plan.scheduled if s.needs_sample], self._logprobs)
        if timed is not None:
            assert self._threads is not None
            self._threads.observed(timed[0], timed[1], time.perf_counter() - timed[2])
        return tokens

    def _compute_each_alone(self, plan: SchedulerOutput, outputs: list[TokenDelta],
                            ) -> StepTokens:
        """A step failed: compute each of its sequences alone. A sequence that fails alone fails its request (and
        only it, with a 500); the others get their tokens as if the step had run. Rewriting a chunk's KV slots
        writes the values the failed step may have written already."""
        self.num_failed_steps += 1
        tokens = StepTokens()
        error = ErrorInfo("The worker had an error processing your request.", code="internal_error",
                          type="server_error", status=500)
        for entry in plan.scheduled:
            state = choice_of(entry.seq).request
            if state.request_id not in self._requests:
                continue  # a sibling choice failed before it
            try:
                one = self._compute(SchedulerOutput(scheduled=[entry]))
            except Exception:
                log.exception("request %s fails on its own: failing it alone", state.request_id)
                outputs.extend(self._end_request(state, RequestStatus.FINISHED_ERROR, error))
                continue
            if one is not None:
                tokens.update(one)
        return tokens

    def _shed_for_memory(self, plan: SchedulerOutput) -> list[TokenDelta]:
        """The device ran out of memory in a step: preempt the least important running sequence and retry with
        fewer; when one sequence alone does not fit, fail its request and only it."""
        self.num_out_of_memory_steps += 1
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        victim = self.scheduler.shed_one()
        if victim is not None:
            log.warning("device out of memory in a step of %d sequences: preempted %s, retrying with fewer",
                        len(plan.scheduled), victim.seq_id)
            return []
        if not plan.scheduled:
            return []
        state = choice_of(plan.scheduled[0].seq).request
        log.error("device out of memory with %s alone running: failing it", state.request_id)
        error = ErrorInfo("The request does not fit in the accelerator's memory.", code="out_of_memory",
                          type="server_error", status=503)
        return self._end_request(state, RequestStatus.FINISHED_ERROR, error)

    # -- metrics ------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.scheduler.kv_cache.num_blocks


def _is_decode(plan: SchedulerOutput) -> bool:
    """Whether every sequence of ``plan`` reads only its last token and its drafts (no prompt chunk)."""
    return all(e.needs_sample and e.num_new_tokens == 1 + len(e.draft_token_ids) for e in plan.scheduled)
