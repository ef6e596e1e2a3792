"""The serving engine: continuous batching over a paged KV cache.

    add_request ──▶ Scheduler (pure Python: queues, KV blocks, prefix cache, chunked prefill, preemption)
                        │ schedule(): which tokens of which sequences run this step, under a token budget
                        ▼
                    ModelRunner.execute(): one mixed forward (prefill chunks + decodes) over the paged cache
                        │ logits of sequences whose chunk reached their end
                        ▼
                    grammar masks ─▶ sample() ──▶ Scheduler.update_from_output() ──▶ eos / stop strings /
                    detokenize ──▶ tool calls ──▶ TokenDelta

``Engine.step()`` is schedule → run → update and does no I/O; the worker's async loop calls it from a thread.
A request with ``n > 1`` becomes n sequences over the same prompt. Only the first is scheduled at once; the
others join when its prefill has produced a token, so they find the prompt's full blocks in the prefix cache
instead of computing them n times.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from switchyard.scheduler import RequestStatus, Scheduler, SchedulerConfig, SchedulerOutput, Sequence, finish_reason
from switchyard.shared.messages import ErrorInfo, GenerateRequest, TokenDelta, TokenLogprob, Usage
from switchyard.shared.tiers import BATCH_TIER, TIER_NAMES, get_tier
from switchyard.workers.engine.choice import Choice, RequestState
from switchyard.workers.engine.detokenizer import IncrementalDetokenizer
from switchyard.workers.engine.guided import Grammars, fill_masks
from switchyard.workers.engine.output_filter import OutputSafety
from switchyard.workers.engine.prompts import PreparedPrompt, RequestRejected, eos_token_ids, prepare_prompt
from switchyard.workers.engine.sampling import GREEDY_TEMPERATURE, make_generator, sample
from switchyard.workers.engine.stats import EngineStats
from switchyard.workers.engine.tool_calls import call_id
from switchyard.workers.engine.tool_parser import ToolCallParser
from switchyard.workers.executor.model_runner import ForwardPass, ModelRunner, SeqChunk
from switchyard.workers.executor.transfers import to_host_list

log = logging.getLogger("switchyard.engine")


_TIER_BY_PRIORITY = {get_tier(name).priority: name for name in TIER_NAMES}


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512  # per-step token budget shared by prefill chunks and decodes
    block_size: int = 16
    kv_cache_bytes: int | None = None  # CPU: this many bytes; None: 2 GiB on CPU, 80% of free memory on GPU
    gpu_memory_fraction: float = 0.8
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's own context
    # A step of background (batch) sequences only runs this many layers per step() call, so an interactive request
    # added between two calls drops it instead of waiting for it to finish (see Engine.step).
    background_layers_per_call: int = 1
    # CUDA with triton attention: replay decode steps from CUDA graphs captured at start (off: every step eager).
    cuda_graphs: bool = True
    attention_backend: str | None = None  # None: the best for the device (executor.attention.make_attention)


class Engine:
    """Runs many requests at once on a Llama-family model; see the module docstring."""

    def __init__(self, model, tokenizer, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.tokenizer = tokenizer
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        hf_config = model.config
        self.max_context = min(int(hf_config.max_position_embeddings), config.max_model_len or 1 << 30)
        budget = config.kv_cache_bytes or _default_kv_budget(device, config.gpu_memory_fraction)
        num_blocks = ModelRunner.num_blocks_for_budget(hf_config, dtype, config.block_size, budget)
        blocks_per_seq = -(-self.max_context // config.block_size)
        # Never more than every slot at full context twice over (the rest would only hold stale prefixes), and
        # never fewer than one full-context sequence needs, or that sequence could never run.
        num_blocks = min(num_blocks, 2 * config.max_num_seqs * blocks_per_seq)
        num_blocks = max(num_blocks, blocks_per_seq + 1)
        self.runner = ModelRunner(model, num_blocks, config.block_size, device=device, dtype=dtype,
                                  attention_backend=config.attention_backend)
        if config.cuda_graphs and device.type == "cuda" and self.runner.attention.name == "triton":
            self.runner.capture_cuda_graphs(config.max_num_seqs, self.max_context)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
            block_size=config.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            max_model_len=self.max_context,
            background_priority=get_tier(BATCH_TIER).priority,
        ))
        self._eos = eos_token_ids(model, tokenizer)
        self.vocab_size = int(hf_config.vocab_size)  # the model's logits
        self._grammars: Grammars | None = None
        self._requests: dict[str, RequestState] = {}
        self._pending: list[TokenDelta] = []  # finals of aborted requests, sent with the next step's output
        self.safety = OutputSafety()  # output filters; the worker takes their verdicts after each step
        self._token_texts: dict[int, str] = {}  # token id -> its text alone, for logprobs
        self.num_interrupted_steps = 0  # batch-only steps abandoned for an arriving interactive request
        self.num_out_of_memory_steps = 0  # steps the device had no memory for (see _shed_for_memory)
        self.num_failed_steps = 0  # steps that raised and were run sequence by sequence (_compute_each_alone)
        self._last_batch = (0, 0)  # sequences and tokens of the last step that ran, for stats()
        # A background-only step part-way through its layers, and whether it must be dropped at the next call.
        self._in_flight: tuple[SchedulerOutput, ForwardPass] | None = None
        self._drop_in_flight = False
        bytes_per_token = ModelRunner.kv_bytes_per_token(hf_config, dtype)
        log.info(
            "KV cache: %d bytes/token, %d blocks of %d tokens (%.1f MiB), %d tokens, max %d sequences at full "
            "context %d; attention backend %s; linear layers %s (%.0f MiB packed); elementwise ops %s; CUDA graphs %s",
            bytes_per_token, num_blocks, config.block_size, num_blocks * config.block_size * bytes_per_token / 2**20,
            num_blocks * config.block_size, num_blocks * config.block_size // self.max_context, self.max_context,
            self.runner.attention.name, self.runner.linear_kernel, self.runner.packed_weight_bytes / 2**20,
            self.runner.ops.name, "on" if self.runner.graphs is not None else "off")

    # -- admission ----------------------------------------------------------------------------------------
    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        """Sequences queued inside the engine (not yet running, or preempted)."""
        return self.scheduler.num_waiting

    @property
    def num_waiting_new(self) -> int:
        """Of those, the ones not started yet (preempted ones aside)."""
        return self.scheduler.num_waiting_new

    @property
    def num_free_slots(self) -> int:
        """How many more requests the worker may pull now (the backlog stays in JetStream)."""
        if self.scheduler.kv_cache.usage > 0.95:
            return 0
        return self.scheduler.num_free_slots

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending) or self._in_flight is not None

    def add_request(self, req: GenerateRequest, prepared: PreparedPrompt | None = None) -> int:
        """Queue ``req``; returns its prompt token count. ``prepared``: its prompt as ``prepare_prompt`` made it
        off the step thread; without it the prompt is tokenized here. Raises ``RequestRejected`` before compute
        for what can never run here (over the context, bad n)."""
        if req.request_id in self._requests:
            raise ValueError(f"request {req.request_id!r} is already running")
        if prepared is None:
            prepared = prepare_prompt(self.tokenizer, req, self.max_context, self.grammars, self.vocab_size)
        params, prompt_ids, max_tokens = req.sampling, prepared.token_ids, prepared.max_tokens
        priority = get_tier(req.tier).priority if req.tier in TIER_NAMES else len(TIER_NAMES)
        state = RequestState(req.request_id, params, len(prompt_ids), seq_ids=[],
                         num_dropped_messages=prepared.num_dropped_messages)
        arrival = time.monotonic()
        # vLLM's cache_salt idea: a tenant's blocks are found only by its own requests (see GenerateRequest).
        cache_salt = "shared" if req.shared_prefix_cache else f"tenant:{req.tenant_id or ''}"
        if req.resume is not None and (params.n != 1 or req.tool_use is not None):
            param = "n" if params.n != 1 else "tools"
            raise RequestRejected(ErrorInfo(f"A request with {param} set cannot be resumed.",
                                            code="invalid_value", param=param))
        # Everything is built before the scheduler sees any of it: a request that fails here leaves nothing behind.
        seqs = []
        for index in range(params.n):
            seq_id = req.request_id if params.n == 1 else f"{req.request_id}#{index}"
            seed = None if params.seed is None else params.seed + index
            choice = Choice(state, index,
                             IncrementalDetokenizer(self.tokenizer, stop=params.stop, prompt_token_ids=prompt_ids),
                             make_generator(seed),
                             unreported_logprobs=[] if params.logprobs else None,
                             guard=self.safety.guard(req, index))
            if prepared.matcher is not None:  # each choice follows the grammar on its own
                choice.matcher = prepared.matcher if index == 0 else prepared.matcher.deep_copy()
            if req.tool_use is not None and req.tool_use.choice != "none":
                choice.tools = ToolCallParser(lambda k, i=index: call_id(req.request_id, i, k))
            if params.echo:  # legacy completions: the text starts with the prompt, as the client wrote it
                choice.unsent_text = req.prompt if req.prompt is not None else self.tokenizer.decode(prompt_ids)
            seqs.append(Sequence(seq_id, list(prompt_ids), max_tokens, priority=priority, arrival=arrival, data=choice,
                                 cache_salt=cache_salt, tenant=req.tenant_id or ""))
            state.seq_ids.append(seq_id)
        if req.resume is not None:
            self._resume(seqs[0], req.resume.token_ids, req.resume.text_len)
        self.scheduler.add_request(seqs[0])
        state.held = seqs[1:]
        if not self.scheduler.is_background(seqs[0]):
            self._drop_in_flight = True  # it must not wait for a batch-only step to finish
        self._requests[req.request_id] = state
        return len(prompt_ids)

    @staticmethod
    def _resume(seq: Sequence, token_ids: list[int], text_len: int) -> None:
        """Make a new sequence go on from ``token_ids`` generated elsewhere, of whose text the client has
        ``text_len`` characters."""
        choice: Choice = seq.data
        try:
            seq.resume(token_ids)
        except ValueError as exc:
            raise RequestRejected(ErrorInfo(str(exc), code="invalid_value", param="resume")) from exc
        primed = choice.detokenizer.add_tokens(token_ids)
        if choice.matcher is not None and not choice.matcher.consume_tokens(token_ids):
            raise RequestRejected(ErrorInfo("The resumed tokens do not follow the request's response_format.",
                                            code="invalid_value", param="resume"))
        if choice.detokenizer.is_stopped:
            raise RequestRejected(ErrorInfo("The resumed tokens already contain a stop string.",
                                            code="invalid_value", param="resume"))
        # The same ids decode to the same text and hold back the same tail, so these differ only if the first
        # worker decoded differently; either way the client gets each character once. What the client is owed
        # before them (an echoed prompt) counts as sent text too.
        owed = choice.unsent_text + primed
        choice.skip_chars = max(0, text_len - len(owed))
        choice.unsent_text = owed[text_len:]
        if choice.guard is not None:
            choice.guard.prime(owed[:text_len])
        if choice.generator is not None and choice.request.params.temperature >= GREEDY_TEMPERATURE:
            # One uniform per sampled token: a seeded request goes on as it would have on the first worker.
            for _ in token_ids:
                choice.generator.random()

    @property
    def grammars(self) -> Grammars:
        """Compiled grammars for this engine's tokenizer (made at first use: a large vocabulary takes a moment)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.vocab_size)
        return self._grammars

    def stats(self) -> EngineStats:
        """Load per tier and counters since start; call it where steps run (it reads the scheduler's lists)."""
        running, waiting = self.scheduler.counts_by_priority()
        return EngineStats(
            running={_TIER_BY_PRIORITY.get(p, "other"): n for p, n in running.items()},
            waiting={_TIER_BY_PRIORITY.get(p, "other"): n for p, n in waiting.items()},
            kv_cache_usage=self.scheduler.kv_cache.usage,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            batch_size=self._last_batch[0],
            num_batched_tokens=self._last_batch[1],
        )

    def num_dropped_messages(self, request_id: str) -> int:
        """Conversation turns dropped to fit the context when ``request_id`` was added."""
        state = self._requests.get(request_id)
        return 0 if state is None else state.num_dropped_messages

    def abort_request(self, request_id: str, error: ErrorInfo | None = None) -> bool:
        """Free the request's KV blocks now; its final deltas come with the next step: ``cancelled``, or with
        ``error`` when one is given (the worker ending it, not the client)."""
        state = self._requests.get(request_id)
        if state is None:
            return False
        self._drop_in_flight = True  # the step in flight may hold its sequences
        status = RequestStatus.FINISHED_ABORTED if error is None else RequestStatus.FINISHED_ERROR
        self._pending.extend(self._end_request(state, status, error))
        return True

    def _end_request(self, state: RequestState, status: RequestStatus, error: ErrorInfo | None = None) -> list[TokenDelta]:
        """End every choice of a request that has not finished yet (held ones too) with ``status``; returns their
        finals."""
        held, state.held = state.held, []
        live = held + [seq for seq_id in state.seq_ids
                       if (seq := self.scheduler.abort_request(seq_id, status)) is not None]
        return [self._finish(seq, finish_reason(status), "", error) for seq in sorted(live, key=lambda s: s.data.index)]

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
        if self._in_flight is None:
            self.scheduler.set_background_limit(background_limit)
            plan = self.scheduler.schedule()
            if plan.is_empty:
                return outputs
        else:
            plan = self._in_flight[0]
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
        sampled, logprobs = computed
        for seq in self.scheduler.update_from_output(plan, sampled):
            if seq.seq_id in logprobs:
                seq.data.unreported_logprobs.append(logprobs[seq.seq_id])
            delta = self._on_token(seq)
            if delta is not None:
                outputs.append(delta)
        return outputs

    def _compute(self, plan: SchedulerOutput) -> tuple[dict[str, int], dict[str, TokenLogprob]] | None:
        """Run the model for ``plan`` (or the next layers of the step in flight) and sample; None while a
        batch-only step still has layers to run."""
        if self._in_flight is None:
            chunks = [SeqChunk(s.token_ids, s.start_pos, s.block_table, s.needs_sample) for s in plan.scheduled]
            fwd = self.runner.begin(chunks)
        else:
            fwd = self._in_flight[1]
        logits = self.runner.advance(fwd, self.config.background_layers_per_call if plan.is_background_only else None)
        if logits is None:
            self._in_flight = (plan, fwd)
            return None
        self._in_flight = None
        to_sample = [s.seq for s in plan.scheduled if s.needs_sample]
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprob] = {}
        if to_sample:
            choices = [seq.data for seq in to_sample]
            guided = [i for i, c in enumerate(choices) if c.matcher is not None]
            # The masks are computed while the device still runs the forward (its kernels are only queued).
            masks = None
            if guided:
                masks = (guided, fill_masks([choices[i].matcher for i in guided], logits.shape[1], logits.is_cuda))
            token_ids = sample(
                logits,
                [c.request.params for c in choices],
                [c.generator for c in choices],
                prompt_token_ids=[seq.prompt_token_ids for seq in to_sample],
                output_token_ids=[seq.output_token_ids for seq in to_sample],
                masks=masks,
            )
            token_ids = to_host_list(token_ids)  # the step's one wait for the device
            sampled = {seq.seq_id: tok for seq, tok in zip(to_sample, token_ids)}
            logprobs = self._logprobs(logits, to_sample, token_ids)  # the model's: before any mask or penalty
        return sampled, logprobs

    def _compute_each_alone(self, plan: SchedulerOutput, outputs: list[TokenDelta],
                            ) -> tuple[dict[str, int], dict[str, TokenLogprob]]:
        """A step failed: compute each of its sequences alone. A sequence that fails alone fails its request (and
        only it, with a 500); the others get their tokens as if the step had run. Rewriting a chunk's KV slots
        writes the values the failed step may have written already."""
        self.num_failed_steps += 1
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprob] = {}
        error = ErrorInfo("The worker had an error processing your request.", code="internal_error",
                          type="server_error", status=500)
        for entry in plan.scheduled:
            state = entry.seq.data.request
            if state.request_id not in self._requests:
                continue  # a sibling choice failed before it
            try:
                one = self._compute(SchedulerOutput(scheduled=[entry]))
            except Exception:
                log.exception("request %s fails on its own: failing it alone", state.request_id)
                outputs.extend(self._end_request(state, RequestStatus.FINISHED_ERROR, error))
                continue
            if one is not None:
                sampled.update(one[0])
                logprobs.update(one[1])
        return sampled, logprobs

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
        state = plan.scheduled[0].seq.data.request
        log.error("device out of memory with %s alone running: failing it", state.request_id)
        error = ErrorInfo("The request does not fit in the accelerator's memory.", code="out_of_memory",
                          type="server_error", status=503)
        return self._end_request(state, RequestStatus.FINISHED_ERROR, error)

    def _logprobs(self, logits: torch.Tensor, seqs: list[Sequence], token_ids: list[int]) -> dict[str, TokenLogprob]:
        """Log-probabilities of the sampled tokens (and the top alternatives) for the rows that asked for them."""
        rows = [i for i, seq in enumerate(seqs) if seq.data.request.params.logprobs]
        if not rows:
            return {}
        logp = torch.log_softmax(logits[rows].float(), dim=-1)
        chosen = logp.gather(1, torch.tensor([[token_ids[i]] for i in rows], device=logp.device)).view(-1).tolist()
        num_top = max(seqs[i].data.request.params.top_logprobs for i in rows)
        top_values, top_ids = (logp.topk(num_top, dim=-1) if num_top else (logp[:, :0], logp[:, :0].long()))
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        out = {}
        for j, i in enumerate(rows):
            k = seqs[i].data.request.params.top_logprobs
            top = [(self._token_text(t), v) for t, v in zip(top_ids[j][:k], top_values[j][:k])]
            out[seqs[i].seq_id] = TokenLogprob(self._token_text(token_ids[i]), chosen[j], top)
        return out

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            # As the text is decoded (special tokens left out), so that the tokens spell the content.
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=True)
        return text

    def _on_token(self, seq: Sequence) -> TokenDelta | None:
        choice: Choice = seq.data
        choice.num_unreported_tokens += 1
        if choice.request.held:  # choice 0's prompt is in the cache now: the other choices can share it
            for held in choice.request.held:
                self.scheduler.add_request(held)
            choice.request.held.clear()
        token_id = seq.last_token_id
        params = choice.request.params
        if token_id not in self._eos:
            choice.follow_grammar(token_id)
        if token_id in self._eos and not params.ignore_eos:
            if choice.unreported_logprobs:  # the EOS token ends the text; it is not part of it
                choice.unreported_logprobs.pop()
            self.scheduler.finish_request(seq.seq_id, RequestStatus.FINISHED_STOPPED)
            return self._finish(seq, "stop", choice.emittable(choice.detokenizer.flush()))
        text = choice.detokenizer.add_token(token_id)
        if choice.detokenizer.is_stopped:
            self.scheduler.finish_request(seq.seq_id, RequestStatus.FINISHED_STOPPED)
            return self._finish(seq, "stop", choice.emittable(text))
        if seq.is_finished:  # the scheduler ended it: max_tokens or the model's context
            return self._finish(seq, finish_reason(seq.status) or "length",
                                choice.emittable(text + choice.detokenizer.flush()))
        if choice.grammar_is_complete:  # nothing may follow
            self.scheduler.finish_request(seq.seq_id, RequestStatus.FINISHED_STOPPED)
            return self._finish(seq, "stop", choice.emittable(text + choice.detokenizer.flush()))
        text, calls, halted = choice.outgoing(choice.emittable(text))
        if halted:  # flagged by the output filter under a block policy: nothing more goes out, its seat freed now
            self.scheduler.finish_request(seq.seq_id, RequestStatus.FINISHED_FILTERED)
            return self._finish(seq, finish_reason(RequestStatus.FINISHED_FILTERED), "")
        if not text and not calls:
            return None  # held back (split character, possible stop string or tool tag): nothing worth a message
        return self._delta(seq, text, tool_calls=calls or None)

    def _delta(self, seq: Sequence, text: str, reason: str | None = None, usage: Usage | None = None,
               error: ErrorInfo | None = None, tool_calls: list | None = None) -> TokenDelta:
        choice: Choice = seq.data
        num_tokens = choice.num_unreported_tokens
        delta = TokenDelta(choice.request.request_id, text=text, num_tokens=num_tokens,
                           index=choice.index, finish_reason=reason, usage=usage,
                           logprobs=choice.unreported_logprobs or None, error=error, tool_calls=tool_calls,
                           token_ids=seq.token_ids[len(seq.token_ids) - num_tokens:] if num_tokens else None)
        choice.num_unreported_tokens = 0
        if choice.unreported_logprobs:
            choice.unreported_logprobs = []
        return delta

    def _finish(self, seq: Sequence, reason: str, text: str, error: ErrorInfo | None = None) -> TokenDelta:
        choice: Choice = seq.data
        text, calls, reason = choice.final(text, reason)
        state = choice.request
        state.num_finished += 1
        state.completion_tokens += seq.num_output_tokens
        state.cached_tokens = max(state.cached_tokens, seq.num_cached_tokens)
        if state.num_finished == len(state.seq_ids):
            self._requests.pop(state.request_id, None)
        # Usage so far on every choice's final: the last one carries the request's total.
        return self._delta(seq, text, reason, self._usage(state), error, tool_calls=calls or None)

    @staticmethod
    def _usage(state: RequestState) -> Usage:
        return Usage(prompt_tokens=state.num_prompt_tokens, completion_tokens=state.completion_tokens,
                     cached_tokens=state.cached_tokens)

    # -- metrics ------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.scheduler.kv_cache.num_blocks


def _default_kv_budget(device: torch.device, fraction: float) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    return 2 * 2**30
