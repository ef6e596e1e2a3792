"""The whole system on this machine, started one way for ``switchyard up``, the end-to-end tests and the benchmarks.

    NATS, Postgres   embedded (in the data dir) unless the settings name servers, then migrations; embedded ones
                     require the generated credentials of deploy/credentials.py (a NATS user per role; the
                     services use Postgres as switchyard_app, deploy/db_roles.py, the superuser migrates)
    workers          ``switchyard worker`` children
    gateways         ``switchyard gateway`` children, HTTP only
    jobs             one ``switchyard jobs`` child beside the first gateway (billing, batches, housekeeping), unless
                     the gateway settings say ``run_jobs=False`` (they run elsewhere)

Every child is handed the settings object itself (as ``SWITCHYARD_*`` variables, see ``settings_env``), with the
overrides it was started with, so whatever the caller set reaches it. ``stop()`` (or leaving the ``with``) stops
everything by PID, the last started first.
"""

from __future__ import annotations

import asyncio
import getpass
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from switchyard.deploy.credentials import (
    NATS_CONFIG_FILE,
    load_or_create,
    redacted,
    with_credentials,
    write_nats_config,
)
from switchyard.deploy.db_roles import APP_ROLE, ensure_app_role
from switchyard.deploy.launcher import NatsServer, PostgresServer
from switchyard.deploy.services import ServiceProcess, wait_until_ready
from switchyard.migrations import apply_migrations
from switchyard.shared.config import SwitchyardConfig, settings_env

# The NATS user each command connects as (deploy/credentials.py): the jobs publish what the gateway's role may.
_NATS_ROLES = {"gateway": "gateway", "jobs": "gateway", "worker": "worker"}


