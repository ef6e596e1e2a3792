"""The paged engine on the tiny random Llama, checked token for token against HF ``generate``: batched, with
prefix caching on and off, chunked prefill and forced preemption."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from itertools import count

import msgspec
import pytest
import torch

from switchyard.shared.messages import TokenDelta
from switchyard.workers.engine.engine import Engine, EngineConfig
from switchyard.workers.executor import measured_choice
from switchyard.workers.serving.prompts import RequestRejected, prepare_prompt


class RecordingEngine(Engine):
    """Remembers every sampled token id per request (and whether any was preempted), to compare with HF."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.token_ids: dict[str, list[int]] = defaultdict(list)
        self.num_preemptions = 0
        on_tokens = self._deltas.on_tokens

        def recording(seq, num_new=1):
            first = seq.num_tokens - num_new
            delta = on_tokens(seq, num_new)  # may drop the tokens after a stop among them
            self.token_ids[seq.data.request.request_id].extend(seq.token_ids[first:])
            self.num_preemptions = max(self.num_preemptions, seq.num_preemptions)
            return delta

        self._deltas.on_tokens = recording  # type: ignore[method-assign]


CONFIGS = {
    "default": EngineConfig(max_num_seqs=8),
    "no-prefix-cache": EngineConfig(max_num_seqs=8, enable_prefix_caching=False),
    "chunked-prefill": EngineConfig(max_num_seqs=4, max_num_batched_tokens=8, block_size=4),
    # A pool of 9 blocks of 16 tokens cannot hold the three requests at once: someone must be preempted.
    "preemption": EngineConfig(max_num_seqs=4, kv_cache_bytes=1, max_model_len=128),
}


@dataclass
class Result:
    deltas: list[TokenDelta] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)

    @property
    def final(self) -> TokenDelta:
        return self.deltas[-1]


def run(engine: Engine, results: dict[str, Result] | None = None, max_steps: int = 1000,
        ) -> dict[str, Result]:
    """Step until every request finishes (or ``max_steps``), collecting deltas into ``results``."""
    results = defaultdict(Result, results or {})
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        collect(results, engine.step())
    assert not engine.has_unfinished_requests()
    for res in results.values():
        assert [d.finish_reason is not None for d in res.deltas].count(True) == 1
        assert res.final.finish_reason is not None and res.final.usage is not None
        assert sum(d.num_tokens for d in res.deltas) == res.final.usage.completion_tokens
    return dict(results)


def collect(results: dict[str, Result], step: list[TokenDelta]) -> None:
    assert len({d.request_id for d in step}) == len(step), "at most one delta per request per step"
    for delta in step:
        results[delta.request_id].deltas.append(delta)


PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "In the beginning the universe was created. This has made a lot of people very angry and been widely "
    "regarded as a bad move.",
]


def hf_greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    input_ids = torch.tensor([tokenizer.encode(prompt)])
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=2, pad_token_id=2)
    return out[0, input_ids.shape[1]:].tolist()


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_greedy_matches_hf_generate_with_concurrent_requests(tiny, make_request, config):
    model, tokenizer = tiny
    engine = RecordingEngine(model, tokenizer, config)
    max_new = [30, 20, 25]
    reqs = [make_request(prompt=p, temperature=0.0, max_tokens=n) for p, n in zip(PROMPTS, max_new)]
    engine.add_request(reqs[0])
    results: dict[str, Result] = defaultdict(Result)
    collect(results, engine.step())
    collect(results, engine.step())
    for req in reqs[1:]:  # the others join mid-flight: one request decodes while two prefill
        engine.add_request(req)
    results = run(engine, results)

    for req, prompt, n in zip(reqs, PROMPTS, max_new):
        expected = hf_greedy(model, tokenizer, prompt, n)
        assert len(expected) >= 5, "the tiny model should not end every prompt at once"
        assert engine.token_ids[req.request_id] == expected
        res = results[req.request_id]
        assert res.final.usage.completion_tokens == len(expected)
        assert res.final.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert res.final.finish_reason == ("stop" if expected[-1] == 2 else "length")
    if config is CONFIGS["preemption"]:
        assert engine.num_preemptions > 0
    assert engine.num_free_blocks == engine.num_blocks, "every block is free once all requests ended"


