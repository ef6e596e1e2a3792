"""What the benchmarks that start their own system share: the CPU they print, SmolLM2 from the model cache, a
system on embedded servers in a temp dir, and keys without rate limits (they measure queues, not the limiter)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

MODEL = "smollm2"


def lscpu() -> str:
    """``lscpu``'s report, printed: every benchmark says which CPU its numbers are from."""
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print(text)
    return text


def cpu_name(report: str) -> str:
    return next((ln.split(":", 1)[1].strip() for ln in report.splitlines() if "Model name" in ln), "?")


def local_system(prefix: str, gateway, worker_settings: dict, model: Path | Callable[[Path], Path] | None = None,
                 served_name: str = MODEL):
    """A system on embedded servers in a new temp dir, a worker config with ``worker_settings`` for ``model``
    (default SmolLM2 from the model cache; a callable gets the work dir and returns the model's directory):
    ``(system, config, work_dir)``; the caller starts workers and gateways and removes the dir."""
    from switchyard.deploy.system import LocalSystem
    from switchyard.shared.config import SwitchyardConfig, WorkerConfig

    work = Path(tempfile.mkdtemp(prefix=f"switchyard-{prefix}-"))
    os.chmod(work, 0o755)  # Postgres runs as nobody under root and must enter it
    model = model(work) if callable(model) else model or SwitchyardConfig().model_cache_dir / MODEL
    if not (model / "config.json").exists():
        sys.exit(f"no model at {model}: run `switchyard models pull {MODEL}`")
    config = SwitchyardConfig(data_dir=work, gateway=gateway,
                              worker=WorkerConfig(model=str(model), served_model_name=served_name, **worker_settings))
    return LocalSystem(config, log_dir=work, log_level="WARNING", ephemeral=True), config, work


async def unlimited_keys(database_url: str, tier: str, *tenants: str) -> list[str]:
    """A key each for ``tenants`` (created on ``tier``), after the migrations."""
    from switchyard.migrations import apply_migrations
    from tests.support import system as support

    await apply_migrations(database_url)
    return [await support.make_key(database_url, f"bench-{t}", tier, rpm_limit=2**31 - 1, tpm_limit=2**31 - 1)
            for t in tenants]
