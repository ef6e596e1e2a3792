"""Real NATS and PostgreSQL servers started and stopped by deploy.launcher."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import asyncpg
import nats
import pytest
from nats.js.api import StreamConfig

from switchyard.deploy.launcher import NatsServer, PostgresServer, ServerStartError, docker_available
from tests.support.system import free_port


@pytest.fixture
def server_dir():
    # Not pytest's tmp_path: that lives under a 0o700 dir `nobody` cannot enter, and is kept.
    path = Path(tempfile.mkdtemp(prefix="switchyard-test-launcher-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)



def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat fields after the command name (state first), or None once the pid is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot): with the pid, it names one process, not a reused pid."""
    fields = _stat(pid)
    return None if fields is None else fields[19]


def _running(pid: int, started: str | None = None) -> bool:
    """True while ``pid`` exists and is not a zombie (an orphan's zombie waits for init); with ``started``, only
    while it is still the process that started then."""
    fields = _stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return started is None or fields[19] == started


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found.append(int(entry.name))
    return found


def _wait_gone(pids: list[int], timeout: float = 10.0, started: dict[int, str | None] | None = None) -> list[int]:
    """Poll until every pid has exited; return those still running at the deadline (``started``: their start
    times, so that a pid reused meanwhile does not count)."""
    started = started or {}
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if _running(p, started.get(p))]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return alive


