"""What a worker publishes for a chat prompt's message prefixes: prefix k's blocks are exactly the leading blocks of
any later request that starts with the same k + 1 messages (a follow-up turn), so a gateway that looks a follow-up
up by its messages finds the blocks the worker will hit; and another tenant, or other tools, name other prefixes."""

from __future__ import annotations

import msgspec
import pytest

from switchyard.gateway.kv_index import PREFIX_IDLE_S
from switchyard.scheduler import Sequence
from switchyard.scheduler.kv_cache_manager import KVCacheManager
from switchyard.shared.kv_events import PrefixSegment, cache_salt, request_prefix_keys, split_hashes
from switchyard.shared.messages import ChatMessage, GenerateRequest, SamplingParams, ToolSpec, ToolUse
from switchyard.workers.model_store import load
from switchyard.workers.serving.kv_changes import REANNOUNCE_S, PrefixSegmentLog
from switchyard.workers.serving.prompts import prepare_prompt

BLOCK = 16


@pytest.fixture(params=["tiny", pytest.param("smollm2", marks=pytest.mark.model)])
def tokenizer(request):
    if request.param == "tiny":
        return load(request.getfixturevalue("tiny_model_dir"), dtype="float32", device="cpu")[1]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(request.getfixturevalue("smollm2_dir"))


def chat(*contents: str, tenant: str = "a", tools: ToolUse | None = None) -> GenerateRequest:
    roles = ["system", "user", "assistant", "user", "assistant", "user"]
    return GenerateRequest(request_id="r", model="m", tier="pro", sampling=SamplingParams(max_tokens=4),
                           created_at=0.0, deadline_at=0.0, tenant_id=tenant, tool_use=tools,
                           messages=[ChatMessage(roles[i], c) for i, c in enumerate(contents)])


def published(tokenizer, req: GenerateRequest) -> dict[bytes, list[int]]:
    """Each message prefix's blocks, as the worker publishes them: key -> the whole chain up to it."""
    prepared = prepare_prompt(tokenizer, req, 8192, None, len(tokenizer), segment_block_size=BLOCK)
    chains, chain = {}, []
    for segment in prepared.prefix_segments:
        chain = chain + [int.from_bytes(h, "little") for h in split_hashes(segment.hashes)]
        chains[segment.key] = chain
    return chains


def computed(tokenizer, req: GenerateRequest) -> list[int]:
    """The block hashes the engine looks up for ``req`` (its prefix-cache chain)."""
    ids = prepare_prompt(tokenizer, req, 8192, None, len(tokenizer)).token_ids
    return [h for h, _ in KVCacheManager(4, BLOCK).chain(Sequence("s", ids, 4, cache_salt=cache_salt(req)))]


def test_a_follow_ups_leading_blocks_are_what_its_history_was_published_as(tokenizer):
    system = "You are the archivist of the railway yard. " * 12
    first = chat(system, "How many tracks does the bowl have?")
    follow_up = chat(system, "How many tracks does the bowl have?", "Forty-two, in six fans.", "And the hump?")
    chains = published(tokenizer, first)
    keys = request_prefix_keys(follow_up)
    assert list(chains) == request_prefix_keys(first) == keys[:2]
    later = computed(tokenizer, follow_up)
    for key in keys[:2]:
        assert chains[key], "every prefix here spans full blocks"
        assert later[:len(chains[key])] == chains[key]
    assert len(chains[keys[1]]) > len(chains[keys[0]])


def test_the_prompt_is_tokenized_the_same_with_or_without_segments(tokenizer):
    req = chat("Be brief. " * 30, "Hello there, what is a classification yard?")
    plain = prepare_prompt(tokenizer, req, 8192, None, len(tokenizer))
    segmented = prepare_prompt(tokenizer, req, 8192, None, len(tokenizer), segment_block_size=BLOCK)
    assert segmented.token_ids == plain.token_ids and not plain.prefix_segments
    whole = published(tokenizer, req)[request_prefix_keys(req)[-1]]
    chain = computed(tokenizer, req)
    # Every block up to the last message's end: only the template's closing tokens after it may fill one more.
    assert chain[:len(whole)] == whole and len(whole) >= len(chain) - 1


def test_another_tenant_or_other_tools_name_other_prefixes():
    req = chat("Same words. " * 20, "Same question?")
    assert not set(request_prefix_keys(req)) & set(request_prefix_keys(msgspec.structs.replace(req, tenant_id="b")))
    tools = ToolUse(tools=[ToolSpec(name="lookup", description="", parameters={"type": "object"})], choice="auto")
    assert not set(request_prefix_keys(req)) & set(request_prefix_keys(msgspec.structs.replace(req, tool_use=tools)))


def test_a_key_is_handed_out_once_until_it_is_due_to_be_announced_again():
    now = [0.0]
    log = PrefixSegmentLog(clock=lambda: now[0])
    history = [PrefixSegment(b"k0", None, b""), PrefixSegment(b"k1", b"k0", b"x" * 16)]
    log.add(history)
    assert log.take() == history
    now[0] = REANNOUNCE_S - 1
    log.add(history + [PrefixSegment(b"k2", b"k1", b"")])  # the next turn sends its history again
    assert [s.key for s in log.take()] == [b"k2"], "only what a router has not been told"
    now[0] = REANNOUNCE_S + 1
    log.add(history + [PrefixSegment(b"k2", b"k1", b"")])
    assert [s.key for s in log.take()] == [b"k0", b"k1"], "announced again before a router forgets them as idle"
    assert REANNOUNCE_S < PREFIX_IDLE_S