def test_steps_whose_thread_count_the_tuner_changes_give_the_same_tokens(tiny, make_request, monkeypatch):
    monkeypatch.setattr(measured_choice, "EXPLORE_EVERY_S", 0.0)  # every step a try: the count changes all along
    monkeypatch.setattr(measured_choice, "MAX_EXPLORE_EVERY_S", 0.0)
    model, tokenizer = tiny
    threads = torch.get_num_threads()
    try:
        engine = RecordingEngine(model, tokenizer, EngineConfig(max_num_seqs=8, tune_threads=True))
        used: list[int] = []
        monkeypatch.setattr(engine._threads, "_set_threads", lambda n: (used.append(n), torch.set_num_threads(n)))
        reqs = [make_request(prompt=p, temperature=0.0, max_tokens=20) for p in PROMPTS]
        for req in reqs:
            engine.add_request(req)
        run(engine)
    finally:
        torch.set_num_threads(threads)
    for req, prompt in zip(reqs, PROMPTS):
        assert engine.token_ids[req.request_id] == hf_greedy(model, tokenizer, prompt, 20)
    assert len(set(used)) >= 2 if threads > 1 else used == []  # on one core there is nothing to choose


def test_chat_request_uses_chat_template(tiny, make_request):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer)
    messages = [("system", "Be brief."), ("user", "Hello there")]
    num_prompt = engine.add_request(make_request(messages=messages, temperature=0, max_tokens=3))
    expected = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
    assert num_prompt == len(expected)
    assert run(engine)  # and it runs


def test_stop_string_spanning_tokens_is_not_emitted(tiny, make_request):
    model, tokenizer = tiny
    engine = RecordingEngine(model, tokenizer)
    ref = make_request(prompt=PROMPTS[1], temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request(ref)
    full_text = run(engine)[ref.request_id].text
    ids = engine.token_ids[ref.request_id]

    # A stop string made of the last character of one token and the first of the next: the first such pair whose
    # two characters appear nowhere earlier (which pair depends on the random model's output, not on luck).
    pieces = [tokenizer.decode([i], skip_special_tokens=True) for i in ids]

    def candidates():
        for k in range(len(pieces) - 1):
            if "\ufffd" in "".join(pieces[:k + 2]):
                return  # a character split across tokens: the text before it is not a plain concatenation
            if pieces[k] and pieces[k + 1]:
                stop = pieces[k][-1] + pieces[k + 1][0]
                text_before = "".join(pieces[:k]) + pieces[k][:-1]
                if stop not in text_before:
                    yield k, stop, text_before

    k, stop, text_before = next(candidates(), (None, None, None))
    assert k is not None, pieces
    assert full_text.startswith(text_before + stop)

    engine = Engine(model, tokenizer)
    req = make_request(prompt=PROMPTS[1], temperature=0, max_tokens=40, ignore_eos=True, stop=["zzz", stop])
    engine.add_request(req)
    res = run(engine)[req.request_id]
    assert res.text == text_before
    assert res.final.finish_reason == "stop"
    assert res.final.usage.completion_tokens == k + 2  # generation ends with the token that completes the stop


def test_max_tokens_finishes_with_length(tiny, make_request):
    engine = Engine(*tiny)
    req = make_request(prompt="Count: one two", temperature=0.8, seed=3, max_tokens=17, ignore_eos=True)
    engine.add_request(req)
    res = run(engine)[req.request_id]
    assert res.final.finish_reason == "length"
    assert res.final.usage.completion_tokens == 17
    assert res.final.usage.prompt_tokens == len(tiny[1].encode("Count: one two"))


def test_max_tokens_none_runs_to_the_end_of_the_context(tiny, make_request):
    engine = Engine(*tiny)
    prompt = "abcdefghij" * 24  # letters merge in pairs: ~120 tokens of the 256 context
    req = make_request(prompt=prompt, temperature=0, max_tokens=None, ignore_eos=True)
    num_prompt = engine.add_request(req)
    res = run(engine)[req.request_id]
    assert res.final.finish_reason == "length"
    assert num_prompt + res.final.usage.completion_tokens == engine.max_context == 256


@pytest.mark.parametrize("max_tokens", [100, None])
def test_context_length_exceeded_is_rejected_before_compute(tiny, make_request, max_tokens):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer)
    forwards = []
    begin = engine.runner.begin
    engine.runner.begin = lambda chunks: forwards.append(chunks) or begin(chunks)
    prompt = "x " * (200 if max_tokens else 300)
    with pytest.raises(RequestRejected) as exc:
        engine.add_request(make_request(prompt=prompt, max_tokens=max_tokens))
    with pytest.raises(RequestRejected) as chat_exc:
        engine.add_request(make_request(messages=[("user", prompt)], max_tokens=max_tokens))
    assert not forwards and not engine.has_unfinished_requests()
    err = exc.value.error
    assert (err.code, err.param, err.status, err.type) == (
        "context_length_exceeded", "prompt", 400, "invalid_request_error")
    assert "maximum context length is 256 tokens" in err.message
    n = len(tokenizer.encode(prompt))
    if max_tokens:
        assert f"you requested {n + max_tokens} tokens ({n} in the prompt, 100 in the completion)" in err.message
    else:
        assert f"your prompt resulted in {n} tokens" in err.message
    assert chat_exc.value.error.param == "messages"


