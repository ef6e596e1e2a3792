"""Session-wide real servers: NATS with JetStream (``nats_url``) and PostgreSQL (``database_url``).

Where each server comes from, first match wins:

1. the ``NATS_URL`` / ``DATABASE_URL`` environment variable (CI services, your own servers);
2. testcontainers, when a Docker engine answers (``pip install -e .[containers]``);
3. embedded servers from ``deploy.launcher`` in a temp dir that is removed afterwards.

Embedded servers are stopped by PID in the fixture teardown, which runs even when
tests fail; if pytest itself is killed, they die with it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Triton kernels run interpreted on CPU tensors where there is no GPU. Triton reads this once, when it is first
# imported, by whichever test module comes first: so here, before any of them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from switchyard.deploy.launcher import NatsServer, PostgresServer, docker_available  # noqa: E402
from switchyard.migrations import apply_migrations


@contextlib.contextmanager
def _scratch_dir(name: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=f"switchyard-test-{name}-"))
    try:
        # mkdtemp makes it 0o700; postgres runs as `nobody` under root and must enter it.
        path.chmod(0o755)
        yield path
    finally:
        shutil.rmtree(path)


def _nats_container() -> Iterator[str]:
    from testcontainers.nats import NatsContainer  # optional extra, imported only with Docker

    with NatsContainer().with_command("-js") as container:
        yield container.get_conn_string()


def _postgres_container() -> Iterator[str]:
    from testcontainers.postgres import PostgresContainer  # optional extra

    with PostgresContainer("postgres:17-alpine", dbname="switchyard", driver=None) as container:
        yield container.get_connection_url()


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    """URL of a NATS server with JetStream enabled, shared by the whole session."""
    if url := os.environ.get("NATS_URL"):
        yield url
    elif docker_available():
        yield from _nats_container()
    else:
        with _scratch_dir("nats") as root, NatsServer(root / "nats") as server:
            yield server.url


@pytest.fixture(scope="session")
def _postgres_url() -> Iterator[str]:
    if url := os.environ.get("DATABASE_URL"):
        yield url
    elif docker_available():
        yield from _postgres_container()
    else:
        # PostgresServer chowns its own directory to `nobody` when running as root.
        with _scratch_dir("pg") as root, PostgresServer(root / "pg", ephemeral=True) as server:
            yield server.url


@pytest.fixture(scope="session")
async def database_url(_postgres_url: str) -> str:
    """URL of a PostgreSQL database with all migrations applied, shared by the whole session."""
    await apply_migrations(_postgres_url)
    return _postgres_url


@pytest.fixture
async def pool(database_url: str):
    """A small asyncpg pool on the session's database (a test's own ``pool`` fixture overrides it)."""
    import asyncpg

    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    yield pool
    await pool.close()
