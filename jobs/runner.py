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

from switchyard.gateway.database import Database
from switchyard.gateway.limits import Limiter
from switchyard.gateway.registry import ModelRegistry
from switchyard.gateway.safety import InputSafety
from switchyard.jobs.batch_runner import BatchRunner
from switchyard.jobs.held_writes import run_held_writer
from switchyard.jobs.housekeeping import run_housekeeping
from switchyard.jobs.usage_writer import run_usage_writer

log = logging.getLogger("switchyard.jobs")

STOP_TIMEOUT_S = 5.0  # each job finishes its current record within this on stop
RESTART_BACKOFF_S = (1.0, 30.0)  # a job that failed starts again after 1 s, doubling up to 30 s


class Jobs:
    """The running consumers; ``stop()`` ends them."""

    def __init__(self, nc, js, pool: asyncpg.Pool, registry: ModelRegistry, database_url: str,
                 safety: InputSafety | None = None) -> None:
        """``safety``: the input filter batch lines pass before they are queued (None: none)."""
        self._stop = stop = asyncio.Event()
        runner = BatchRunner(nc, js, pool, registry, database_url, safety)
        self._tasks = [
            asyncio.create_task(self._supervised("usage-writer", lambda: run_usage_writer(js, pool, stop))),
            asyncio.create_task(self._supervised("housekeeping",
                                                 lambda: run_housekeeping(js, Limiter(Database(pool)), stop))),
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
