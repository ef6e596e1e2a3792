"""A vLLM worker's role as vLLM's KV connector, and what its requests carry for it (workers/vllm_engine/kv_transfer.py),
without vLLM: the settings a role gives, the roles an engine can take, the parameters of a prefill and of the
continuation after it, and the requests refused instead of silently run whole."""

from __future__ import annotations

import pytest

from switchyard.shared.config import WorkerConfig
from switchyard.shared.messages import GenerateRequest, Resume, SamplingParams
from switchyard.workers.serving.prompts import RequestRejected
from switchyard.workers.vllm_engine import kv_transfer
from switchyard.workers.vllm_engine.args import engine_kwargs, pooling_kwargs

# What a vLLM prefill returns (vLLM 0.32's NIXL connector, pull mode), as a decode worker gets it in Resume.kv_transfer.
PREFILL_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 6, 7]],
                  "remote_engine_id": "b70a7c6c", "remote_request_id": "r1-a55131c0", "remote_host": "10.0.0.7",
                  "remote_port": 5600, "tp_size": 4, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 385,
                  "remote_blocks_expiry_time": None, "transfer_mode": "pull"}


def request(handover: bool = False, resume: Resume | None = None, n: int = 1) -> GenerateRequest:
    return GenerateRequest("r1", "m", "pro", SamplingParams(n=n), 0.0, 0.0, prompt="Hi", handover=handover,
                           resume=resume)


def test_a_prefill_or_decode_worker_gets_the_nixl_connector_in_its_kv_role():
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        kwargs = engine_kwargs(WorkerConfig(engine="vllm", role=role), "/m", on_gpu=True)
        assert kwargs["kv_transfer_config"] == {"kv_connector": "NixlConnector", "kv_role": kv_role,
                                                "kv_connector_extra_config": {}, "kv_load_failure_policy": "recompute"}
        assert kv_transfer.connector_roles(kwargs) == ("both", role)


def test_a_both_worker_has_no_connector_unless_it_names_one():
    kwargs = engine_kwargs(WorkerConfig(engine="vllm"), "/m", on_gpu=True)
    assert "kv_transfer_config" not in kwargs and kv_transfer.connector_roles(kwargs) == ("both",)
    named = WorkerConfig(engine="vllm", vllm={"kv_connector": "NixlConnector",
                                              "kv_connector_extra_config": {"backends": ["UCX"]}})
    kwargs = engine_kwargs(named, "/m", on_gpu=True)
    assert kwargs["kv_transfer_config"] == {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                                            "kv_connector_extra_config": {"backends": ["UCX"]},
                                            "kv_load_failure_policy": "recompute"}
    assert kv_transfer.connector_roles(kwargs) == ("both", "prefill", "decode")


def test_connector_settings_with_no_connector_or_beside_offloading_are_refused_at_start():
    with pytest.raises(ValueError, match="kv_connector_extra_config needs a KV connector"):
        engine_kwargs(WorkerConfig(engine="vllm", vllm={"kv_connector_extra_config": {"backends": ["UCX"]}}), "/m",
                      on_gpu=True)
    with pytest.raises(ValueError, match="kv_connector is empty"):
        engine_kwargs(WorkerConfig(engine="vllm", role="prefill", vllm={"kv_connector": ""}), "/m", on_gpu=True)
    # vLLM would replace the connector with its offloading one: the prefill's blocks would never move.
    for offload in ({"kv_offload_gib": 8.0}, {"vllm": {"kv_offloading_size": 8.0}}):
        with pytest.raises(ValueError, match="MultiConnector"):
            engine_kwargs(WorkerConfig(engine="vllm", role="decode", **offload), "/m", on_gpu=True)
    assert engine_kwargs(WorkerConfig(engine="vllm", kv_offload_gib=8.0), "/m", on_gpu=True)["kv_offloading_size"] == 8


def test_a_kv_transfer_config_of_engine_args_wins_and_decides_the_roles():
    mine = {"kv_connector": "MultiConnector", "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"connectors": [{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
                                                         {"kv_connector": "OffloadingConnector",
                                                          "kv_role": "kv_consumer"}]}}
    worker = WorkerConfig(engine="vllm", role="decode", vllm={"engine_args": {"kv_transfer_config": mine}})
    kwargs = engine_kwargs(worker, "/m", on_gpu=True)
    assert kwargs["kv_transfer_config"] == mine and kv_transfer.connector_roles(kwargs) == ("both", "decode")
    assert kv_transfer.connector_roles({"kv_transfer_config": {"kv_connector": None, "kv_role": "kv_both"}}) == \
        ("both",)


