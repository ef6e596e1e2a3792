"""A durable consumer that fails is started again (with a backoff), never left dead."""

from __future__ import annotations

import asyncio

from switchyard.jobs import runner
from switchyard.jobs.runner import Jobs


async def test_a_failing_job_is_started_again_until_it_runs(monkeypatch, caplog):
    monkeypatch.setattr(runner, "RESTART_BACKOFF_S", (0.01, 0.02))
    jobs = Jobs.__new__(Jobs)  # only the supervision: no NATS, no Postgres
    jobs._stop = asyncio.Event()
    starts = []

    async def job() -> None:
        starts.append(1)
        if len(starts) < 3:
            raise RuntimeError(f"failure {len(starts)}")
        await jobs._stop.wait()  # the third start runs until stopped

    task = asyncio.create_task(jobs._supervised("flaky", job))
    while len(starts) < 3:
        await asyncio.sleep(0.01)
    assert not task.done()
    jobs._stop.set()
    await asyncio.wait_for(task, 5)
    assert len(starts) == 3
    assert caplog.text.count("job flaky failed; starting it again") == 2
