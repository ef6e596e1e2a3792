"""Safety filters end to end with the official ``openai`` client, on the deployment's default rule set and
classifier: per tenant, ``block`` refuses an offensive prompt (chat, completions, a conversation turn, a batch line)
with 400 ``content_policy_violation`` and halts a reply that turns offensive with ``content_filter``; ``log`` and
``off`` let both through. The policies are set with ``switchyard tenants update --safety``; the gateway's and the
worker's /metrics count the verdicts.

The tiny model's replies are random: ``logit_bias`` makes every token " a" or "s", so a reply soon spells "ass"."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys

import httpx
import openai
import pytest
from openai import OpenAI

from tests.e2e.conftest import TINY
from tests.e2e.test_batches import chat_line, finished, parse_jsonl, submit, wait_batch
from tests.e2e.test_metrics import scrape, value, worker_metrics_url
from tests.support.system import poll
from tests.support.tiny_model import build_tokenizer

BAD_PROMPT = "you are a fucking idiot"
CLEAN_PROMPT = "Tell me a story about a train yard."
BAD_WORD = re.compile(r"\bass\b")
MAX_TOKENS = 150


def forcing_bias() -> dict[str, int]:
    tok = build_tokenizer()
    return {str(tok.convert_tokens_to_ids("Ġa")): 100, str(tok.convert_tokens_to_ids("s")): 100}


async def set_policy(database_url: str, tenant: str, policy: str) -> None:
    """``switchyard tenants update TENANT --safety POLICY``, as an operator runs it."""
    done = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "switchyard.cli.main", "tenants", "update", tenant, "--safety", policy,
        "--database-url", database_url], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"updated tenant {tenant}" in done.stdout


@pytest.fixture(scope="module")
async def clients(system, new_key, database_url) -> dict[str, OpenAI]:
    """A client per policy: block (the deployment's default, set by no one), log and off (set with the CLI)."""
    out = {}
    for policy in ("block", "log", "off"):
        tenant, secret = await new_key("pro", rpm_limit=100_000, tpm_limit=100_000_000)
        if policy != "block":
            await set_policy(database_url, tenant, policy)
        out[policy] = OpenAI(base_url=f"{system}/v1", api_key=secret, max_retries=0, timeout=60)
    yield out
    for client in out.values():
        client.close()


def chat(client: OpenAI, content: str, **kw):
    return client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": content}],
                                          max_tokens=4, temperature=0, **kw)


def forced_stream(client: OpenAI, seed: int = 3) -> tuple[str, str | None]:
    """A streamed reply made of " a" and "s": its text and finish reason."""
    stream = client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "Say something."}],
                                            max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, stream=True,
                                            logit_bias=forcing_bias())
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


async def test_a_clean_request_passes_a_block_policy(clients):
    reply = await asyncio.to_thread(chat, clients["block"], CLEAN_PROMPT)
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content


async def test_an_offensive_prompt_is_refused_under_block_and_runs_under_log_and_off(e2e, clients):
    async with httpx.AsyncClient(timeout=30) as http:
        before = await scrape(http, f"{e2e.base_url}/metrics")
    with pytest.raises(openai.BadRequestError) as refused:
        await asyncio.to_thread(chat, clients["block"], BAD_PROMPT)
    assert refused.value.status_code == 400
    assert refused.value.code == "content_policy_violation" and refused.value.param == "messages"
    assert "profanity" in refused.value.message and "idiot" not in refused.value.message
    # Every message is the client's to write, an earlier "assistant" one too.
    with pytest.raises(openai.BadRequestError):
        await asyncio.to_thread(clients["block"].chat.completions.create, model=TINY, max_tokens=4, messages=[
            {"role": "assistant", "content": BAD_PROMPT}, {"role": "user", "content": "Go on."}])
    with pytest.raises(openai.BadRequestError) as legacy:
        await asyncio.to_thread(clients["block"].completions.create, model=TINY, prompt=["fine", BAD_PROMPT],
                                max_tokens=4)
    assert legacy.value.code == "content_policy_violation" and legacy.value.param == "prompt"
    for policy in ("log", "off"):
        reply = await asyncio.to_thread(chat, clients[policy], BAD_PROMPT)
        assert reply.choices[0].finish_reason == "length", policy

    async with httpx.AsyncClient(timeout=30) as http:
        after = await scrape(http, f"{e2e.base_url}/metrics")

    def grew(**labels) -> float:
        metric = "switchyard:safety_input_verdicts_total"
        return value(after, metric, tier="pro", **labels) - value(before, metric, tier="pro", **labels)

    assert grew(category="profanity", action="blocked") == 3
    assert grew(category="profanity", action="logged") == 1  # the off tenant's request is not judged at all
    assert grew(action="allowed") == 0
    assert value(after, "switchyard:request_errors_total", status="400", reason="content_policy_violation") >= 3


