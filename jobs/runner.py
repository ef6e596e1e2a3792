"""The durable consumers as one unit, with the connections and domain services they need (``running_jobs``):
run alone by ``switchyard jobs`` (a child of ``switchyard up``), or beside the HTTP app by ``switchyard gateway``
unless ``--no-jobs``.

Every copy may run: the billing writer's inserts are idempotent per request id, housekeeping is idempotent, and
only the holder of a Postgres advisory lock runs batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import asyncpg

from switchyard.domain.admission.pipeline import Pipeline
from switchyard.domain.admission.policies import admission_pipeline
from switchyard.domain.admission.routing import Router
from switchyard.domain.admission.safety import InputSafety
from switchyard.domain.database import Database, keep_session
from switchyard.domain.limits import Limiter
from switchyard.domain.registry import ModelRegistry
from switchyard.jobs.batch_runner import BatchRunner
from switchyard.jobs.held_writes import run_held_writer
from switchyard.jobs.housekeeping import run_housekeeping
from switchyard.jobs.usage_writer import run_usage_writer
from switchyard.shared import nats_client
from switchyard.shared.config import RequestLimits, SwitchyardConfig
from switchyard.shared.jetstream import ensure_streams
from switchyard.shared.tier_store import PolicyCache

log = logging.getLogger("switchyard.jobs")

STOP_TIMEOUT_S = 5.0  # each job finishes its current record within this on stop
RESTART_BACKOFF_S = (1.0, 30.0)  # a job that failed starts again after 1 s, doubling up to 30 s


class Jobs:
    """The running consumers; ``stop()`` ends them."""

    def __init__(self, nc, js, pool: asyncpg.Pool, registry: ModelRegistry, database_url: str,
                 admission: Pipeline | None = None, limits: RequestLimits | None = None) -> None:
        """``admission``: what batches and their lines pass before they are queued (None: nothing); ``limits``:
        what each batch line may ask for."""
        self._stop = stop = asyncio.Event()
        runner = BatchRunner(nc, js, pool, registry, database_url, admission, limits)
        self._tasks = [
            asyncio.create_task(self._supervised("usage-writer", lambda: run_usage_writer(js, pool, stop))),
            asyncio.create_task(self._supervised("housekeeping",
                                                 lambda: run_housekeeping(js, Limiter(Database(pool)), stop, pool))),
            asyncio.create_task(self._supervised("batch-runner", lambda: runner.run(stop))),
            asyncio.create_task(self._supervised("held-writer", lambda: run_held_writer(js, pool, stop))),
        ]

    async def _supervised(self, name: str, start) -> None:
        """Run ``start()`` until stop; a job that raises is logged and started again after a backoff, so no
        consumer dies quietly and a bad moment (NATS away at start, a bug on one record) is not fatal."""
        backoff = RESTART_BACKOFF_S[0]
        while not self._stop.is_set():
            try:
                await start()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("job %s failed; starting it again in %.0f s", name, backoff)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), backoff)
            backoff = min(backoff * 2, RESTART_BACKOFF_S[1])

    async def wait(self) -> None:
        """Until every job has ended (after ``stop()``, or one failing for good)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def stop(self) -> None:
        self._stop.set()
        for task in self._tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, timeout=STOP_TIMEOUT_S)


@contextlib.asynccontextmanager
async def running_jobs(config: SwitchyardConfig) -> AsyncIterator[Jobs]:
    """The jobs, on connections of their own (NATS as ``switchyard-jobs``, a Postgres pool), until the block ends;
    then each finishes its record and the connections close."""
    # Both are checked before: by `switchyard jobs` (cli/serve.py), or by the gateway's services beside them.
    nats_url, database_url = config.nats_url, config.database_url
    assert nats_url and database_url, "the jobs need nats_url and database_url"
    nc = await nats_client.connect(nats_url, "switchyard-jobs", tls_ca=config.nats_tls_ca)
    js = nc.jetstream()
    pool = None
    try:
        await ensure_streams(js, config.nats_replicas)
        # No reset on release, as the gateway's pool (domain/database.connect): the jobs keep no session state on
        # pooled connections (the batch leader's lock has a connection of its own), and the usage writer releases
        # one per record billed. Statements are not bounded as the gateway's are: a batch's lines go in at length.
        pool = await asyncpg.create_pool(database_url, min_size=1, max_size=6,  # + validations (batches)
                                         reset=keep_session)
        registry = ModelRegistry(nc)
        db = Database(pool)
        # The same admission as the gateway's (batches and their lines pass the policies that judge them).
        admission = admission_pipeline(db=db, registry=registry, router=Router(registry, config.gateway),
                                       tier_policies=PolicyCache(js), safety=InputSafety(config.gateway.safety))
        jobs = Jobs(nc, js, pool, registry, database_url, admission, config.gateway.limits)
        try:
            yield jobs
        finally:  # Ctrl-C / SIGTERM cancel the wait: let each job finish its record
            await jobs.stop()
    finally:
        if pool is not None:
            await pool.close()
        await nc.close()
