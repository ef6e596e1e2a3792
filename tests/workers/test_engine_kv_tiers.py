"""Our engine over KV tiers: a prefix evicted from the pool, or computed by another worker (or before a restart),
is loaded back instead of computed, counted in ``cached_tokens``, and gives exactly the tokens a recompute gives;
whatever goes wrong below the pool (corrupt or truncated files, a tier whose filesystem refuses writes) ends as a
recompute, never a wrong token or an error; and no tenant loads another's blocks."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from switchyard.shared.messages import Resume
from switchyard.workers.engine.config import EngineConfig
from tests.workers.test_engine import PROMPTS, RecordingEngine, run
from tests.workers.test_engine_resume import _run_continuation

# Three prompts of several full blocks each; a pool of 9 blocks holds about one of them with its reply, so asking
# all three evicts the first from the pool.
A, B, C = PROMPTS[2], PROMPTS[2][::-1], PROMPTS[1] * 3


def _config(tmp_path: Path, **tiers) -> EngineConfig:
    tiers = {"kv_offload_gib": 0.01, "kv_offload_host_dir": tmp_path / "host", **tiers}
    return EngineConfig(max_num_seqs=2, kv_cache_bytes=1, max_model_len=128, **tiers)


def _ask(engine, make_request, prompt: str, tenant: str = "a") -> tuple[list[int], int]:
    """The greedy tokens and the cached tokens of one request run alone; the tiers settled after it."""
    request = msgspec.structs.replace(make_request(prompt=prompt, temperature=0, max_tokens=8, ignore_eos=True),
                                      tenant_id=tenant)
    engine.add_request(request)
    usage = run(engine)[request.request_id].final.usage
    if engine.tiers is not None:
        assert engine.tiers.tiers.flush()
    return engine.token_ids[request.request_id], usage.cached_tokens


@pytest.fixture
def expected(tiny, make_request) -> dict[str, list[int]]:
    """Each prompt's tokens from an engine without tiers."""
    engine = RecordingEngine(*tiny, EngineConfig(max_num_seqs=2, kv_cache_bytes=1, max_model_len=128))
    assert engine.tiers is None
    return {p: _ask(engine, make_request, p)[0] for p in (A, B, C)}


def _tier(engine, name: str):
    (stats,) = [s for s in engine.stats().kv_tiers if s.tier == name]
    return stats


def test_a_prefix_evicted_from_the_pool_is_loaded_from_the_host_tier(tiny, make_request, expected, tmp_path):
    engine = RecordingEngine(*tiny, _config(tmp_path))
    for prompt in (A, B, C):
        tokens, cached = _ask(engine, make_request, prompt)
        assert (tokens, cached) == (expected[prompt], 0)
    chain = engine.scheduler.kv_cache.chain(_seq_of(engine, A))
    assert engine.scheduler.kv_cache.num_cached_prefix_blocks(chain) < len(chain), "A's prefix left the pool"

    tokens, cached = _ask(engine, make_request, A)
    assert tokens == expected[A]
    assert cached == len(chain) * 16, "the whole prefix came back from the host tier"
    assert engine.tiers.num_loaded_blocks > 0
    assert _tier(engine, "host").hits > 0 and _tier(engine, "host").stores >= 3 * len(chain) - 2
    engine.shutdown()


def test_another_worker_or_a_restart_loads_what_was_computed_and_no_other_tenant_does(tiny, make_request, expected,
                                                                                      tmp_path):
    first = RecordingEngine(*tiny, _config(tmp_path))
    _ask(first, make_request, A)
    first.shutdown()

    second = RecordingEngine(*tiny, _config(tmp_path))  # same host tier directory: the next worker, or a restart
    tokens, cached = _ask(second, make_request, A, tenant="b")
    assert (tokens, cached) == (expected[A], 0), "another tenant's identical prompt loads nothing"
    tokens, cached = _ask(second, make_request, A, tenant="a")
    assert tokens == expected[A] and cached >= 64
    second.shutdown()


def test_blocks_the_host_tier_evicts_are_found_on_the_disk_tier(tiny, make_request, expected, tmp_path):
    # A host tier of about two blocks: nearly everything written through it is demoted to the disk.
    config = _config(tmp_path, kv_offload_gib=20_000 / 2**30, kv_offload_dir=tmp_path / "disk")
    first = RecordingEngine(*tiny, config)
    for prompt in (A, B, C):
        _ask(first, make_request, prompt)
    assert _tier(first, "host").evictions > 0 and _tier(first, "disk").stores > 0
    first.shutdown()

    second = RecordingEngine(*tiny, config)
    tokens, cached = _ask(second, make_request, A)
    assert tokens == expected[A] and cached >= 64
    assert _tier(second, "disk").hits > 0
    second.shutdown()


