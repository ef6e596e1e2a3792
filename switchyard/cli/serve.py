"""The serving commands: ``up``, ``gateway``, ``worker``, ``jobs``, ``migrate``."""

from __future__ import annotations

import argparse
import asyncio
import sys

from switchyard.cli.options import load_config


def cmd_gateway(args: argparse.Namespace) -> int:
    """The HTTP gateway; unless --no-jobs, the durable consumers run beside it in this process (the gateway itself
    knows nothing of them: they are handed to the app as a companion)."""
    import uvicorn

    from switchyard.gateway.app import Companion, create_app
    from switchyard.gateway.drain import DrainingServer
    from switchyard.gateway.services import GatewayServices
    from switchyard.jobs.runner import running_jobs
    from switchyard.shared.gc_pauses import startup_frozen
    from switchyard.shared.heap_trim import trimming_heap
    from switchyard.shared.tracing import setup_tracing

    config = load_config(args)
    setup_tracing("switchyard-gateway", config.traces_exporter, config.traces_file)
    services = GatewayServices(config)
    companions: list[Companion] = [lambda: running_jobs(config)] if config.gateway.run_jobs else []
    companions.append(trimming_heap)
    companions.append(startup_frozen)  # last: what the services and jobs made at start is there to freeze
    app = create_app(config, services, companions)
    # After the drain nothing is open: uvicorn's own grace period only closes idle keep-alive connections.
    # log_config=None: uvicorn's loggers go through the process's own (shared/logs.py), text or JSON alike.
    # loop and http stay "auto": uvloop and httptools, both dependencies, where they install (pyproject.toml).
    server_config = uvicorn.Config(app, host=config.gateway.host, port=config.gateway.port, log_config=None,
                                   log_level=args.log_level.lower(), timeout_graceful_shutdown=5)
    server = DrainingServer(server_config, services, services.in_flight, config.gateway.drain_timeout_s)
    server.run(sockets=[_reuse_port_socket(config.gateway.host, config.gateway.port)]
               if config.gateway.reuse_port else None)
    return 0


def _reuse_port_socket(host: str, port: int):
    """A listening socket that other gateway processes bind too: the kernel spreads new connections over them."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def cmd_worker(args: argparse.Namespace) -> int:
    from switchyard.workers.cpu_priority import bound_openmp_spin

    config = load_config(args)
    bound_openmp_spin(config.worker.omp_spin_count)  # before torch loads libgomp
    from switchyard.workers.service.main import serve_worker
    from switchyard.workers.serving.interface import EngineUnavailable

    if not config.nats_url:
        print("switchyard worker needs --nats-url (or SWITCHYARD_NATS_URL); `switchyard up` starts one.",
              file=sys.stderr)
        return 2
    try:
        return serve_worker(config)
    except EngineUnavailable as exc:
        print(f"switchyard worker: {exc}", file=sys.stderr)
        return 2


def cmd_jobs(args: argparse.Namespace) -> int:
    """The durable consumers alone (billing writer, batch runner, housekeeping), until SIGTERM or Ctrl-C."""
    from switchyard.jobs.runner import running_jobs
    from switchyard.shared.heap_trim import trimming_heap

    config = load_config(args)
    if not config.nats_url or not config.database_url:
        print("switchyard jobs needs --nats-url and --database-url (or SWITCHYARD_NATS_URL, SWITCHYARD_DATABASE_URL).",
              file=sys.stderr)
        return 2

    async def run() -> None:
        async with running_jobs(config) as jobs, trimming_heap():
            await jobs.wait()

    asyncio.run(run())
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from switchyard.migrations import apply_migrations

    config = load_config(args)
    if not config.database_url:
        print("switchyard migrate needs --database-url (or SWITCHYARD_DATABASE_URL).", file=sys.stderr)
        return 2
    from switchyard.jobs.prices import apply_prices

    applied = asyncio.run(apply_migrations(config.database_url))
    print("applied: " + (", ".join(applied) if applied else "nothing (up to date)"))
    if config.app_database_password:
        from switchyard.deploy.db_roles import APP_ROLE, ensure_app_role

        asyncio.run(ensure_app_role(config.database_url, config.app_database_password))
        print(f"role: {APP_ROLE} (rows only), for the gateways and jobs")
    for line in asyncio.run(apply_prices(config.database_url, config.models)):
        print("price: " + line)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from switchyard.deploy.up import run_up
    from switchyard.workers.serving.interface import EngineUnavailable

    try:
        return run_up(load_config(args))
    except EngineUnavailable as exc:  # a vLLM worker where vLLM is not installed: said before anything starts
        print(f"switchyard up: {exc}", file=sys.stderr)
        return 2