def _accepts(url_port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", url_port), timeout=1).close()
        return True
    except OSError:
        return False


# --- NATS -------------------------------------------------------------------------------


async def test_nats_runs_jetstream_with_file_storage(server_dir):
    with NatsServer(server_dir / "nats") as server:
        assert server.url.startswith("nats://127.0.0.1:")
        nc = await nats.connect(server.url)
        try:
            js = nc.jetstream()
            await js.add_stream(StreamConfig(name="LAUNCHER", subjects=["launcher.>"]))
            ack = await js.publish("launcher.ping", b"hello")
            assert (ack.stream, ack.seq) == ("LAUNCHER", 1)
            info = await js.stream_info("LAUNCHER")
            assert info.state.messages == 1
            assert (await js.get_msg("LAUNCHER", 1)).data == b"hello"
        finally:
            await nc.close()
        assert (server_dir / "nats" / "jetstream").is_dir()
        pid, port = server.pid, int(server.url.rsplit(":", 1)[1])
    assert not _running(pid)
    assert not _accepts(port)
    assert "Server Exiting" in (server_dir / "nats" / "nats-server.log").read_text()


def test_nats_fixed_port(server_dir):
    port = free_port()
    with NatsServer(server_dir / "nats", port=port) as server:
        assert server.url == f"nats://127.0.0.1:{port}"
        assert _accepts(port)


def test_nats_start_failure_reports_log(server_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = NatsServer(server_dir / "nats", port=taken.getsockname()[1], startup_timeout=5)
        with pytest.raises(ServerStartError, match="(?i)address already in use"):
            server.start()
    with pytest.raises(RuntimeError, match="not started"):
        _ = server.pid


async def test_nats_restart_keeps_streams(server_dir):
    server = NatsServer(server_dir / "nats")
    with server:
        nc = await nats.connect(server.url)
        await nc.jetstream().add_stream(StreamConfig(name="KEPT", subjects=["kept"]))
        await nc.jetstream().publish("kept", b"1")
        await nc.close()
        first_pid = server.pid
    server.stop()  # idempotent
    assert not _running(first_pid)

    with server:  # same object, same store dir
        assert server.pid != first_pid
        nc = await nats.connect(server.url)
        try:
            assert (await nc.jetstream().stream_info("KEPT")).state.messages == 1
        finally:
            await nc.close()


# --- PostgreSQL -------------------------------------------------------------------------


async def test_postgres_answers_queries_and_owns_its_data_dir(server_dir):
    with PostgresServer(server_dir / "pg", ephemeral=True) as server:
        assert server.url.startswith("postgresql://postgres@127.0.0.1:")
        assert server.url.endswith("/switchyard")
        conn = await asyncpg.connect(server.url)
        try:
            assert await conn.fetchval("SELECT current_database()") == "switchyard"
            assert await conn.fetchval("SELECT 6 * 7") == 42
            assert await conn.fetchval("SHOW fsync") == "off"
        finally:
            await conn.close()
        if os.geteuid() == 0:
            assert Path(f"/proc/{server.pid}").stat().st_uid == pwd.getpwnam("nobody").pw_uid
        with pytest.raises(ServerStartError, match=f"running postgres \\(pid {server.pid}\\)"):
            PostgresServer(server_dir / "pg", ephemeral=True).start()
        pid, workers = server.pid, _children(server.pid)
    assert workers, "postmaster should have auxiliary processes"
    assert _wait_gone([pid, *workers]) == []


async def test_postgres_keeps_data_across_restarts(server_dir):
    with PostgresServer(server_dir / "pg") as server:
        conn = await asyncpg.connect(server.url)
        await conn.execute("CREATE TABLE kept (n int)")
        await conn.executemany("INSERT INTO kept VALUES ($1)", [(1,), (2,), (3,)])
        await conn.close()
    version_file = server_dir / "pg" / "data" / "PG_VERSION"
    initialised_at = version_file.stat().st_mtime_ns

    with PostgresServer(server_dir / "pg") as server:
        conn = await asyncpg.connect(server.url)
        try:
            assert await conn.fetchval("SELECT sum(n) FROM kept") == 6
            assert await conn.fetchval("SHOW fsync") == "on"
        finally:
            await conn.close()
    assert version_file.stat().st_mtime_ns == initialised_at  # no second initdb


async def test_postgres_restarts_after_being_killed(server_dir):
    server = PostgresServer(server_dir / "pg", ephemeral=True).start()
    conn = await asyncpg.connect(server.url)
    # Ephemeral mode commits asynchronously; this one commit must reach the WAL file (the OS
    # page cache is enough: only the server process dies) so recovery has something to replay.
    await conn.execute("SET synchronous_commit = on")
    await conn.execute("CREATE TABLE survived AS SELECT 1 AS n")
    await conn.close()
    pid, workers = server.pid, _children(server.pid)
    os.kill(pid, signal.SIGKILL)
    server.stop()  # reaps the dead postmaster
    lock = server_dir / "pg" / "data" / "postmaster.pid"
    assert lock.exists()  # stale lock left behind
    # Worst case after a crash: the lock's PID now belongs to an unrelated live process of
    # the server's own user (postgres itself treats other users' processes as stale).
    as_server_user = {"user": "nobody"} if os.geteuid() == 0 else {}
    stranger = subprocess.Popen(["sleep", "60"], **as_server_user)
    try:
        _, rest = lock.read_text().split("\n", 1)
        lock.write_text(f"{stranger.pid}\n{rest}")
        with PostgresServer(server_dir / "pg", ephemeral=True) as again:
            conn = await asyncpg.connect(again.url)
            try:
                assert await conn.fetchval("SELECT n FROM survived") == 1
            finally:
                await conn.close()
    finally:
        stranger.kill()
        stranger.wait()
    assert _wait_gone(workers) == []  # orphaned workers noticed their postmaster died


# --- both -------------------------------------------------------------------------------

_OWNER = """
import sys
from switchyard.deploy.launcher import NatsServer, PostgresServer
nats = NatsServer(sys.argv[1] + "/nats").start()
pg = PostgresServer(sys.argv[1] + "/pg", ephemeral=True).start()
print(nats.pid, pg.pid, flush=True)
sys.stdin.read()  # hold the servers until killed
"""


def test_servers_die_with_their_parent(server_dir):
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(server_dir)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    started: dict[int, str | None] = {}
    try:
        line = owner.stdout.readline()
        assert line, f"owner process failed (exit {owner.wait()})"
        pids = [int(p) for p in line.split()]
        pids += _children(pids[1])
        started = {pid: _start_time(pid) for pid in pids}
        owner.kill()  # SIGKILL: no cleanup code of the owner runs
        owner.wait()
        assert _wait_gone(pids, started=started) == []
    finally:
        owner.kill()
        owner.wait()
        owner.stdin.close()
        owner.stdout.close()
        for pid in pids:  # don't leak servers when the assertion above failed
            if _running(pid, started.get(pid)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_docker_available_without_docker():
    if importlib.util.find_spec("docker") is not None:
        pytest.skip("docker package installed: the answer depends on the engine")
    assert docker_available() is False


async def test_session_nats_fixture_has_jetstream(nats_url):
    nc = await nats.connect(nats_url)
    try:
        info = await nc.jetstream().account_info()
        assert info.limits is not None
    finally:
        await nc.close()


def test_as_root_postgres_runs_from_binaries_its_user_can_reach(server_dir):
    from switchyard.deploy.postgres_install import _searchable_by_all

    private = Path(tempfile.mkdtemp())  # 0700, like `mktemp -d` around a CI checkout
    try:
        assert not _searchable_by_all(private)
    finally:
        private.rmdir()
    if os.geteuid() != 0:
        pytest.skip("postgres runs as the current user: nothing to reach")
    assert _searchable_by_all(PostgresServer(server_dir / "pg").bin_dir() / "postgres")
