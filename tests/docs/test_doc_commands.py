"""Every block of README.md and docs/ marked ``<!-- runs-here -->`` runs against a live system, so a page cannot
drift from the code: one test per block, named by its file and line.

The system is the end-to-end tests' (``LocalSystem`` on the session's NATS and a Postgres database of its own)
serving what ``make up`` serves: a gateway, its jobs, a worker of the real SmolLM2 as ``smollm2`` and one of the
embedding model ``all-minilm-l6-v2``. A bash block runs under
``set -euo pipefail`` with ``$KEY`` (a pro-tier tenant's key) and ``$ADMIN_KEY``; ``switchyard ...`` reaches this
system's NATS and Postgres through ``SWITCHYARD_*`` variables and its run file, as it reaches a running
``switchyard up``. A python block runs with ``KEY`` and ``BASE_URL`` defined. ``http://127.0.0.1:8000`` in a block
is the live gateway's address.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from switchyard.deploy.system import LocalSystem
from switchyard.deploy.up import EMBEDDING_INPUTS_PER_STEP, write_run_file
from switchyard.migrations import apply_migrations
from switchyard.shared.config import GatewayConfig, SwitchyardConfig, WorkerConfig
from switchyard.workers.model_store import pull
from tests.docs.marked_blocks import MARKER, all_marked_blocks
from tests.support.databases import own_database
from tests.support.system import free_port, make_key, model_cache_dir

DOCUMENTED_GATEWAY = "http://127.0.0.1:8000"
ADMIN_KEY = "docs-admin-key"
BLOCK_TIMEOUT_S = 180
BLOCKS = all_marked_blocks()


def test_the_docs_mark_blocks_to_run():
    """No marked block at all means the marker rotted away (renamed, or every block lost it), not that the docs
    are right: fail rather than run nothing."""
    assert BLOCKS, f"no fenced block in README.md or docs/ is preceded by {MARKER}"
    assert any(block.path == "README.md" for block in BLOCKS), "the README's tour is not run"
    unknown = [block.name for block in BLOCKS if block.lang not in ("bash", "python")]
    assert not unknown, f"marked blocks in a language this test cannot run: {unknown}"


@pytest.fixture(scope="module")
async def docs_database_url(_postgres_url: str):
    """A migrated database of this module's own on the session's server: the blocks' tenants and keys stay in it."""
    async with own_database(_postgres_url, "docs") as url:
        await apply_migrations(url)
        yield url


@pytest.fixture(scope="module")
def live(nats_url: str, docs_database_url: str):
    """The running system: a worker serving SmolLM2 as ``smollm2``, one serving the embedding model, a gateway and
    its jobs."""
    model_dir, embedding_dir = pull("smollm2", model_cache_dir()), pull("all-minilm-l6-v2", model_cache_dir())
    work = Path(tempfile.mkdtemp(prefix="switchyard-docs-"))
    config = SwitchyardConfig(
        data_dir=work, nats_url=nats_url, database_url=docs_database_url,
        gateway=GatewayConfig(port=free_port(), admin_key=ADMIN_KEY),
        worker=WorkerConfig(model=str(model_dir), served_model_name="smollm2", dtype="float32", max_num_seqs=4))
    system = LocalSystem(config, log_dir=work, log_level="WARNING")
    try:
        system.start_worker()
        system.start_worker("worker-embeddings", model=str(embedding_dir), served_model_name="all-minilm-l6-v2",
                            engine="embeddings", max_num_seqs=EMBEDDING_INPUTS_PER_STEP)
        system.start_gateway()
        for model in ("smollm2", "all-minilm-l6-v2"):
            system.wait_until_ready(model, timeout_s=300)
        # What `switchyard up` leaves for the ops commands (`switchyard top` finds the gateway in it).
        write_run_file(work, nats_url, docs_database_url, system.url())
        yield system
    finally:
        system.stop()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
async def key(docs_database_url: str) -> str:
    """A key of the pro-tier tenant ``docs-reader``."""
    return await make_key(docs_database_url, "docs-reader", "pro")


def _environment(system: LocalSystem, key: str) -> dict[str, str]:
    config = system.config
    env = {name: value for name, value in os.environ.items() if not name.startswith("SWITCHYARD_")}
    return env | {
        "KEY": key, "ADMIN_KEY": ADMIN_KEY,
        "SWITCHYARD_NATS_URL": config.nats_url, "SWITCHYARD_DATABASE_URL": config.database_url,
        "SWITCHYARD_DATA_DIR": str(config.data_dir),
        # The `openai` client and `switchyard batch` default to these.
        "OPENAI_API_KEY": key, "OPENAI_BASE_URL": f"{system.url()}/v1",
        # `switchyard` is this environment's.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    }


def _printed_text(stdout: str) -> str:
    """The text a chat block printed: a printed completion counts by its generated text (the deltas of an SSE
    stream, a JSON body's messages), anything else as it is (the reply the `openai` client printed)."""
    events = [line[len("data: "):] for line in stdout.splitlines() if line.startswith("data: {")]
    if events:
        return "".join(choice.get("delta", {}).get("content") or choice.get("text") or ""
                       for event in events for choice in json.loads(event).get("choices", []))
    try:
        body = json.loads(stdout)
    except ValueError:
        return stdout
    if not (isinstance(body, dict) and isinstance(body.get("choices"), list)):
        return stdout
    return "".join((choice.get("message") or {}).get("content") or choice.get("text") or ""
                   for choice in body["choices"])


@pytest.mark.model
@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.name)
def test_documented_block_runs(block, live: LocalSystem, key: str, tmp_path: Path):
    code = block.code.replace(DOCUMENTED_GATEWAY, live.url())
    if block.lang == "bash":
        command = ["bash", "-c", "set -euo pipefail\n" + code]
    else:
        script = tmp_path / "block.py"
        script.write_text(f"KEY = {key!r}\nBASE_URL = {live.url() + '/v1'!r}\n" + code)
        command = [sys.executable, str(script)]
    done = subprocess.run(command, cwd=tmp_path, env=_environment(live, key), capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT_S)
    said = (f"{block.name} exited {done.returncode}\n--- stdout\n{done.stdout[-3000:]}\n"
            f"--- stderr\n{done.stderr[-3000:]}")
    if done.returncode != 0:
        logs = "\n".join(f"--- {svc.name} log\n{svc.log_tail(15)}" for svc in live.services)
        pytest.fail(f"{said}\n{logs}")
    if "chat/completions" in code or "chat.completions" in code:
        assert _printed_text(done.stdout).strip(), f"a chat block printed no generated text\n{said}"
