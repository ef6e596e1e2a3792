"""A wire request as vLLM takes it: what each choice is added with, and what vLLM cannot honour (a 400).

    GenerateRequest ─▶ prompt: {"prompt_token_ids": ours (prompts.py: chat template, tools prompt, history fitted),
                                 "cache_salt": the tenant's prefix-cache scope (shared/kv_events.cache_salt, as ours)}
                    ─▶ sampling_kwargs(): vLLM's SamplingParams, one choice each (n fanned out here, as ours does),
                       token ids only (detokenize=False: text, stop strings, tool calls and the safety filter are
                       ours, workers/vllm_engine/outputs.py), deltas (RequestOutputKind.DELTA), the grammar as
                       vLLM's structured output (llguidance Lark, the text our engine compiles)

Stop strings are not given to vLLM: our detokenizer finds them across token boundaries and the engine aborts the
vLLM request in the step that found one. EOS ends a choice in vLLM (its ``finish_reason`` "stop" with that token
last), as the grammar's end does.
"""

from __future__ import annotations

from switchyard.shared.messages import ErrorInfo, GenerateRequest
from switchyard.workers.serving.prompts import RequestRejected


def check_supported(req: GenerateRequest) -> None:
    """Refuse, with the 400 a client reads, what vLLM cannot do for ``req`` (the README's parameter table lists
    these): a continuation that must go on from tokens vLLM would count as prompt, not output."""
    if req.resume is None:
        return
    if req.response_format is not None and req.response_format.type != "text":
        _refuse("response_format", "The vLLM engine cannot resume a structured output: its grammar would start again "
                "at the resumed tokens.")
    params = req.sampling
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(params, name) != 0:
            _refuse(name, f"The vLLM engine cannot resume a request with {name}: vLLM would not count the resumed "
                    "tokens as generated ones.")


def _refuse(param: str, message: str) -> None:
    raise RequestRejected(ErrorInfo(message, code="unsupported_parameter", param=param))


def sampling_kwargs(req: GenerateRequest, index: int, max_tokens: int) -> dict:
    """vLLM ``SamplingParams`` keyword arguments of choice ``index`` (``max_tokens`` new tokens) of ``req``."""
    p = req.sampling
    seed = None if p.seed is None else p.seed + index  # as ours: each choice its own seeded stream
    if seed is not None and req.resume is not None:
        # vLLM's generator cannot be moved past the tokens drawn elsewhere: the continuation is seeded from where
        # it starts, so the same continuation gives the same tokens (not those the first worker would have drawn).
        seed += len(req.resume.token_ids)
    kwargs = dict(
        n=1,
        max_tokens=max_tokens,
        temperature=p.temperature,
        top_p=p.top_p if 0 < p.top_p <= 1 else 1.0,  # as ours: 0 filters nothing
        top_k=max(p.top_k, 0),
        min_p=p.min_p,
        seed=seed,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        ignore_eos=p.ignore_eos,
        # The model's own log-probabilities (vLLM's default raw_logprobs: before penalties, temperature and masks).
        logprobs=p.top_logprobs if p.logprobs else None,
        logit_bias=dict(p.logit_bias) if p.logit_bias else None,
        detokenize=False,
        skip_special_tokens=True,
    )
    return {k: v for k, v in kwargs.items() if v is not None}


def prompt_input(req: GenerateRequest, token_ids: list[int], salt: str) -> dict:
    """vLLM's prompt for ``req``: our token ids, a continuation's generated tokens after them, and the cache
    scope."""
    ids = list(token_ids) + (list(req.resume.token_ids) if req.resume is not None else [])
    return {"prompt_token_ids": ids, "cache_salt": salt}
