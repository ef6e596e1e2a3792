"""`switchyard up` starts an exited service again, backing off on a crash loop (real child processes, a fake
clock for the backoff)."""

from __future__ import annotations

import time

from switchyard.deploy.restarts import HEALTHY_AFTER_S, Restarter
from switchyard.deploy.services import ServiceProcess


def _exited(svc: ServiceProcess) -> None:
    deadline = time.monotonic() + 60
    while svc.is_running():
        assert time.monotonic() < deadline, f"{svc.name} did not exit"
        time.sleep(0.05)


def test_an_exited_service_is_started_again_with_a_growing_backoff_reset_once_healthy():
    # `switchyard migrate` without a database exits at once with status 2: a service in a crash loop.
    svc = ServiceProcess("flaky", ["migrate"], env={"SWITCHYARD_DATABASE_URL": ""}).start()
    now = [0.0]
    said: list[str] = []
    restarter = Restarter([svc], said.append, clock=lambda: now[0])
    try:
        _exited(svc)
        restarter.poll()
        assert said == ["flaky exited (status 2); starting it again in 1 s"] and restarter.num_restarts == 0
        now[0] = 0.9
        restarter.poll()
        assert restarter.num_restarts == 0
        now[0] = 1.0
        restarter.poll()
        assert restarter.num_restarts == 1 and said[-1].startswith("flaky started again")
        _exited(svc)
        restarter.poll()
        assert said[-1] == "flaky exited (status 2); starting it again in 2 s"  # doubled
        now[0] = 3.0
        restarter.poll()
        assert restarter.num_restarts == 2
        _exited(svc)
        now[0] = 3.0 + HEALTHY_AFTER_S  # it "ran" a minute: healthy again, the backoff starts over
        restarter.poll()
        assert said[-1] == "flaky exited (status 2); starting it again in 1 s"
    finally:
        svc.stop()