def test_an_embedding_worker_builds_no_connector():
    kwargs = pooling_kwargs(WorkerConfig(engine="vllm", role="prefill"), "/m", on_gpu=True, max_input_tokens=None)
    assert "kv_transfer_config" not in kwargs


def test_a_prefill_keeps_its_blocks_for_a_remote_decode_and_runs_to_a_second_token():
    assert kv_transfer.prefill_max_tokens(500) == 2
    assert kv_transfer.request_params(request(handover=True), 2, consumes_kv=False) == {"do_remote_decode": True}
    # One token allowed: the request ends here, whole (and billed here): there is nothing to hand over.
    assert kv_transfer.prefill_max_tokens(1) == 1
    assert kv_transfer.request_params(request(handover=True), 1, consumes_kv=False) is None


def test_a_continuation_pulls_the_blocks_its_prefill_named_on_an_engine_that_consumes_kv():
    resume = Resume([2229], 3, attempt=1, handovers=1, prefill_worker="w-p", kv_transfer=PREFILL_PARAMS)
    params = kv_transfer.request_params(request(resume=resume), 99, consumes_kv=True)
    assert params == PREFILL_PARAMS
    params["do_remote_prefill"] = False  # vLLM marks the dict it is given: never the request's own
    assert resume.kv_transfer["do_remote_prefill"] is True
    # No connector to pull with (the worker computes the prompt, and says so once), and after a failover (the
    # gateway drops kv_transfer: the blocks may be gone), and on a first run: no parameters.
    assert kv_transfer.request_params(request(resume=resume), 99, consumes_kv=False) is None
    after_failover = Resume([2229, 34], 5, attempt=2, handovers=1, prefill_worker="w-p")
    assert kv_transfer.request_params(request(resume=after_failover), 99, consumes_kv=True) is None
    assert kv_transfer.request_params(request(), 99, consumes_kv=True) is None


def test_a_prefill_an_engine_cannot_hand_over_is_refused_with_a_server_error():
    kv_transfer.check_request(request(handover=True), ("both", "prefill"))
    kv_transfer.check_request(request(), ("both",))
    for roles, req in ((("both",), request(handover=True)), (("both", "decode"), request(handover=True)),
                       (("both", "prefill"), request(handover=True, n=2)),
                       (("both", "prefill"), request(handover=True, resume=Resume([1], 1)))):
        with pytest.raises(RequestRejected) as refused:
            kv_transfer.check_request(req, roles)
        assert (refused.value.error.code, refused.value.error.status) == ("handover_unsupported", 500)


def test_the_prefill_role_is_refused_for_a_model_whose_prefill_vllm_cuts_short():
    kv_transfer.check_prefill_model(("both", "prefill"), is_hybrid=False, lookahead_tokens=0)
    kv_transfer.check_prefill_model(("both", "decode"), is_hybrid=True, lookahead_tokens=3)  # decode: unaffected
    for hybrid, lookahead in ((True, 0), (False, 2)):
        with pytest.raises(ValueError, match="serve this model with role both"):
            kv_transfer.check_prefill_model(("both", "prefill"), is_hybrid=hybrid, lookahead_tokens=lookahead)


def test_a_continuation_taken_up_after_two_thirds_of_the_prefills_lease_computes_its_prompt():
    """The prefill's vLLM frees unread blocks when its lease runs out (30 s unless kv_lease_duration says otherwise):
    a continuation that waited in the queue longer than that must not read them."""
    handed = kv_transfer.stamp(PREFILL_PARAMS, now=1000.0)
    assert handed == {**PREFILL_PARAMS, kv_transfer.HANDED_OVER_AT: 1000.0} and kv_transfer.stamp(None, 1.0) is None
    req = request(resume=Resume([2229], 3, handovers=1, kv_transfer=handed))
    assert kv_transfer.request_params(req, 99, consumes_kv=True, lease=30.0, now=1019.0) == handed
    assert kv_transfer.request_params(req, 99, consumes_kv=True, lease=30.0, now=1021.0) is None
    assert kv_transfer.request_params(req, 99, consumes_kv=True, lease=90.0, now=1021.0) == handed
    assert kv_transfer.lease_s(engine_kwargs(WorkerConfig(engine="vllm", role="decode"), "/m", on_gpu=True)) == 30.0
    longer = WorkerConfig(engine="vllm", role="decode", vllm={"kv_connector_extra_config": {"kv_lease_duration": 90}})
    assert kv_transfer.lease_s(engine_kwargs(longer, "/m", on_gpu=True)) == 90.0
