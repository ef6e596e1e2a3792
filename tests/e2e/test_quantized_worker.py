"""A worker started with int8 weights and activations and an int8 KV cache (`--quantization w8a8 --kv-cache-dtype
int8`), on real processes: it starts (taking float32 for `--dtype auto`, as its kernels need) and serves requests
whole, streamed or not, billed as served."""

from __future__ import annotations

import httpx

from switchyard.deploy.services import wait_until_ready

MODEL = "tiny-int8"


async def test_a_worker_with_int8_weights_and_kv_cache_serves_whole_answers(e2e, system, auth):
    worker = e2e.start_worker(MODEL, max_num_seqs=4, quantization="w8a8", kv_cache_dtype="int8")
    try:
        wait_until_ready(system, MODEL, timeout_s=120, watch=[worker])
        async with httpx.AsyncClient(base_url=system, headers=auth, timeout=60) as http:
            for prompt in ("one two three four", "The cat sat on the mat and then"):
                r = await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 24,
                                                             "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["usage"]["completion_tokens"] == 24 and body["choices"][0]["text"]
            r = await http.post("/v1/chat/completions", json={"model": MODEL, "stream": True, "max_tokens": 12,
                                                              "messages": [{"role": "user", "content": "hi"}],
                                                              "stream_options": {"include_usage": True}})
            assert r.status_code == 200 and '"completion_tokens":12' in r.text.replace(" ", ""), r.text[-500:]
    finally:
        worker.stop()