async def test_a_conversation_turn_is_judged_by_its_new_message(system, clients):
    headers = {"Authorization": f"Bearer {clients['block'].api_key}"}
    async with httpx.AsyncClient(base_url=system, headers=headers, timeout=60) as http:
        conv = (await http.post("/v1/conversations", json={"model": TINY})).json()
        turns = f"/v1/conversations/{conv['id']}/messages"
        refused = await http.post(turns, json={"content": BAD_PROMPT, "max_tokens": 4})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "content_policy_violation"
        assert refused.json()["error"]["param"] == "content"
        ok = await http.post(turns, json={"content": CLEAN_PROMPT, "max_tokens": 4, "ignore_eos": True})
        assert ok.status_code == 200, ok.text
        stored = await poll(lambda: http.get(turns), lambda r: len(r.json()["data"]) == 2,
                            what="the clean turn stored")
        assert [m["content"] for m in stored.json()["data"]][0] == CLEAN_PROMPT  # the refused turn left nothing


async def test_a_conversations_system_prompt_is_judged_like_a_turn(system, clients):
    headers = {"Authorization": f"Bearer {clients['block'].api_key}"}
    async with httpx.AsyncClient(base_url=system, headers=headers, timeout=60) as http:
        refused = await http.post("/v1/conversations", json={"model": TINY, "system": BAD_PROMPT})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "content_policy_violation"
        assert refused.json()["error"]["param"] == "system"
        assert (await http.post("/v1/conversations", json={"model": TINY, "system": CLEAN_PROMPT})).status_code == 200


async def test_a_reply_that_turns_offensive_halts_under_block_and_is_counted(e2e, nats_url, clients):
    worker_url = await worker_metrics_url(nats_url)
    async with httpx.AsyncClient(timeout=30) as http:
        before = await scrape(http, worker_url)
        text, finish = await asyncio.to_thread(forced_stream, clients["block"])
        assert finish == "content_filter", text
        assert set(text) <= {" ", "a", "s"} and not BAD_WORD.search(text), text  # not even a part of the word
        logged_text, logged_finish = await asyncio.to_thread(forced_stream, clients["log"])
        assert logged_finish == "length" and BAD_WORD.search(logged_text)
        off_text, off_finish = await asyncio.to_thread(forced_stream, clients["off"])
        assert off_finish == "length" and BAD_WORD.search(off_text)

        def grew(samples, metric: str, **labels) -> float:
            return value(samples, metric, **labels) - value(before, metric, **labels)

        counted = {"model": TINY, "tier": "pro", "category": "profanity"}
        after = await poll(lambda: scrape(http, worker_url),
                           lambda s: grew(s, "switchyard:safety_output_verdicts_total", action="logged", **counted),
                           what="the worker counting the logged reply")
        assert grew(after, "switchyard:safety_output_verdicts_total", action="blocked", **counted) == 1
        assert grew(after, "switchyard:safety_output_verdicts_total", action="logged", **counted) == 1
        assert grew(after, "switchyard:request_success_total", model=TINY, tier="pro",
                    finished_reason="content_filter") == 1


async def test_a_batch_line_refused_fails_alone(clients):
    client = clients["block"]
    lines = [chat_line("clean"), chat_line("rude", content=BAD_PROMPT), chat_line("clean-2")]
    _, batch = await asyncio.to_thread(submit, client, lines)
    done = await wait_batch(client, batch.id, finished, what="an end")
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (2, 1), done
    errors = parse_jsonl(client.files.content(done.error_file_id).read())
    assert [e["custom_id"] for e in errors] == ["rude"]
    assert errors[0]["response"]["status_code"] == 400
    assert errors[0]["response"]["body"]["error"]["code"] == "content_policy_violation", errors[0]
