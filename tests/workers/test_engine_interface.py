"""Each engine has every member of the interface the worker serves through, with arguments the worker can pass."""

from __future__ import annotations

import inspect

import pytest

from switchyard.workers.engine.engine import Engine
from switchyard.workers.engine.interface import ServingEngine
from switchyard.workers.vllm_engine.engine import VllmEngine  # readable without vLLM: it imports it when built


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
