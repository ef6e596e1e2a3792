"""vLLM behind the worker's engine interface (``ServingEngine``, workers/serving/interface.py).

    intake thread  prepare ─▶ our prompts.py on a tokenizer of its own (chat template, tools prompt, history,
                              context check), the grammar checked by compiling it as ours does ─▶ PreparedPrompt
    step thread    add_request ─▶ a ChoiceRun per choice (our Choice: detokenizer, filter, tool parser) and a vLLM
                                  request each: token ids, cache salt = tenant scope, priority = tier
                   step ─▶ LLMEngine.step() (vLLM V1; its engine core in this process, or in one of its own
                           with vllm.engine_core_process) ─▶ RequestOutputs (new token ids) ─▶ ChoiceRun.advance
                           (outputs.py) ─▶ TokenDelta, as ours sends them
                   abort_request ─▶ LLMEngine.abort_request: vLLM frees the KV blocks; our finals next step
                   capacity, stats ─▶ load.py (vLLM's stat logger + the choices held here)
                   take_kv_changes ─▶ kv_events.py: vLLM's KV events (its ZMQ publisher) in our hash chain, and
                                      the prefix segments of the chat requests added (prepare maps them)

A request with ``n > 1`` is n vLLM requests (seeds ``seed + i``, as ours); choices after the first join once the
first has produced a token, so they find the prompt's blocks in vLLM's prefix cache instead of computing them n
times. A continuation adds its generated tokens to the prompt: vLLM recomputes them like a preempted request's.

Disaggregated serving (kv_transfer.py): with a KV connector (a prefill or decode worker's), a prefill request
(``handover``) runs in vLLM to a second token and ends HANDOVER with vLLM's ``kv_transfer_params``; a continuation
carrying them (``resume.kv_transfer``) has vLLM pull the prompt's blocks from the prefill's instead of computing
them. An engine's roles (``capabilities``) are what its connector allows.

vLLM is imported here only when an engine is built, so the module is readable (and its interface checked) where
vLLM is not installed.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import NoReturn

from switchyard.shared.config import WorkerConfig
from switchyard.shared.kv_events import cache_salt
from switchyard.shared.messages import HANDOVER, ErrorInfo, GenerateRequest, TokenDelta, Usage
from switchyard.shared.tiers import TIER_NAMES, get_tier
from switchyard.workers.serving.choice import RequestState, check_continuable, make_choice
from switchyard.workers.serving.guided import Grammars
from switchyard.workers.serving.interface import EngineCapabilities, RequestRejected
from switchyard.workers.serving.kv_changes import KVChanges
from switchyard.workers.serving.output_filter import OutputSafety, SafetyEvent
from switchyard.workers.serving.prompts import PreparedPrompt, prepare_prompt
from switchyard.workers.serving.stats import EngineCapacity, EngineStats
from switchyard.workers.serving.token_texts import TokenTexts
from switchyard.workers.vllm_engine import args as vllm_args
from switchyard.workers.vllm_engine import kv_transfer
from switchyard.workers.vllm_engine.environment import require_kv_connector_package
from switchyard.workers.vllm_engine.kv_events import VllmKVEvents
from switchyard.workers.vllm_engine.load import StepStats, capacity_of, stat_logger_factory, stats_of
from switchyard.workers.vllm_engine.outputs import ERROR, ChoiceRun, Ending
from switchyard.workers.vllm_engine.requests import check_supported, prompt_input, sampling_kwargs

log = logging.getLogger("switchyard.engine")

MIN_KV_BLOCKS_TRACKED = 65_536
_INTERNAL = ErrorInfo("The worker had an error processing your request.", code="internal_error",
                      type="server_error", status=500)


class _CheckedGrammars:
    """Grammars checked by compiling them as our engine does (a bad schema is the same 400, found off the step
    thread), then handed on as their text: vLLM's guidance backend compiles its own."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self._grammars = Grammars(tokenizer, vocab_size)

    def matcher(self, grammar: str) -> str:
        self._grammars.matcher(grammar)
        return grammar


