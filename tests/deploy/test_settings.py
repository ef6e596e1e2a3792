"""Settings reach every process: flags map onto the one settings object, and ``up`` hands all of it to children."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from switchyard.cli.main import build_parser
from switchyard.cli.options import load_config
from switchyard.shared.config import (
    ENV_PREFIX,
    GatewayConfig,
    ModelEntry,
    RequestLimits,
    RouteRule,
    SafetyConfig,
    SwitchyardConfig,
    VllmSettings,
    WorkerConfig,
    settings_env,
)

# A value for every field of the gateway and worker sections, each different from its default.
WORKER = dict(model="/models/some-llama", served_model_name="llama", aliases=["l3"], dtype="float32", device="cpu",
              max_num_seqs=7,
              max_num_batched_tokens=96, block_size=32, kv_cache_gib=1.5, gpu_memory_fraction=0.5,
              enable_prefix_caching=False, cuda_graphs=False, heartbeat_s=1.5, torch_threads=3, omp_spin_count=20_000,
              batch_seqs_when_busy=4, interactive_busy_s=2.5, drain_timeout_s=12.0, metrics_host="0.0.0.0",
              metrics_port=9400, engine="vllm", simulated_tokens_per_s=40.0,
              simulated_prefill_us_per_token=5.0, simulated_output_tokens=64, simulated_tokens_per_delta=4,
              simulated_step_ms=20.0,
              vllm=VllmSettings(tensor_parallel_size=2, quantization="fp8", speculative_config={"method": "ngram"},
                                engine_args={"seed": 3}, python=Path(sys.executable)),
              prepare_threads=3, grammar_lexer_fuel=2_000_000, max_grammar_bytes=65_536, status_token="scrape-token",
              kv_offload_gib=4.0, kv_offload_host_dir=Path("/dev/shm/sy"), kv_offload_dir=Path("/var/kv"),
              kv_offload_disk_gib=64.0, kv_offload_tenant_share=0.25, role="decode", speculative="draft",
              num_speculative_tokens=6, speculative_model="/models/draft", speculative_quantization="int4",
              quantization="int8", kv_cache_dtype="int8", tune_threads=True)
GATEWAY = dict(host="0.0.0.0", port=9001, queue_timeout_s=7.5, stall_timeout_s=9.0, retry_after_s=3,
               max_request_bytes=1234, allow_tier_header=True, admin_key="admin-secret", run_jobs=False,
               shared_prefix_cache=True, drain_timeout_s=7.0, num_gateways=3, flex_wait_s=42.0,
               route_names=["auto", "smart"], routes=[RouteRule(model="llama", tiers=["pro"], max_difficulty=0.5)],
               affinity=False, affinity_wait_s=0.25, placement="affinity", processes=2, reuse_port=True,
               body_timeout_s=12.0, prefill_min_prompt_tokens=1024, prefill_wait_s=2.5,
               upload_timeout_s=60.0, failed_auth_per_minute=7, trusted_proxies=["10.0.0.0/8"],
               refused_body_bytes_per_minute=65_536,
               stream_send_timeout_s=5.0, stream_max_buffered_bytes=65_536, stream_resume_window_s=12.0,
               database_pool_size=3,
               limits=RequestLimits(max_messages=64, max_stop_chars=16, max_schema_bytes=4096, max_history_messages=9,
                                    max_history_chars=5000),
               safety=SafetyConfig(default_policy="log", keywords={"house": ["zorp"]}, classifier_threshold=0.8))


def test_the_fixtures_cover_every_setting():
    assert set(WORKER) == set(WorkerConfig.model_fields)
    assert set(GATEWAY) == set(GatewayConfig.model_fields)
    assert all(WorkerConfig().model_dump()[k] != v for k, v in WORKER.items())
    assert all(GatewayConfig().model_dump()[k] != v for k, v in GATEWAY.items())


@pytest.fixture
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    return monkeypatch


def test_every_setting_up_holds_reaches_its_children(clean_env):
    config = SwitchyardConfig(data_dir=Path("/srv/switchyard"), nats_url="nats://127.0.0.1:4333,nats://h:4334",
                              nats_replicas=3, database_url="postgresql://u@127.0.0.1:5433/db",
                              nats_tls_cert=Path("/etc/c.pem"), nats_tls_key=Path("/etc/k.pem"),
                              nats_tls_ca=Path("/etc/ca.pem"), log_format="json", log_health_checks=True,
                              traces_exporter="file", traces_file=Path("/tmp/traces.jsonl"),
                              embedding_model="/models/e5", prefill_workers=1, decode_workers=2,
                              worker=WorkerConfig(**WORKER), gateway=GatewayConfig(**GATEWAY),
                              models=[ModelEntry(model="smollm2", served_model_name="s", aliases=["a"],
                                                 input_per_mtok=0.5, max_num_seqs=3, prefill_workers=2,
                                                 decode_workers=3)])
    for name, value in settings_env(config).items():
        clean_env.setenv(name, value)
    assert SwitchyardConfig() == config


def test_up_flags_land_in_the_settings(clean_env):
    args = build_parser().parse_args([
        "up", "--model", "/m", "--served-model-name", "n", "--dtype", "float32", "--device", "cpu",
        "--max-num-seqs", "5", "--max-num-batched-tokens", "64", "--kv-cache-gib", "0.5", "--no-prefix-caching",
        "--batch-seqs-when-busy", "3", "--host", "0.0.0.0", "--port", "8123", "--nats-url", "nats://x:1",
        "--kv-offload-gib", "4", "--kv-offload-dir", "/var/kv", "--kv-offload-disk-gib", "32",
        "--speculative", "draft", "--speculative-model", "smollm2", "--speculative-quantization", "int4",
    ])
    config = load_config(args)
    assert config.worker.model_dump(include={"speculative", "speculative_model", "speculative_quantization"}) == dict(
        speculative="draft", speculative_model="smollm2", speculative_quantization="int4")
    assert config.worker.model_dump(include={"model", "served_model_name", "dtype", "device", "max_num_seqs",
                                             "max_num_batched_tokens", "kv_cache_gib", "enable_prefix_caching",
                                             "batch_seqs_when_busy"}) == dict(
        model="/m", served_model_name="n", dtype="float32", device="cpu", max_num_seqs=5, max_num_batched_tokens=64,
        kv_cache_gib=0.5, enable_prefix_caching=False, batch_seqs_when_busy=3)
    assert (config.gateway.host, config.gateway.port, config.nats_url) == ("0.0.0.0", 8123, "nats://x:1")
    assert (config.worker.kv_offload_gib, config.worker.kv_offload_dir, config.worker.kv_offload_disk_gib) == (
        4.0, Path("/var/kv"), 32.0)


def test_a_flag_wins_over_the_environment_and_unset_flags_keep_it(clean_env):
    clean_env.setenv("SWITCHYARD_WORKER__MAX_NUM_SEQS", "9")
    clean_env.setenv("SWITCHYARD_WORKER__DTYPE", "bfloat16")
    config = load_config(build_parser().parse_args(["worker", "--max-num-seqs", "4"]))
    assert (config.worker.max_num_seqs, config.worker.dtype) == (4, "bfloat16")


def test_gateway_no_jobs_flag(clean_env):
    assert load_config(build_parser().parse_args(["gateway", "--no-jobs"])).gateway.run_jobs is False
    assert load_config(build_parser().parse_args(["gateway"])).gateway.run_jobs is True


def test_local_system_hands_each_child_the_settings_with_its_overrides(clean_env, monkeypatch, tmp_path):
    from switchyard.deploy import system as system_module

    started, stop_timeouts, pythons = [], {}, {}

    class Child:  # stands in for the process: what it would be started with
        def __init__(self, name, args, log_path=None, env=None, stop_timeout_s=None, python=None):
            started.append((name, args, env))
            stop_timeouts[name] = stop_timeout_s
            pythons[name] = python

        def start(self):
            return self

        def stop(self):
            pass

    monkeypatch.setattr(system_module, "ServiceProcess", Child)
    config = SwitchyardConfig(data_dir=tmp_path, nats_url="nats://127.0.0.1:4333",
                              database_url="postgresql://u@127.0.0.1:5433/db",
                              worker=WorkerConfig(**WORKER), gateway=GatewayConfig(**GATEWAY))
    local = system_module.LocalSystem(config, log_level="DEBUG")
    local.start_worker("worker-b", served_model_name="b", max_num_seqs=2)
    local.start_gateway("gateway-2", port=9002)
    expected = {
        "worker-b": config.model_copy(update={"worker": config.worker.model_copy(
            update={"served_model_name": "b", "max_num_seqs": 2})}),
        "gateway-2": config.model_copy(update={"gateway": config.gateway.model_copy(update={"port": 9002})}),
    }
    expected["gateway-2-2"] = expected["gateway-2"]  # ``processes=2``: a second process on the same port
    assert [(name, args) for name, args, _ in started] == [("worker-b", ["worker", "--log-level", "DEBUG"]),
                                                           ("gateway-2", ["gateway", "--log-level", "DEBUG"]),
                                                           ("gateway-2-2", ["gateway", "--log-level", "DEBUG"])]
    # Stopping waits for each child's own drain deadline (and a margin) before it kills.
    assert stop_timeouts == {"worker-b": WORKER["drain_timeout_s"] + 10, "gateway-2": GATEWAY["drain_timeout_s"] + 10,
                             "gateway-2-2": GATEWAY["drain_timeout_s"] + 10}
    # A vLLM worker runs under the vLLM environment's Python (worker.vllm.python here), the others under this one.
    assert pythons == {"worker-b": str(WORKER["vllm"].python), "gateway-2": None, "gateway-2-2": None}
    for name, _, env in started:
        with monkeypatch.context() as child:
            for key, value in env.items():
                child.setenv(key, value)
            assert SwitchyardConfig() == expected[name]
    # The vLLM worker's temporary files (vLLM's, its KV events socket) go to a directory of its own, which the
    # system removes when it stops: a worker killed by SIGKILL cannot remove them itself.
    tmp = Path(started[0][2]["TMPDIR"])
    assert tmp.is_dir() and "TMPDIR" not in started[1][2]
    local.stop()
    assert not tmp.exists()


def test_several_models_from_flags_or_a_settings_file_which_the_environment_overrides(clean_env, tmp_path):
    config = load_config(build_parser().parse_args(["up", "--model", "small=smollm2", "--model", "/m/large"]))
    assert [(m.served_model_name, m.model) for m in config.models] == [("small", "smollm2"), (None, "/m/large")]
    settings = tmp_path / "switchyard.yaml"
    settings.write_text("models:\n  - {model: smollm2, served_model_name: s, aliases: [fast], input_per_mtok: 0.5}\n"
                        "gateway:\n  port: 9100\n  routes: [{model: s, max_difficulty: 0.3}]\n")
    clean_env.setenv("SWITCHYARD_GATEWAY__PORT", "9200")
    config = load_config(build_parser().parse_args(["gateway", "--config", str(settings)]))
    assert [(m.served_name, m.aliases, m.input_per_mtok) for m in config.models] == [("s", ["fast"], 0.5)]
    assert (config.gateway.port, config.gateway.routes[0].max_difficulty) == (9200, 0.3)


def test_up_serves_the_embedding_model_beside_the_chat_model_unless_told_not_to(clean_env, tmp_path):
    from switchyard.deploy.up import default_models
    from switchyard.workers.model_store import engine_for

    def served(*argv: str) -> list[tuple[str, str | None]]:
        config = load_config(build_parser().parse_args(["up", *argv]))
        return [(m.served_name, m.engine) for m in default_models(config)]

    assert served() == [("smollm2", None), ("all-minilm-l6-v2", "embeddings")]
    assert served("--no-embeddings") == [("smollm2", None)]
    (tmp_path / "e5").mkdir()
    assert served("--embedding-model", str(tmp_path / "e5")) == [("smollm2", None), ("e5", "embeddings")]
    # --engine vllm: the embedding model on vLLM too (its pooling runner); the test double embeds nothing.
    assert served("--engine", "vllm") == [("smollm2", None), ("all-minilm-l6-v2", "vllm")]
    assert served("--engine", "simulated") == [("smollm2", None), ("all-minilm-l6-v2", "embeddings")]
    # A registry embedding model finds its engine on the worker, in place of the default one.
    assert engine_for("all-minilm-l6-v2", "switchyard") == "embeddings"
    assert engine_for("smollm2", "vllm") == "vllm" and engine_for("/models/x", "switchyard") == "switchyard"


def test_up_runs_workers_or_prefill_and_decode_workers_of_the_chat_model_or_of_a_listed_one(clean_env, tmp_path):
    from switchyard.deploy.up import default_models, worker_roles

    def roles(*argv: str) -> list[list[str]]:
        config = load_config(build_parser().parse_args(["up", "--no-embeddings", *argv]))
        return [[role for role, _ in worker_roles(m)] for m in config.models or default_models(config)]

    assert roles() == [["both"]]
    assert roles("--workers", "3") == [["both", "both", "both"]]
    with pytest.raises(ValueError, match="set decode_workers instead"):
        roles("--workers", "2", "--decode-workers", "2")
    assert roles("--prefill-workers", "1", "--decode-workers", "2") == [["prefill", "decode", "decode"]]
    assert roles("--decode-workers", "1") == [["decode"]]
    with pytest.raises(ValueError, match="prefill_workers needs decode_workers"):
        roles("--prefill-workers", "1")
    settings = tmp_path / "switchyard.yaml"
    settings.write_text("models:\n  - {model: smollm2, prefill_workers: 1, decode_workers: 1}\n  - {model: /m/b}\n")
    assert roles("--config", str(settings)) == [["prefill", "decode"], ["both"]]
    assert [s for _, s in worker_roles(ModelEntry(model="m", prefill_workers=1, decode_workers=1))] == [
        "-prefill-0", "-decode-0"]
    assert [s for _, s in worker_roles(ModelEntry(model="m", workers=3))] == ["", "-1", "-2"]


def test_up_refuses_prefill_workers_without_decode_workers_before_starting_anything(clean_env, tmp_path):
    import subprocess

    done = subprocess.run([sys.executable, "-m", "switchyard.cli.main", "up", "--prefill-workers", "2", "--data-dir",
                           str(tmp_path / "data")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "prefill_workers needs decode_workers" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "data").exists()


@pytest.mark.parametrize("settings", [dict(speculative="draft"), dict(speculative_model="smollm2"),
                                      dict(speculative="ngram", speculative_quantization="int4")])
def test_a_draft_model_and_its_settings_go_together(settings):
    with pytest.raises(ValueError, match="speculative"):
        WorkerConfig(**settings)
