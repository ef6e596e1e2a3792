"""The durable consumers as one unit: started beside the HTTP app by ``switchyard gateway`` (unless
``gateway.run_jobs`` is off) or alone by ``switchyard jobs``.

Every copy may run: the billing writer's inserts are idempotent per request id, housekeeping is idempotent, and
only the holder of a Postgres advisory lock runs batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import asyncpg

from switchyard.gateway.limits import Limiter
from switchyard.gateway.registry import ModelRegistry
from switchyard.jobs.batch_runner import BatchRunner
from switchyard.jobs.housekeeping import run_housekeeping
from switchyard.jobs.usage_writer import run_usage_writer

log = logging.getLogger("switchyard.jobs")

STOP_TIMEOUT_S = 5.0  # each job finishes its current record within this on stop


class Jobs:
    """The running consumers; ``stop()`` ends them."""

    def __init__(self, nc, js, pool: asyncpg.Pool, registry: ModelRegistry, database_url: str) -> None:
        self._stop = asyncio.Event()
        self._tasks = [
            asyncio.create_task(run_usage_writer(js, pool, self._stop), name="usage-writer"),
            asyncio.create_task(run_housekeeping(js, Limiter(pool), self._stop), name="housekeeping"),
            asyncio.create_task(BatchRunner(nc, js, pool, registry, database_url).run(self._stop),
                                name="batch-runner"),
        ]

    async def wait(self) -> None:
        """Until every job has ended (after ``stop()``, or one failing for good)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def stop(self) -> None:
        self._stop.set()
        for task in self._tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, timeout=STOP_TIMEOUT_S)
