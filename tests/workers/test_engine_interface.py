"""Each engine has every member of the interface the worker serves through, with arguments the worker can pass."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from switchyard.workers.engine.engine import Engine
from switchyard.workers.serving.interface import ROLES, EngineCapabilities, ServingEngine
from switchyard.workers.vllm_engine.engine import VllmEngine  # readable without vLLM: it imports it when built
from tests.workers.test_engine_kv_remote import Peers


def _members(protocol) -> dict[str, object]:
    return {name: value for name, value in vars(protocol).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))}


@pytest.mark.parametrize("Engine", [Engine, VllmEngine])
def test_engine_implements_every_member_of_the_interface(Engine):
    members = _members(ServingEngine)
    assert {"prepare", "add_request", "abort_request", "step", "capacity", "stats", "shutdown"} <= set(members)
    for name, declared in members.items():
        assert hasattr(Engine, name) or name == "max_context", f"Engine lacks {name}"
        if isinstance(declared, property) or name == "max_context":
            continue
        wanted = list(inspect.signature(declared).parameters.values())[1:]
        given = list(inspect.signature(getattr(Engine, name)).parameters.values())[1:]
        assert len(given) >= len(wanted), f"Engine.{name} takes fewer arguments than the interface passes"
        # Any argument beyond the interface's has a default: the worker never passes it.
        assert all(p.default is not inspect.Parameter.empty for p in given[len(wanted):]), name
        # An argument the interface may leave out has a default here too.
        for w, g in zip(wanted, given):
            assert w.default is inspect.Parameter.empty or g.default is not inspect.Parameter.empty, (name, g.name)


def test_each_engine_states_its_capabilities_and_the_kv_exchange_follows_them(tiny, tmp_path):
    from switchyard.workers.engine.config import EngineConfig
    from switchyard.workers.simulated_engine import SimulatedEngine

    plain = Engine(*tiny, EngineConfig(max_num_seqs=2, max_model_len=128))
    tiered = Engine(*tiny, EngineConfig(max_num_seqs=2, kv_cache_bytes=1, max_model_len=128, kv_offload_gib=0.01,
                                        kv_offload_host_dir=tmp_path / "host"))
    try:
        assert plain.capabilities == EngineCapabilities(ROLES, kv_exchange=False, background_limit=True, pausing=True)
        assert tiered.capabilities == EngineCapabilities(ROLES, kv_exchange=True, background_limit=True, pausing=True)
        with pytest.raises(NotImplementedError):
            plain.connect_kv_peers(None)  # the worker never asks: kv_exchange is False
        assert callable(tiered.connect_kv_peers(Peers(lambda *_: None)))
    finally:
        plain.shutdown()
        tiered.shutdown()
    # vLLM runs every sequence it holds in each step: the batch limit is the worker's pulls alone. Its roles are
    # its KV connector's; the property reads them off the engine, which needs vLLM to build, so a stand-in holds them.
    vllm_caps = VllmEngine.capabilities.fget(SimpleNamespace(_roles=("both", "prefill")))  # type: ignore[attr-defined]
    assert not vllm_caps.background_limit and not vllm_caps.kv_exchange and not vllm_caps.pausing
    assert vllm_caps.roles == ("both", "prefill")
    assert SimulatedEngine.capabilities.fget(None).describe() == "roles both; pausing"  # type: ignore[attr-defined]
    assert tiered.capabilities.describe() == "roles both, prefill, decode; KV exchange; batch limit per step; pausing"


def test_a_worker_refuses_a_role_its_engine_cannot_take():
    from concurrent.futures import ThreadPoolExecutor

    from switchyard.shared.config import SwitchyardConfig, WorkerConfig
    from switchyard.workers.service.worker import Worker
    from switchyard.workers.serving.interface import EngineUnavailable
    from switchyard.workers.simulated_engine import SimulatedEngine

    engine = SimulatedEngine(max_num_seqs=2, tokens_per_s=100)
    with ThreadPoolExecutor(1) as thread:
        config = SwitchyardConfig(worker=WorkerConfig(engine="simulated", role="prefill"))
        with pytest.raises(EngineUnavailable, match="cannot serve as a prefill worker"):
            Worker(engine, config, thread)
        assert Worker(engine, config.model_copy(update={"worker": WorkerConfig(engine="simulated")}), thread)
