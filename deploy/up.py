"""``switchyard up``: the whole system on one machine.

Order: NATS (embedded unless --nats-url) → Postgres (embedded unless --database-url) → migrations → model pull
→ worker → jobs (billing, batches, housekeeping: ``switchyard jobs``) → gateway → ready banner (``LocalSystem``).
Ctrl-C (or SIGTERM) stops everything in reverse order, by PID; a service that exits is started again.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from switchyard.deploy.credentials import write_private
from switchyard.deploy.restarts import Restarter
from switchyard.deploy.system import LocalSystem
from switchyard.jobs.prices import apply_prices
from switchyard.shared.config import ModelEntry, SwitchyardConfig
from switchyard.workers import model_store
from switchyard.workers.service.engines import needs_weights

RUN_FILE = "run.json"


def write_run_file(data_dir: Path, nats_url: str, database_url: str, gateway_url: str | None = None) -> None:
    """Where the running system's servers are, so ops commands (`switchyard tiers ...`, `switchyard top`) find
    them."""
    # It holds the URLs with their credentials: its owner only may read it.
    write_private(data_dir / RUN_FILE, json.dumps({"nats_url": nats_url, "database_url": database_url,
                                                   "gateway_url": gateway_url}))


def read_run_file(data_dir: Path) -> dict:
    try:
        return json.loads((data_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}


KEY_FILE = "default-api-key"


async def _default_key(database_url: str, data_dir: Path) -> str:
    """The default tenant's key: created (and kept, 0600, in the data dir) on the first start, reused after."""
    import asyncpg

    from switchyard.domain.tenancy import ensure_default_tenant

    path = data_dir / KEY_FILE
    conn = await asyncpg.connect(database_url)
    try:
        key = await ensure_default_tenant(conn)
    finally:
        await conn.close()
    if key is not None:
        path.touch(mode=0o600)
        path.write_text(key.secret + "\n")
    return path.read_text().strip() if path.exists() else "<your key: switchyard keys create --tenant default>"


def _banner(base_url: str, model: str, api_key: str, more: Sequence[str] = ()) -> str:
    models = ", ".join([model, *more])
    return f"""
Switchyard is up: {base_url}  (model{"s" if more else ""}: {models})
API key (tenant `default`, also in the data dir's {KEY_FILE}): {api_key}

  curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' -H 'Authorization: Bearer {api_key}' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}], "stream": true}}'

  python -c 'from openai import OpenAI; c = OpenAI(base_url="{base_url}/v1", api_key="{api_key}"); \\
print(c.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hi!"}}]).choices[0].message.content)'

Press Ctrl-C to stop.
"""  # noqa: E501 - the commands are printed whole, to be pasted


def default_models(config: SwitchyardConfig) -> list[ModelEntry]:
    """What ``up`` serves with no model list: the worker's model, and the embedding model unless it is off. Under
    ``--engine vllm`` both run on vLLM (the embedding model on its pooling runner); under any other engine the
    embedding model runs on ours (``embeddings``: the simulated test double embeds nothing)."""
    models = [ModelEntry(model=config.worker.model, served_model_name=config.worker.served_name,
                         aliases=config.worker.aliases, workers=config.workers,
                         prefill_workers=config.prefill_workers, decode_workers=config.decode_workers)]
    if config.embedding_model:
        engine = "vllm" if config.worker.engine == "vllm" else "embeddings"
        models.append(ModelEntry(model=config.embedding_model, engine=engine, max_num_seqs=EMBEDDING_INPUTS_PER_STEP))
    return models


def worker_roles(entry: ModelEntry) -> list[tuple[str, str]]:
    """(role, process name suffix) of each worker ``entry`` runs: its workers of whole requests (``""``, ``-1``,
    ``-2``, ...), or its prefill and decode workers (``-prefill-0``, ``-decode-0``, ...)."""
    if not (entry.prefill_workers or entry.decode_workers):
        return [("both", f"-{i}" if i else "") for i in range(entry.workers)]
    return ([("prefill", f"-prefill-{i}") for i in range(entry.prefill_workers)]
            + [("decode", f"-decode-{i}") for i in range(entry.decode_workers)])


# An embedding worker's step runs up to this many inputs (its max_num_seqs): a batch of 64 in one forward.
EMBEDDING_INPUTS_PER_STEP = 64


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run_up(config: SwitchyardConfig) -> int:
    # Ctrl-C and SIGTERM (systemd, docker stop, kill) both stop everything in order. SIGINT is set explicitly: a
    # shell starts background jobs with it ignored, and Python then never installs its own handler.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    t0 = time.monotonic()
    data = config.data_dir
    models = config.models or default_models(config)  # settings that cannot work are refused before anything starts
    if "vllm" in ({e.engine or config.worker.engine for e in config.models} or {config.worker.engine}):
        from switchyard.workers.vllm_engine.environment import vllm_python

        vllm_python(config.worker)  # where vLLM workers run, or how to install it: said before anything starts
    system = LocalSystem(config)  # the children write to this terminal
    try:
        for line in system.start_servers():
            print(line, file=sys.stderr)
        nats_url, database_url = config.nats_url, config.database_url
        assert nats_url and database_url  # start_servers fills in the servers the settings left out
        write_run_file(data, nats_url, database_url, system.url())
        api_key = asyncio.run(_default_key(database_url, data))
        for line in asyncio.run(apply_prices(database_url, config.models)):
            print(f"price     {line}", file=sys.stderr)
        for entry in models:  # a worker each, or its prefill and decode workers
            engine = entry.engine or config.worker.engine
            path = model_store.resolve(entry.model, config.model_cache_dir) if needs_weights(engine) else entry.model
            name = "worker" if not config.models and entry is models[0] else f"worker-{entry.served_name}"
            for role, suffix in worker_roles(entry):
                system.start_worker(name + suffix, model=str(path),
                                    served_model_name=entry.served_name, aliases=entry.aliases,
                                    max_num_seqs=entry.max_num_seqs or config.worker.max_num_seqs,
                                    engine=engine, role=role)
        system.start_gateway()  # and the jobs beside it, unless gateway.run_jobs is off
        for entry in models:
            system.wait_until_ready(entry.served_name, timeout_s=300)
        print(_banner(system.url(), models[0].served_name, api_key, [m.served_name for m in models[1:]]))
        print(f"(started in {time.monotonic() - t0:.1f} s; data in {data})", file=sys.stderr)
        restarter = Restarter(system.services, lambda line: print(line, file=sys.stderr))
        while True:  # until Ctrl-C; a service that exits is started again
            restarter.poll()
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nstopping...", file=sys.stderr)
        return 0
    finally:
        (data / RUN_FILE).unlink(missing_ok=True)
        system.stop()
