"""Fixtures for worker tests: the tiny random Llama (fast, offline) and the real SmolLM2 (``-m model``).

SmolLM2 is pulled once into ``$SWITCHYARD_DATA_DIR/models`` when that is set, else into
``~/.cache/switchyard-test/models``, and reused by later runs (the first pull takes ~30 s).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from itertools import count
from pathlib import Path

import pytest

from switchyard.shared.messages import ChatMessage, GenerateRequest, SamplingParams
from switchyard.workers.model_store import load, pull
from tests.support.system import model_cache_dir
from tests.support.tiny_model import save_tiny_model


@pytest.fixture(scope="session")
def compiled() -> Callable:
    """``compiled(loader, source)``: ``loader()``'s C library; fails the test where a compiler exists but the build
    failed, skips it where the machine has no compiler (the torch fallback is the path there)."""

    def require(loader: Callable, source: str):
        lib = loader()
        if lib is None:
            if shutil.which("gcc") or shutil.which("cc"):
                pytest.fail(f"a C compiler is present but {source} did not build (see the log)")
            pytest.skip("no C compiler on this machine")
        return lib

    return require


@pytest.fixture
def no_installed_build(monkeypatch):
    """As on a machine where the install built no kernels (no compiler then, or another CPU)."""
    from switchyard.workers.executor import kernels

    monkeypatch.setattr(kernels, "installed_library", lambda name: None)
    kernels.load_library.cache_clear()
    yield
    kernels.load_library.cache_clear()


@pytest.fixture
def no_compiler(monkeypatch, tmp_path, no_installed_build) -> Path:
    """No installed kernels and no compiler either; returns the (empty) runtime kernel cache."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("SWITCHYARD_KERNEL_CACHE", str(tmp_path / "kernels"))
    return tmp_path / "kernels"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    """``(model, tokenizer)``: the tiny model in float32 on CPU, so results compare exactly with HF."""
    return load(tiny_model_dir, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return pull("smollm2", model_cache_dir())


@pytest.fixture
def make_request() -> Callable[..., GenerateRequest]:
    """``make_request(prompt=... | messages=[(role, content), ...], request_id=None, **sampling)``."""
    ids = count()

    def make(prompt: str | None = None, messages: list[tuple[str, str]] | None = None,
             request_id: str | None = None, **sampling) -> GenerateRequest:
        return GenerateRequest(
            request_id=request_id or f"req-{next(ids)}",
            model="test",
            tier="pro",
            sampling=SamplingParams(**sampling),
            created_at=0.0,
            deadline_at=0.0,
            prompt=prompt,
            messages=[ChatMessage(role, content) for role, content in messages] if messages is not None else None,
        )

    return make