def test_a_prompt_prepared_off_the_step_thread_runs_as_if_tokenized_by_the_engine(tiny, make_request):
    """The worker tokenizes on its intake thread with a tokenizer of its own; the engine must then not touch its
    tokenizer for the prompt, and the output must be what tokenizing in the engine gives."""
    import copy

    model, tokenizer = tiny
    kw = dict(messages=[("system", "be brief"), ("user", PROMPTS[1])], temperature=0, max_tokens=8, ignore_eos=True)
    inline = Engine(model, tokenizer)
    inline.add_request(make_request(request_id="a", **kw))
    expected = run(inline)["a"].text

    class NoPromptTokenizing:  # detokenizing is still the engine's
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            if name in ("encode", "apply_chat_template", "__call__"):
                raise AssertionError(f"the engine called tokenizer.{name} for a prepared prompt")
            return getattr(self._inner, name)

    engine = Engine(model, NoPromptTokenizing(tokenizer))
    req = make_request(request_id="a", **kw)
    prepared = prepare_prompt(copy.deepcopy(tokenizer), req, engine.max_context)
    assert engine.add_request(req, prepared) == len(prepared.token_ids)
    assert run(engine)["a"].text == expected


def test_a_chat_template_that_refuses_the_messages_is_a_400(tiny, make_request):
    """A template's own check (``raise_exception``, as in "roles must alternate") is the client's mistake."""
    import copy

    _, tokenizer = tiny
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = ("{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('Conversation must start "
                            "with a user message') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(RequestRejected) as exc:
        prepare_prompt(strict, make_request(messages=[("assistant", "hi"), ("user", "x")]), 256)
    err = exc.value.error
    assert (err.status, err.param, err.type) == (400, "messages", "invalid_request_error")
    assert "must start with a user message" in err.message
    assert prepare_prompt(strict, make_request(messages=[("user", "x")]), 256).token_ids


def test_cached_blocks_are_shared_within_a_tenant_or_an_opted_in_scope_only(tiny, make_request):
    import msgspec as ms

    engine = Engine(*tiny)
    prompt = PROMPTS[2] * 2  # several full blocks

    def cached(tenant: str, shared: bool = False) -> int:
        req = ms.structs.replace(make_request(prompt=prompt, temperature=0, max_tokens=1), tenant_id=tenant,
                                 shared_prefix_cache=shared)
        engine.add_request(req)
        return run(engine)[req.request_id].final.usage.cached_tokens

    assert cached("a") == 0
    assert cached("a") >= 32
    assert cached("b") == 0, "another tenant's identical prompt is not a hit"
    assert cached("c", shared=True) == 0 and cached("d", shared=True) >= 32  # the opt-in scope is shared
    assert cached("e") == 0


def test_an_empty_prompt_is_refused_before_compute(tiny, make_request):
    engine = Engine(*tiny)
    with pytest.raises(RequestRejected) as exc:
        engine.add_request(make_request(prompt=""))
    assert (exc.value.error.status, exc.value.error.param) == (400, "prompt")
    assert not engine.has_unfinished_requests()


def test_n_choices_share_the_prompt_and_sample_independently(tiny, make_request):
    engine = Engine(*tiny)
    req = make_request(prompt=PROMPTS[2], n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    num_prompt = engine.add_request(req)
    deltas = [d for _ in range(100) if engine.has_unfinished_requests() for d in engine.step()]
    texts = ["".join(d.text for d in deltas if d.index == i) for i in range(3)]
    finals = [d for d in deltas if d.finish_reason]
    assert sorted(d.index for d in finals) == [0, 1, 2]
    assert len(set(texts)) == 3, "each choice samples with its own generator"
    assert finals[-1].usage.completion_tokens == 36 and finals[-1].usage.prompt_tokens == num_prompt
    # The choices after the first found the prompt's full blocks in the prefix cache.
    assert finals[-1].usage.cached_tokens >= (num_prompt - 1) // 16 * 16 > 0
    assert engine.num_free_blocks == engine.num_blocks


def test_n_out_of_range_is_rejected(tiny, make_request):
    engine = Engine(*tiny)
    with pytest.raises(RequestRejected) as exc:
        engine.add_request(make_request(prompt="hi", n=17))
    assert exc.value.error.param == "n" and exc.value.error.status == 400
    assert not engine.has_unfinished_requests()


def test_abort_finishes_with_cancelled(tiny, make_request):
    engine = Engine(*tiny, EngineConfig(max_num_seqs=2))
    keep = make_request(prompt="keep going", temperature=0, max_tokens=6, ignore_eos=True)
    doomed = make_request(prompt="abort me", temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request(keep)
    engine.add_request(doomed)
    assert engine.num_free_slots == 0
    results: dict[str, Result] = defaultdict(Result)
    collect(results, engine.step())
    collect(results, engine.step())
    blocks_before = engine.num_free_blocks
    assert engine.abort_request(doomed.request_id)
    assert not engine.abort_request("no-such-request")
    step = engine.step()
    collect(results, step)
    cancelled = next(d for d in step if d.request_id == doomed.request_id)
    assert cancelled.finish_reason == "cancelled" and cancelled.text == ""
    assert cancelled.usage.completion_tokens == 2
    assert cancelled.usage.prompt_tokens == len(tiny[1].encode("abort me"))
    assert engine.num_free_slots == 1
    assert engine.num_free_blocks > blocks_before, "the cancelled request's blocks are free at once"
    res = run(engine, results)
    assert res[keep.request_id].final.finish_reason == "length"
    assert res[keep.request_id].final.usage.completion_tokens == 6


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny, make_request):
    def sample_alone():
        engine = RecordingEngine(*tiny)
        req = make_request(prompt=PROMPTS[1], request_id="seeded", temperature=1.0, top_p=0.9, seed=1234,
                           max_tokens=24, ignore_eos=True)
        engine.add_request(req)
        return run(engine)["seeded"].text, engine.token_ids["seeded"]

    alone_text, alone_ids = sample_alone()
    assert sample_alone() == (alone_text, alone_ids)

    engine = RecordingEngine(*tiny)
    engine.add_request(make_request(prompt="a companion", temperature=1.0, max_tokens=30, ignore_eos=True))
    engine.add_request(make_request(prompt="another", temperature=0.7, seed=99, max_tokens=5, ignore_eos=True))
    results: dict[str, Result] = defaultdict(Result)
    collect(results, engine.step())
    engine.add_request(make_request(prompt=PROMPTS[1], request_id="seeded", temperature=1.0, top_p=0.9, seed=1234,
                                    max_tokens=24, ignore_eos=True))
    engine.add_request(make_request(prompt=PROMPTS[2], temperature=0, max_tokens=3))
    res = run(engine, results)
    assert engine.token_ids["seeded"] == alone_ids
    assert res["seeded"].text == alone_text

    other_seed = RecordingEngine(*tiny)
    other_seed.add_request(make_request(prompt=PROMPTS[1], request_id="seeded", temperature=1.0, top_p=0.9,
                                        seed=4321, max_tokens=24, ignore_eos=True))
    run(other_seed)
    assert other_seed.token_ids["seeded"] != alone_ids


def test_eos_finishes_with_stop_unless_ignored(tiny, make_request):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer)
    advance = engine.runner.advance

    def force_eos(fwd, num_layers=None):
        logits = advance(fwd, num_layers)
        if logits is not None:
            logits = logits.clone()
            logits[..., 2] = 1e4  # the model now always prefers EOS
        return logits

    engine.runner.advance = force_eos
    engine.add_request(make_request(prompt="hello", temperature=0, max_tokens=20, request_id="eos"))
    engine.add_request(make_request(prompt="hello", temperature=0, max_tokens=20, request_id="ignore",
                                    ignore_eos=True))
    res = run(engine)
    assert res["eos"].final.finish_reason == "stop"
    assert res["eos"].final.usage.completion_tokens == 1  # EOS counts as a completion token, as in vLLM
    assert res["eos"].text == ""
    assert res["ignore"].final.finish_reason == "length"
    assert res["ignore"].final.usage.completion_tokens == 20
    assert "<|im_end|>" not in res["ignore"].text  # special tokens are skipped in the text



def test_a_batch_only_step_runs_a_layer_per_call_and_an_interactive_arrival_drops_it(tiny, make_request):
    model, tokenizer = tiny
    batch = [msgspec.structs.replace(make_request(prompt=p, temperature=0, max_tokens=12, ignore_eos=True),
                                     tier="batch") for p in PROMPTS[:2]]
    reference = RecordingEngine(model, tokenizer)
    for req in batch:
        reference.add_request(req)
    expected = run(reference)

    engine = RecordingEngine(model, tokenizer)
    num_layers = len(engine.runner.layers)
    for req in batch:
        engine.add_request(req)
    for _ in range(num_layers - 1):  # a batch-only step: one layer per call, no token until the last
        assert engine.step() == [] and engine.has_unfinished_requests()
    engine.step()
    assert {r: len(ids) for r, ids in engine.token_ids.items()} == {r.request_id: 1 for r in batch}

    results: dict[str, Result] = defaultdict(Result)
    for i in range(400):
        if not engine.has_unfinished_requests():
            break
        if i % 3 == 1:  # mid-step: an interactive request arrives (and is cancelled): the step is dropped
            pro = make_request(prompt=PROMPTS[2], temperature=0, max_tokens=4, request_id=f"pro-{i}")
            engine.add_request(pro)
            engine.abort_request(pro.request_id)
        collect(results, [d for d in engine.step() if not d.request_id.startswith("pro-")])
    assert not engine.has_unfinished_requests() and engine.num_interrupted_steps > 5
    assert not any(r.startswith("pro-") for r in engine.token_ids)  # cancelled before they ran
    assert {r: engine.token_ids[r] for r in expected} == {r: reference.token_ids[r] for r in expected}
    assert engine.num_free_blocks == engine.num_blocks

    interrupted = engine.num_interrupted_steps
    engine.add_request(batch[0])
    pro = make_request(prompt=PROMPTS[0], temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request(pro)
    calls = 0
    while pro.request_id not in results or results[pro.request_id].final.finish_reason is None:
        collect(results, engine.step())  # a step with interactive work runs all its layers in one call
        calls += 1
    assert calls == 3 and engine.num_interrupted_steps == interrupted


@torch.no_grad()
def hf_logprobs_along(model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """HF's log-softmax at each generated position: ``[len(output_ids), vocab]``."""
    ids = torch.tensor([prompt_ids + output_ids])
    logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1)


def test_logprobs_are_the_models_and_come_with_their_tokens(tiny, make_request):
    model, tokenizer = tiny
    engine = RecordingEngine(model, tokenizer, EngineConfig(max_num_seqs=4))
    greedy = make_request(prompt=PROMPTS[1], max_tokens=10, temperature=0, ignore_eos=True, logprobs=True,
                          top_logprobs=3)
    # Sampled with penalties: the reported logprobs stay the model's own (vLLM's default), not the filtered ones.
    sampled = make_request(prompt=PROMPTS[2], max_tokens=10, temperature=1.3, seed=5, ignore_eos=True,
                           logprobs=True, top_logprobs=0, presence_penalty=1.5)
    plain = make_request(prompt=PROMPTS[0], max_tokens=4, ignore_eos=True)
    for req in (greedy, sampled, plain):
        engine.add_request(req)
    results = run(engine)

    assert all(d.logprobs is None for d in results[plain.request_id].deltas)
    for req, num_top in ((greedy, 3), (sampled, 0)):
        res = results[req.request_id]
        entries = [e for d in res.deltas for e in (d.logprobs or [])]
        # One entry per generated token, delivered with the delta that counts that token.
        assert [len(d.logprobs or []) for d in res.deltas] == [d.num_tokens for d in res.deltas]
        output_ids = engine.token_ids[req.request_id]
        assert [e.token for e in entries] == [tokenizer.decode([t], skip_special_tokens=True) for t in output_ids]
        expected = hf_logprobs_along(model, tokenizer.encode(req.prompt), output_ids)
        got = torch.tensor([e.logprob for e in entries])
        torch.testing.assert_close(got, expected.gather(1, torch.tensor(output_ids)[:, None])[:, 0],
                                   atol=1e-4, rtol=1e-4)
        for e, row in zip(entries, expected):
            assert len(e.top) == num_top
            top_values, top_ids = row.topk(num_top)
            assert [t for t, _ in e.top] == [tokenizer.decode([t], skip_special_tokens=True) for t in top_ids.tolist()]
            torch.testing.assert_close(torch.tensor([v for _, v in e.top]), top_values, atol=1e-4, rtol=1e-4)
    # Greedy: the chosen token is the most likely one.
    assert all(e.logprob == e.top[0][1] for d in results[greedy.request_id].deltas for e in d.logprobs or [])


def test_logprobs_leave_out_the_eos_token(tiny, make_request, monkeypatch):
    import switchyard.workers.engine.next_tokens as next_tokens_module

    model, tokenizer = tiny
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=2))
    req = make_request(prompt=PROMPTS[0], max_tokens=40, temperature=0, logprobs=True)
    engine.add_request(req)
    real_draw, calls = next_tokens_module.draw, count()

    def draw_eos_third(logits, *args, **kwargs):  # EOS at the third token, whatever the random weights say
        tokens = real_draw(logits, *args, **kwargs)
        return torch.full_like(tokens, 2) if next(calls) == 2 else tokens

    monkeypatch.setattr(next_tokens_module, "draw", draw_eos_third)
    res = run(engine)[req.request_id]
    assert res.final.finish_reason == "stop" and res.final.usage.completion_tokens == 3
    assert sum(len(d.logprobs or []) for d in res.deltas) == 2  # the two content tokens, not EOS


