"""Every structure on ``switchyard:tenant_state_entries`` has its line in the metrics reference (what it holds an
entry per, and what forgets it), and the reference names no structure the code does not report."""

from __future__ import annotations

import re
import time
from pathlib import Path
from types import SimpleNamespace

from switchyard.domain.admission.budget import MonthlyBudget
from switchyard.domain.admission.concurrency import Concurrency
from switchyard.domain.admission.rate_limits import RateLimits
from switchyard.domain.auth import Authenticator
from switchyard.domain.database import Database
from switchyard.domain.limits import Limiter
from switchyard.gateway.affinity import AffinityIndex
from switchyard.gateway.gatekeeper import FailedKeys
from switchyard.gateway.kv_index import KVIndex
from switchyard.gateway.refused_bodies import RefusedBytes
from switchyard.workers.service.intake import Intake
from switchyard.workers.service.stream_replay import StreamReplays

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| `([a-z_]+)` \| (gateway|worker|gateway, jobs) \|", re.MULTILINE)


def documented() -> dict[str, str]:
    """structure -> process, from the reference's tenant state table."""
    text = (ROOT / "docs" / "operating" / "metrics.md").read_text()
    section = text[text.index("## Tenant state"):]
    section = section[:section.index("\n## ", 1)]
    return dict(ROW.findall(section))


def reported() -> dict[str, str]:
    """structure -> process, from every owner the gateway and the worker watch (gateway/services.py, the
    middleware, workers/service/worker.py)."""
    db = Database(SimpleNamespace(get_max_size=lambda: 1))
    gateway = [Authenticator(db), MonthlyBudget(db), RateLimits(Limiter(db), None), Concurrency(db, None), db,
               FailedKeys(1), RefusedBytes(1), AffinityIndex(None), KVIndex()]
    intake = Intake(None, SimpleNamespace(new_inbox=lambda: "_INBOX.test"), None, "m", "w", held=None, capacity=None,
                    out=None)
    intake.shutdown()
    worker = [intake, StreamReplays("w", time.monotonic())]
    names = {name: "gateway" for owner in gateway for name in owner.tenant_state()}
    names |= {name: "worker" for owner in worker for name in owner.tenant_state()}
    names["budget_readings"] = "gateway, jobs"  # the jobs' admission has a budget too, on no metrics port
    return names


def test_every_structure_reported_is_documented_and_only_those():
    assert documented() == reported()