def test_a_continuation_on_another_worker_loads_the_dead_workers_blocks_and_goes_on_exactly(tiny, make_request,
                                                                                            tmp_path):
    """A failover's continuation (``resume``: the prompt and the tokens the first worker streamed) is a prefix the
    first worker wrote through: the next worker loads it, prompt and streamed tokens alike, and its usage counts
    as cached the prompt's tokens only (the streamed ones are completion tokens, OpenAI's ``cached_tokens`` a
    part of ``prompt_tokens``)."""
    request = make_request(prompt=A, request_id="r", temperature=0, max_tokens=40, ignore_eos=True)
    first = RecordingEngine(*tiny, _config(tmp_path))
    first.add_request(request)
    full = run(first)["r"]
    assert first.tiers.tiers.flush()
    first.shutdown()  # as good as dead: what it wrote through is all that is left of it
    sent = full.deltas[:30]
    sent_ids = [t for d in sent for t in d.token_ids or ()]
    num_prompt = full.final.usage.prompt_tokens
    assert (num_prompt + len(sent_ids) - 1) // 16 * 16 > num_prompt, "the chain runs past the prompt"

    second = RecordingEngine(*tiny, _config(tmp_path))
    second.add_request(msgspec.structs.replace(request, resume=Resume(sent_ids, len("".join(d.text for d in sent)))))
    rest = _run_continuation(second)
    assert "".join(d.text for d in sent) + rest.text == full.text
    assert sent_ids + second.token_ids["r"] == first.token_ids["r"]
    assert second.tiers.num_loaded_blocks == (num_prompt + len(sent_ids) - 1) // 16
    assert rest.final.usage.cached_tokens == num_prompt
    assert (rest.final.usage.prompt_tokens, rest.final.usage.completion_tokens) == (num_prompt, 40)
    second.shutdown()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_block_is_recomputed_never_served(tiny, make_request, expected, tmp_path, damage):
    first = RecordingEngine(*tiny, _config(tmp_path))
    _ask(first, make_request, A)
    first.shutdown()
    files = sorted((tmp_path / "host").rglob("*.kv"))
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[-100] ^= 0x01  # one bit of K or V: the values would be wrong, and plausible
        else:
            del data[len(data) // 2:]
        path.write_bytes(bytes(data))

    second = RecordingEngine(*tiny, _config(tmp_path))
    tokens, cached = _ask(second, make_request, A)
    assert tokens == expected[A], "the recomputed prefix gives the same tokens"
    assert cached == 0
    assert _tier(second, "host").corrupt >= 1
    # The damaged files were removed and the recomputed blocks written in their place: the next worker loads them.
    third = RecordingEngine(*tiny, _config(tmp_path))
    tokens, cached = _ask(third, make_request, A)
    assert tokens == expected[A] and cached >= 64
    second.shutdown()
    third.shutdown()


def test_a_tier_whose_filesystem_refuses_writes_costs_only_recompute(tiny, make_request, expected, tmp_path):
    engine = RecordingEngine(*tiny, _config(tmp_path))
    host = tmp_path / "host"
    for path in sorted(host.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    host.rmdir()
    host.write_text("the host tier's directory is gone")  # every write fails from here on
    for prompt in (A, B, C, A):
        tokens, _ = _ask(engine, make_request, prompt)
        assert tokens == expected[prompt]
    assert _tier(engine, "host").write_errors > 0
    engine.shutdown()


def _seq_of(engine, prompt: str):
    """A sequence of ``prompt`` as a new request of tenant a would have (for its chain)."""
    from switchyard.scheduler import Sequence

    ids = engine.tokenizer.encode(prompt)
    return Sequence("probe", ids, max_tokens=1, cache_salt="tenant:a")


def test_an_int8_cache_goes_through_the_tiers_byte_for_byte(tiny, make_request, tmp_path):
    """An int8 KV cache (``kv_cache_dtype``) moves its rows and their scales through the tiers as they are: a prefix
    loaded back continues exactly as the same engine without tiers does; its blocks are a layout of their own, so a
    float32 cache never loads them."""
    int8 = {"max_num_seqs": 2, "kv_cache_bytes": 1, "max_model_len": 128, "kv_cache_dtype": "int8"}
    plain = RecordingEngine(*tiny, EngineConfig(**int8))
    expected = {p: _ask(plain, make_request, p)[0] for p in (A, B, C)}
    engine = RecordingEngine(*tiny, _config(tmp_path, kv_cache_dtype="int8"))
    assert engine.tiers.layout.dtype == "int8"
    for prompt in (A, B, C):
        assert _ask(engine, make_request, prompt) == (expected[prompt], 0)
    tokens, cached = _ask(engine, make_request, A)
    assert tokens == expected[A] and cached > 0 and engine.tiers.num_loaded_blocks > 0
    engine.shutdown()
    full = RecordingEngine(*tiny, _config(tmp_path))
    assert full.tiers.layout != engine.tiers.layout
    assert _ask(full, make_request, A)[1] == 0  # the same host tier, nothing this float32 cache may load
    full.shutdown()