class OutOfMemoryRunner:
    """Wraps the engine's runner: a step raises the device's out-of-memory error when ``too_big(chunks)``."""

    def __init__(self, runner, too_big) -> None:
        self._runner = runner
        self._too_big = too_big
        self.num_raised = 0

    def begin(self, chunks):
        if self._too_big(chunks):
            self.num_raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return self._runner.begin(chunks)

    def __getattr__(self, name):
        return getattr(self._runner, name)


def test_out_of_memory_in_a_step_preempts_and_retries_without_losing_anyone(tiny, make_request):
    model, tokenizer = tiny
    reqs = [make_request(prompt=p, temperature=0.0, max_tokens=12) for p in PROMPTS]
    expected = {}
    reference = RecordingEngine(model, tokenizer, EngineConfig(max_num_seqs=8))
    for req in reqs:
        reference.add_request(req)
    run(reference)

    engine = RecordingEngine(model, tokenizer, EngineConfig(max_num_seqs=8))
    # the "device" holds two sequences' steps at most
    engine.runner = OutOfMemoryRunner(engine.runner, lambda chunks: len(chunks) > 2)
    for req in reqs:
        engine.add_request(req)
    results = run(engine)

    assert engine.runner.num_raised >= 1 and engine.num_out_of_memory_steps == engine.runner.num_raised
    for req in reqs:
        expected[req.request_id] = reference.token_ids[req.request_id]
        assert results[req.request_id].final.finish_reason == "length"
        assert results[req.request_id].final.error is None
        assert engine.token_ids[req.request_id][-12:] == expected[req.request_id]