class LocalSystem:
    """See the module docstring. ``log_dir``: children log to ``<log_dir>/<name>.log`` (default: the terminal)."""

    def __init__(self, config: SwitchyardConfig, log_dir: Path | None = None, log_level: str | None = None,
                 ephemeral: bool = False) -> None:
        """``ephemeral``: an embedded Postgres without durability (tests and benchmarks)."""
        self.config = config
        self.log_dir = log_dir
        self.log_level = log_level
        self.ephemeral = ephemeral
        self.services: list[ServiceProcess] = []
        self._role_nats_urls: dict[str, str] = {}  # embedded NATS: each command's URL, with its role's user
        self._app_database_url: str | None = None  # embedded Postgres: the services' role (not the superuser)
        self._stack: list = []  # everything started, servers and services, in start order
        # The embedded servers, once start_servers has started them (None: the settings named one elsewhere).
        self.nats: NatsServer | None = None
        self.postgres: PostgresServer | None = None
        self._jobs: ServiceProcess | None = None
        self._kv_host_dir: Path | None = None  # the workers' host KV tier (tmpfs), made on the first worker's start

    def __enter__(self) -> LocalSystem:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # -- starting -------------------------------------------------------------------------------------------------
    def start_servers(self) -> list[str]:
        """Embedded NATS and Postgres where the settings name none (their URLs go into the settings), then the
        migrations; returns what happened, a line each, for the caller to show."""
        config, data, said = self.config, self.config.data_dir, []
        data.mkdir(parents=True, exist_ok=True)
        creds = load_or_create(data) if not (config.nats_url and config.database_url) else None
        if not config.nats_url:
            assert creds is not None  # loaded above for every embedded server
            auth = write_nats_config(data / NATS_CONFIG_FILE, creds, config.nats_tls_cert, config.nats_tls_key)
            nats = self.nats = self._started(NatsServer(data / "nats", extra_args=["-c", str(auth)]))
            scheme = "tls" if config.nats_tls_cert else None
            self._role_nats_urls = {role: with_credentials(nats.url, role, creds.nats_passwords[role], scheme)
                                    for role in ("gateway", "worker")}
            config.nats_url = with_credentials(nats.url, "admin", creds.nats_passwords["admin"], scheme)
            said.append(f"nats      {nats.url} (pid {nats.pid}; a user per role, see {NATS_CONFIG_FILE})")
        embedded_pg = not config.database_url
        if embedded_pg:
            assert creds is not None  # loaded above for every embedded server
            pg = self.postgres = self._started(PostgresServer(data / "postgres", ephemeral=self.ephemeral,
                                              password=creds.postgres_password))
            config.database_url = pg.url
            said.append(f"postgres  {redacted(pg.url)} (pid {pg.pid})")
        database_url = config.database_url
        assert database_url  # the settings named a server, or the embedded one just started
        applied = asyncio.run(apply_migrations(database_url))
        said.append(f"migrate   {', '.join(applied) if applied else 'up to date'}")
        if creds is not None and embedded_pg:  # the services connect as a role that can touch rows only
            self._app_database_url = asyncio.run(ensure_app_role(database_url, creds.app_password))
            said.append(f"postgres  services as {APP_ROLE}; migrations as the superuser")
        return said

    def start_worker(self, name: str = "worker", **settings) -> ServiceProcess:
        """A worker with the system's worker settings, ``settings`` overriding some of them. Its host KV tier is
        the system's own (shared by its workers, removed when the system stops) unless the settings place it."""
        worker = self.config.worker.model_copy(update=settings)
        if worker.kv_offload_host_dir is None:
            worker = worker.model_copy(update={"kv_offload_host_dir": self._host_tier_dir()})
        return self._start_service(name, "worker", {"worker": worker})

    def _host_tier_dir(self) -> Path:
        if self._kv_host_dir is None:
            digest = hashlib.blake2b(str(self.config.data_dir.resolve()).encode(), digest_size=6).hexdigest()
            shm = Path("/dev/shm")
            self._kv_host_dir = (shm if shm.is_dir() else Path(tempfile.gettempdir())) / f"switchyard-{digest}"
            self._stack.append(_RemovedAtStop(self._kv_host_dir))
        return self._kv_host_dir

    def start_gateway(self, name: str = "gateway", **settings) -> ServiceProcess:
        """A gateway with the system's gateway settings, ``settings`` overriding some (a second one needs
        another ``port``); with ``run_jobs`` (the default) the system's jobs start beside it, once."""
        gateway = self.config.gateway.model_copy(update=settings)
        if gateway.run_jobs and self._jobs is None:
            self.start_jobs(**settings)
        # The gateway process itself never hosts them: they are the jobs child's. Several processes on one port
        # (``processes``) each bind it with SO_REUSEPORT.
        several = {"reuse_port": True} if gateway.processes > 1 else {}
        first = self._start_service(name, "gateway", {"gateway": gateway.model_copy(update={"run_jobs": False,
                                                                                              **several})})
        for number in range(2, gateway.processes + 1):
            self._start_service(f"{name}-{number}", "gateway",
                                {"gateway": gateway.model_copy(update={"run_jobs": False, **several})})
        return first

    def start_jobs(self, name: str = "jobs", **settings) -> ServiceProcess:
        """The durable consumers (billing writer, batch runner, housekeeping), as a ``switchyard jobs`` child, with
        the system's gateway settings (their input filter's, ...), ``settings`` overriding some."""
        gateway = self.config.gateway.model_copy(update=settings)
        self._jobs = self._start_service(name, "jobs", {"gateway": gateway})
        return self._jobs

    def pids(self) -> dict[str, int]:
        """Every process started and not yet stopped, by name: ``nats`` and ``postgres`` where embedded, then each
        service's (``gateway``, ``worker``, ...)."""
        servers = {"nats": self.nats, "postgres": self.postgres}
        return ({name: server.pid for name, server in servers.items() if server is not None}
                | {service.name: service.pid for service in self.services})

    def url(self, port: int | None = None) -> str:
        """The base URL of the gateway on ``port`` (default: the settings')."""
        return f"http://{self.config.gateway.host}:{port or self.config.gateway.port}"

    def wait_until_ready(self, model: str | None, timeout_s: float = 300, port: int | None = None) -> None:
        """Until the gateway (on ``port``, default the settings') serves ``model``; fails fast if a child died."""
        wait_until_ready(self.url(port), model, timeout_s, watch=self.services)

    def restart_server(self, which: str, down_s: float = 0.0) -> None:
        """Stop the embedded ``nats`` or ``postgres`` and start it again after ``down_s`` on the same port and
        data: a fault the benchmarks inject (the services must reconnect by themselves)."""
        server = {"nats": self.nats, "postgres": self.postgres}[which]
        if server is None or server.url is None:
            raise RuntimeError(f"no embedded {which} runs")
        server.port = urlsplit(server.url).port  # a server that picked its port keeps it
        server.stop()
        time.sleep(down_s)
        server.start()

    # -- stopping -------------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop everything, the last started first; a failure to stop one does not keep the others running."""
        while self._stack:
            item = self._stack.pop()
            try:
                item.stop()
            except Exception as exc:  # leaving a server behind is worse than a noisy stop
                print(f"could not stop {item}: {exc}", file=sys.stderr)
        self.services.clear()
        self._jobs = self.nats = self.postgres = None
        self._kv_host_dir = None

    def _started(self, item):
        self._stack.append(item)  # before start(): a half-started server is stopped too
        return item.start()

    def _start_service(self, name: str, command: str, section: dict) -> ServiceProcess:
        args = [command] + (["--log-level", self.log_level] if self.log_level else [])
        log_path = self.log_dir / f"{name}.log" if self.log_dir else None
        role = _NATS_ROLES[command]
        if role in self._role_nats_urls:
            section = {**section, "nats_url": self._role_nats_urls[role]}
        if self._app_database_url is not None:  # workers need no database at all
            section = {**section, "database_url": "" if command == "worker" else self._app_database_url}
        config = self.config.model_copy(update=section)
        env = settings_env(config)
        # The gateway's or the worker's drain; the jobs finish their record within seconds.
        drain_s = {"worker": config.worker.drain_timeout_s, "gateway": config.gateway.drain_timeout_s}.get(command, 10)
        python = None
        if command == "worker" and config.worker.engine == "vllm":  # vLLM lives in an environment of its own
            from switchyard.workers.vllm_engine.environment import vllm_python

            python = vllm_python(config.worker)
            env.update(self._private_tmp(name))
        service = ServiceProcess(name, args, log_path=log_path, env=env, stop_timeout_s=drain_s + 10, python=python)
        self.services.append(service)
        return self._started(service)

    def _private_tmp(self, name: str) -> dict[str, str]:
        """A temporary directory of one vLLM worker's own, emptied at its start and removed at the system's stop:
        vLLM (``vllm_dist_*``) and the worker's KV events socket make theirs under ``TMPDIR``, and a worker killed
        by SIGKILL removes neither. Torch's compile cache stays where it was, kept between starts. Short, under
        the system's temporary directory: the sockets made there must fit a Unix socket path (107 bytes)."""
        where = f"{self.config.data_dir.resolve()}:{name}".encode()
        path = Path(tempfile.gettempdir()) / f"switchyard-{hashlib.blake2b(where, digest_size=6).hexdigest()}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True, mode=0o700)
        self._stack.append(_RemovedAtStop(path))
        inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(
            Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")
        return {"TMPDIR": str(path), "TORCHINDUCTOR_CACHE_DIR": inductor}


class _RemovedAtStop:
    """A directory the system's processes may fill (the host KV tier, in memory): removed once they are stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def stop(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __repr__(self) -> str:
        return f"directory {self.path}"