@dataclass(slots=True)
class _Request:
    """A request's choices in vLLM, what its usage counts, and what its later choices join vLLM with."""

    state: RequestState
    runs: list[ChoiceRun]
    tier: str
    priority: int  # vLLM's: lower runs first and is preempted last
    grammar: str | None


class VllmEngine:
    """See the module docstring. Built by ``from_settings`` (or around an ``LLMEngine`` by tests)."""

    def __init__(self, llm, tokenizer, max_num_seqs: int, stats: StepStats,
                 kv_events: tuple[str, str] | None = None, roles: tuple[str, ...] = ("both",),
                 kv_lease_s: float = kv_transfer.DEFAULT_LEASE_S) -> None:
        """``kv_events``: the ZMQ endpoint and topic ``llm`` publishes its KV events at (None: it publishes none, and
        this engine hands out none either); ``roles``: what ``llm``'s KV connector lets it serve as
        (``kv_transfer.connector_roles``); ``kv_lease_s``: how long a prefill's blocks wait to be read
        (``kv_transfer.lease_s``)."""
        from vllm.platforms import current_platform

        self._llm = llm
        self.tokenizer = tokenizer  # the step thread's (detokenizing); prepare() has a copy of its own
        self._max_num_seqs = max_num_seqs
        self._step_stats = stats
        kv_transfer.check_prefill_model(roles, bool(llm.vllm_config.model_config.is_hybrid),
                                        int(getattr(llm.vllm_config, "num_prefill_lookahead_tokens", 0)))
        self._roles = roles
        self._kv_lease_s = kv_lease_s
        self._warned_no_consumer = False
        model_config = llm.vllm_config.model_config
        self.max_context = int(model_config.max_model_len)
        self.vocab_size = int(model_config.get_vocab_size())
        self._device_type = "cpu" if current_platform.is_cpu() else "cuda"
        cache_config = llm.vllm_config.cache_config
        self._kv_block_size = int(cache_config.block_size)  # vLLM's, after its platform's say (128 on a CPU)
        self._kv_events: VllmKVEvents | None = None
        self.kv_events_dir: str | None = None  # the private directory of the ipc endpoint, removed at shutdown
        if kv_events is not None:
            # Blocks held per tier at most (events lost could leave some held forever): twice the pool, and room
            # for what vLLM's offloading keeps below it.
            max_blocks = max(2 * int(cache_config.num_gpu_blocks or 0), MIN_KV_BLOCKS_TRACKED)
            self._kv_events = VllmKVEvents(*kv_events, self._kv_block_size, max_blocks)
            if not self._kv_events.watch(llm):
                log.info("vLLM KV events: its engine core runs elsewhere; a step's events go out with a later one")
        self._requests: dict[str, _Request] = {}
        self._by_vllm_id: dict[str, tuple[_Request, ChoiceRun]] = {}
        self._pending: list[TokenDelta] = []  # finals of aborted requests, sent with the next step's output
        self.safety = OutputSafety()
        self._logprobs = TokenTexts(tokenizer)
        self._prepare_tokenizer = copy.deepcopy(tokenizer)
        self._prepare_lock = threading.Lock()
        self._grammars = _CheckedGrammars(self._prepare_tokenizer, self.vocab_size)
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        # What vLLM raises for a request it will not take: its validation errors, and its older ValueErrors.
        self._refusals = (VLLMClientError, ValueError)

        self._sampling_params = lambda kw, grammar: SamplingParams(
            **kw, output_kind=RequestOutputKind.DELTA,
            structured_outputs=None if grammar is None else StructuredOutputsParams(grammar=grammar))

    @classmethod
    def from_settings(cls, worker: WorkerConfig, model_path: str) -> VllmEngine:
        """vLLM's ``LLMEngine`` for ``model_path`` with ``worker``'s settings (workers/vllm_engine/args.py)."""
        os.environ.update(vllm_args.process_env(worker))  # the settings own these, whatever the environment said
        import torch
        from transformers import AutoTokenizer
        from vllm import EngineArgs, LLMEngine

        from switchyard.workers.executor.cpu_dtype import has_native_bf16

        on_gpu = torch.cuda.is_available()
        # vLLM's KV events on an ipc socket of a directory of this worker's own (kv_events.py says why).
        events_dir = tempfile.mkdtemp(prefix="switchyard-vllm-kv-")
        try:
            kwargs = vllm_args.engine_kwargs(worker, model_path, on_gpu, native_bf16=not on_gpu and has_native_bf16(),
                                             kv_events_endpoint=f"ipc://{events_dir}/events.sock")
            log.info("vLLM engine: %s", ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items())))
            require_kv_connector_package(kwargs)  # before the model loads, not minutes into its start
            t0 = time.monotonic()
            stats = StepStats()
            llm = LLMEngine.from_engine_args(EngineArgs(**kwargs), stat_loggers=[stat_logger_factory(stats)])
            log.info("vLLM engine ready in %.1f s", time.monotonic() - t0)
            tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
            engine = cls(llm, tokenizer, worker.max_num_seqs, stats, vllm_args.kv_events_subscription(kwargs),
                         kv_transfer.connector_roles(kwargs), kv_transfer.lease_s(kwargs))
        except BaseException:
            shutil.rmtree(events_dir, ignore_errors=True)
            raise
        engine.kv_events_dir = events_dir
        return engine

    # -- the interface ------------------------------------------------------------------------------------------
    @property
    def capabilities(self) -> EngineCapabilities:
        """Whole requests, and prefill or decode as its KV connector allows (kv_transfer.py); no KV exchange of
        ours (its offloading keeps blocks in its process, its connector moves them); every sequence it holds runs in
        each step."""
        return EngineCapabilities(roles=self._roles)

    @property
    def device_type(self) -> str:
        return self._device_type

    @property
    def kv_block_size(self) -> int:
        return self._kv_block_size

    def prepare(self, req: GenerateRequest) -> PreparedPrompt[str]:
        """As our engine's (prompts.prepare_prompt), and what vLLM cannot honour refused (requests.check_supported);
        the grammar comes back as its text. With KV events, a chat's message prefixes are mapped to vLLM's blocks."""
        check_supported(req)
        kv_transfer.check_request(req, self._roles)
        with self._prepare_lock:
            return prepare_prompt(self._prepare_tokenizer, req, self.max_context, self._grammars, self.vocab_size,
                                  self._kv_block_size if self._kv_events is not None else None)

    def add_request(self, req: GenerateRequest, prepared: PreparedPrompt[str] | None = None) -> int:
        if req.request_id in self._requests:
            raise ValueError(f"request {req.request_id!r} is already running")
        if prepared is None:
            prepared = self.prepare(req)
        check_continuable(req)
        prompt_ids, grammar = prepared.token_ids, prepared.matcher
        resumed = list(req.resume.token_ids) if req.resume is not None else []
        max_tokens = prepared.max_tokens - len(resumed)
        if max_tokens < 1:
            raise RequestRejected(ErrorInfo("The resumed tokens already reach max_tokens.", code="invalid_value",
                                            param="resume"))
        if req.handover:
            kv_transfer.check_request(req, self._roles)  # prepared elsewhere: checked here too
            max_tokens = kv_transfer.prefill_max_tokens(max_tokens)
        consumes_kv = "decode" in self._roles
        transfer = kv_transfer.request_params(req, max_tokens, consumes_kv, self._kv_lease_s, time.time())
        if req.resume is not None and req.resume.kv_transfer and transfer is None:
            if consumes_kv:  # taken up too late: the prefill's blocks may be freed before they are read
                log.info("request %s: its prefill's KV lease (%g s) has run out while it waited: computing its "
                         "prompt", req.request_id, self._kv_lease_s)
            else:
                self._warn_no_consumer()
        state = RequestState(req.request_id, req.sampling, len(prompt_ids), seq_ids=[], handover=req.handover)
        salt = cache_salt(req)
        runs = []
        for index in range(req.sampling.n):
            vllm_id = req.request_id if req.sampling.n == 1 else f"{req.request_id}#{index}"
            choice = make_choice(req, state, index, prompt_ids, self.tokenizer, self.safety)
            sampling = sampling_kwargs(req, index, max_tokens)
            if transfer is not None:  # one choice only (check_request; a continuation is of one)
                sampling["extra_args"] = {"kv_transfer_params": transfer}
            runs.append(ChoiceRun(choice, vllm_id, prompt_input(req, prompt_ids, salt), sampling,
                                  handover=req.handover and transfer is not None))
            state.seq_ids.append(vllm_id)
        if req.resume is not None and resumed:
            runs[0].choice.take_up(resumed, req.resume.text_len)
            runs[0].num_output_tokens = len(resumed)
        priority = get_tier(req.tier).priority if req.tier in TIER_NAMES else len(TIER_NAMES)
        entry = _Request(state, runs, req.tier, priority, grammar)
        self._add_to_vllm(entry, runs[0])  # the others once it has a token (see the module docstring)
        if self._kv_events is not None:
            self._kv_events.add_prefixes(prepared.prefix_segments)
        self._requests[req.request_id] = entry
        for run in runs:
            self._by_vllm_id[run.vllm_id] = (entry, run)
        return state.num_prompt_tokens

    def _warn_no_consumer(self) -> None:
        """A continuation names a vLLM prefill's blocks, and this engine has no connector to pull them: it computes
        the prompt (as after a failover, where the blocks may be gone), and says so once."""
        if not self._warned_no_consumer:
            self._warned_no_consumer = True
            log.warning("continuations handed over by vLLM prefill workers come here, and this vLLM worker has no KV "
                        "connector (role decode: vllm.kv_connector): it computes their prompts instead of loading them")

    def _add_to_vllm(self, entry: _Request, run: ChoiceRun) -> None:
        try:
            self._llm.add_request(run.vllm_id, run.prompt, self._sampling_params(run.sampling, entry.grammar),
                                  priority=entry.priority)
        except self._refusals as exc:  # vLLM's validation: the request's own fault, refused with vLLM's reason
            param = getattr(exc, "parameter", None)
            raise RequestRejected(ErrorInfo(f"vLLM cannot run this request: {exc}", code="invalid_request",
                                            param=param)) from exc
        run.is_added = True

    def abort_request(self, request_id: str, error: ErrorInfo | None = None) -> bool:
        entry = self._requests.get(request_id)
        if entry is None:
            return False
        reason = "cancelled" if error is None else "error"
        for run in entry.runs:
            if not self._is_ended(run):
                self._pending.append(self._finish(entry, run, Ending(reason, abort_vllm=run.is_added), error))
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    def step(self, background_limit: int | None = None) -> list[TokenDelta]:
        """One vLLM step; at most one delta per choice that made progress. ``background_limit`` is not applied:
        vLLM runs every sequence it holds in each step (batch work yields by the worker's pulls and vLLM's
        priorities: it is admitted last and preempted first)."""
        outputs, self._pending = self._pending, []
        if not self._requests:
            return outputs
        try:
            results = self._llm.step()
        except Exception:
            log.exception("a vLLM step failed: failing the %d requests it held", len(self._requests))
            for request_id in list(self._requests):
                self.abort_request(request_id, _INTERNAL)
            outputs, self._pending = outputs + self._pending, []
            return outputs
        for result in results:
            found = self._by_vllm_id.get(result.request_id)
            if found is None:
                continue  # a request ended here before vLLM heard of it
            entry, run = found
            out = result.outputs[0]
            run.num_cached_tokens = max(run.num_cached_tokens, result.num_cached_tokens or 0)
            reason = out.finish_reason if result.finished else None
            text, calls, ending = run.advance(list(out.token_ids), out.logprobs, reason, self._logprobs,
                                              result.kv_transfer_params if result.finished else None)
            if ending is None:
                if text or calls:
                    outputs.append(run.delta(entry.state.request_id, text, calls))
            else:
                outputs.append(self._finish(entry, run, ending, _INTERNAL if ending.reason == ERROR else None,
                                            text, calls))
            if run.choice.index == 0 and run.is_started:
                self._add_held(entry)
        return outputs

    def _add_held(self, entry: _Request) -> None:
        """Choices after the first join vLLM once the first has a token: its prompt's blocks are cached by then."""
        for run in entry.runs[1:]:
            if not run.is_added and not self._is_ended(run):
                try:
                    self._add_to_vllm(entry, run)
                except RequestRejected as exc:  # the first was accepted with the same parameters: not expected
                    self._pending.append(self._finish(entry, run, Ending("error"), exc.error))

    def capacity(self) -> EngineCapacity:
        runs = [run for _, run in self._by_vllm_id.values()]
        return capacity_of(self._step_stats, self._max_num_seqs, len(runs), sum(not r.is_started for r in runs))

    def stats(self) -> EngineStats:
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for entry, run in self._by_vllm_id.values():
            counts = running if run.is_started else waiting
            counts[entry.tier] = counts.get(entry.tier, 0) + 1
        return stats_of(self._step_stats, running, waiting, bool(self._by_vllm_id))

    def take_safety_events(self) -> list[SafetyEvent]:
        return self.safety.take_events()

    def take_kv_changes(self) -> KVChanges | None:
        """vLLM's KV events since the last call, in our hash chain (kv_events.py), and the prefix segments of the
        requests added; None when vLLM publishes none (prefix caching off)."""
        return self._kv_events.take() if self._kv_events is not None else None

    def kv_listing(self) -> dict[str, list[int]]:
        return self._kv_events.listing() if self._kv_events is not None else {}

    def set_pause_rules(self, after_tokens: dict[str, int]) -> NoReturn:
        """Never called (``capabilities``): vLLM's scheduler preempts by priority only, recomputing."""
        raise NotImplementedError("the vLLM engine does not pause requests")

    def connect_kv_peers(self, peers) -> NoReturn:
        """Never called (``capabilities``): vLLM's own offloading keeps its host tier in its process, no block
        files to fetch into or serve."""
        raise NotImplementedError("the vLLM engine exchanges no KV blocks")

    def shutdown(self) -> None:
        """Abort what vLLM still holds and stop its engine core (and a tensor-parallel group's processes), then the
        KV events' subscriber."""
        ids = [vllm_id for vllm_id, (_, run) in self._by_vllm_id.items() if run.is_added]
        if ids:
            self._llm.abort_request(ids)
        self._llm.engine_core.shutdown()
        if self._kv_events is not None:
            self._kv_events.close()
        if self.kv_events_dir is not None:
            shutil.rmtree(self.kv_events_dir, ignore_errors=True)

    # -- ending choices -----------------------------------------------------------------------------------------
    def _is_ended(self, run: ChoiceRun) -> bool:
        return run.vllm_id not in self._by_vllm_id

    def _finish(self, entry: _Request, run: ChoiceRun, ending: Ending, error: ErrorInfo | None = None,
                text: str = "", calls: list | None = None) -> TokenDelta:
        """The last delta of ``run``'s choice; the request's last (every choice ended) carries ``is_last``."""
        del self._by_vllm_id[run.vllm_id]
        if ending.abort_vllm and run.is_added:
            self._llm.abort_request([run.vllm_id])
        if ending.reason == HANDOVER:  # not the choice's end: the decode worker's filter and parser go on from here
            final_text, final_calls, reason = ending.text, None, HANDOVER
        else:
            final_text, final_calls, reason = run.choice.final(ending.text, ending.reason)
        state = entry.state
        state.num_finished += 1
        state.completion_tokens += run.num_output_tokens
        state.cached_tokens = min(max(state.cached_tokens, run.num_cached_tokens), state.num_prompt_tokens)
        usage = Usage(prompt_tokens=state.num_prompt_tokens, completion_tokens=state.completion_tokens,
                      cached_tokens=state.cached_tokens)
        delta = run.delta(state.request_id, text + final_text, (calls or []) + (final_calls or []), reason, usage,
                          error)
        delta.kv_transfer = kv_transfer.stamp(ending.kv_transfer, time.time())
        if state.num_finished == len(state.seq_ids):
            self._requests.pop(state.request_id, None)
            delta.is_last = True
        return delta