def test_a_request_too_big_for_the_device_fails_alone(tiny, make_request):
    model, tokenizer = tiny
    big = make_request(prompt=PROMPTS[2], temperature=0.0, max_tokens=8)
    small = make_request(prompt=PROMPTS[0], temperature=0.0, max_tokens=8)
    engine = RecordingEngine(model, tokenizer, EngineConfig(max_num_seqs=8))
    engine.runner = OutOfMemoryRunner(engine.runner, lambda chunks: any(len(c.token_ids) > 20 for c in chunks))
    engine.add_request(big)
    engine.add_request(small)
    results = run(engine)

    failed = results[big.request_id].final
    assert failed.finish_reason == "error"
    assert failed.error is not None and failed.error.code == "out_of_memory" and failed.error.status == 503
    ok = results[small.request_id].final
    assert ok.finish_reason == "length" and ok.error is None
    assert ok.usage.completion_tokens == 8


def test_an_int8_engine_serves_requests_to_their_end(tiny, make_request):
    from switchyard.workers.executor.linear import load_gemm_kernel

    if load_gemm_kernel() is None:
        pytest.skip("the C kernels cannot be built here")
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=4, quantization="int8"))
    assert engine.runner.linear_kernel == "packed_gemm int8"
    reqs = [make_request(prompt=p, temperature=0, max_tokens=12, ignore_eos=True) for p in PROMPTS]
    for req in reqs:
        engine.add_request(req)
    results = run(engine)
    assert [results[r.request_id].final.usage.completion_tokens for r in reqs] == [12, 12, 12]
