"""``switchyard up --prefill-workers 1 --decode-workers 2`` as an operator runs it, on the default model (SmolLM2)
with embedded NATS and Postgres: a long prompt is prefilled by the prefill worker and decoded by a decode worker
(its usage row names both), a decode worker SIGKILLed mid-stream leaves the stream to the other one, and the
prefill worker SIGKILLed mid-prefill leaves its request to a decode worker, which runs it whole; every stream ends
with all its tokens, billed once. (``up`` restarts what was killed; the test is over before that matters.)"""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import nats
import pytest

from switchyard.shared import nats_client, subjects
from switchyard.shared.jetstream import live_workers
from switchyard.shared.messages import TokenDelta, decode, decode_routed
from switchyard.workers.model_store import pull
from tests.support.system import model_cache_dir, poll, stream_completion, usage_rows, worker_running
from tests.support.up import running_up

pytestmark = pytest.mark.model

MODEL = "smollm2"
WORDS = ("ledger", "freight", "signal", "switch", "yard", "engine", "track", "cargo", "route", "timetable")


def long_prompt(seed: int, words: int) -> str:
    """A new prompt of about ``words`` * 1.3 tokens (nothing of it cached anywhere)."""
    return f"Manifest {seed}: " + " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(words))


@pytest.fixture(scope="module")
def up():
    """``switchyard up`` with a prefill pool and a decode pool of SmolLM2, in a data dir of its own (its host KV
    tier too); yields (base URL, API key, the run file's URLs)."""
    chat = pull(MODEL, model_cache_dir())
    with running_up(lambda data: ["--model", f"{MODEL}={chat}", "--no-embeddings", "--prefill-workers", "1",
                                  "--decode-workers", "2", "--max-num-seqs", "4", "--kv-cache-gib", "0.5",
                                  "--kv-offload-host-dir", str(data / "kv-host")], [MODEL]) as system:
        yield system.base_url, system.api_key, system.urls


async def test_up_serves_the_default_model_across_two_pools_through_a_decode_and_a_prefill_worker_killed(up):
    base, key, urls = up
    auth = {"Authorization": f"Bearer {key}"}
    nats_url, database_url = urls["nats_url"], urls["database_url"]
    nc = await nats.connect(nats_url)
    http = httpx.AsyncClient(timeout=300)
    try:
        await poll(lambda: http.get(f"{base}/readyz"), lambda r: MODEL in r.json()["checks"]["prefill_pools"],
                   timeout_s=60, what="the gateway seeing the prefill pool")
        infos = await poll(lambda: live_workers(nc.jetstream()),
                           lambda ws: sorted(w.role for w in ws if w.model == MODEL) == ["decode", "decode", "prefill"],
                           timeout_s=60, what="a prefill and two decode workers registered")
        (prefill,) = [w for w in infos if w.role == "prefill"]
        decoders = {w.worker_id: w for w in infos if w.role == "decode"}

        # A decode worker killed mid-stream: the other goes on, from the shared tier's blocks.
        body = {"model": MODEL, "prompt": long_prompt(1, 300), "max_tokens": 120, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        killed = []

        async def kill_the_decode_worker(request_id: str) -> None:
            while (worker_id := await worker_running(nc, request_id, timeout_s=30)) == prefill.worker_id:
                pass  # the prefill's own last delta: the decode worker's come next
            killed.append(decoders[worker_id])
            os.kill(decoders[worker_id].pid, signal.SIGKILL)

        events, request_id = await stream_completion(base, auth, body, kill_the_decode_worker)
        assert killed and "error" not in events[-1], events[-1]
        assert events[-1]["usage"]["completion_tokens"] == 120
        (survivor,) = [w for w in decoders.values() if w.worker_id != killed[0].worker_id]
        (row,) = await usage_rows(database_url, nats_url, request_id,
                                  "completion_tokens, worker_id, prefill_worker_id")
        assert (row["completion_tokens"], row["worker_id"], row["prefill_worker_id"]) == \
            (120, survivor.worker_id, prefill.worker_id)

        # The prefill worker killed while it computes a long prompt: the gateway continues the request on a decode
        # worker, from nothing, and it runs whole there.
        body = {"model": MODEL, "prompt": long_prompt(2, 1200), "max_tokens": 16, "temperature": 0,
                "ignore_eos": True}
        first_messages = await nc.subscribe(subjects.gateway_token_subject("*"))
        await nats_client.settled(nc)
        reply = asyncio.create_task(http.post(f"{base}/v1/completions", headers=auth, json=body))
        msg = await first_messages.next_msg(timeout=60)
        await first_messages.unsubscribe()
        (routed, *_) = decode_routed(msg.data)
        # Its first message goes out before the step that prefills it: the prefill worker is mid-prefill now.
        assert decode(routed.delta, TokenDelta).worker_id == prefill.worker_id
        os.kill(prefill.pid, signal.SIGKILL)
        r = await reply
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 16
        (row,) = await usage_rows(database_url, nats_url, r.headers["X-Request-Id"],
                                  "completion_tokens, worker_id, prefill_worker_id")
        # A decode worker's (the survivor, or the killed one restarted by up meanwhile), not a hand-over.
        assert row["worker_id"] not in (prefill.worker_id, killed[0].worker_id)
        assert (row["completion_tokens"], row["prefill_worker_id"]) == (16, None)
    finally:
        await http.aclose()
        await nc.close()
