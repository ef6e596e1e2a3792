"""The serving commands: ``up``, ``gateway``, ``worker``, ``jobs``, ``migrate``."""

from __future__ import annotations

import argparse
import asyncio
import sys

from switchyard.cli.options import load_config


def cmd_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from switchyard.gateway.app import create_app
    from switchyard.gateway.drain import DrainingServer
    from switchyard.shared.tracing import setup_tracing

    config = load_config(args)
    setup_tracing("switchyard-gateway", config.traces_exporter, config.traces_file)
    app = create_app(config)
    # After the drain nothing is open: uvicorn's own grace period only closes idle keep-alive connections.
    # log_config=None: uvicorn's loggers go through the process's own (shared/logs.py), text or JSON alike.
    server_config = uvicorn.Config(app, host=config.gateway.host, port=config.gateway.port, log_config=None,
                                   log_level=args.log_level.lower(), timeout_graceful_shutdown=5)
    DrainingServer(server_config, app.state, app.state.in_flight, config.gateway.drain_timeout_s).run()
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from switchyard.workers.service.main import serve_worker

    config = load_config(args)
    if not config.nats_url:
        print("switchyard worker needs --nats-url (or SWITCHYARD_NATS_URL); `switchyard up` starts one.",
              file=sys.stderr)
        return 2
    return serve_worker(config)


def cmd_jobs(args: argparse.Namespace) -> int:
    """The durable consumers alone (billing writer, batch runner, housekeeping), until SIGTERM or Ctrl-C."""
    import asyncpg

    from switchyard.gateway.registry import ModelRegistry
    from switchyard.gateway.safety import InputSafety
    from switchyard.jobs.runner import Jobs
    from switchyard.shared import nats_client
    from switchyard.shared.jetstream import ensure_streams

    config = load_config(args)
    if not config.nats_url or not config.database_url:
        print("switchyard jobs needs --nats-url and --database-url (or SWITCHYARD_NATS_URL, SWITCHYARD_DATABASE_URL).",
              file=sys.stderr)
        return 2

    async def run() -> None:
        nc = await nats_client.connect(config.nats_url, "switchyard-jobs", tls_ca=config.nats_tls_ca)
        js = nc.jetstream()
        pool = None
        try:
            await ensure_streams(js, config.nats_replicas)
            pool = await asyncpg.create_pool(config.database_url, min_size=1, max_size=4)
            jobs = Jobs(nc, js, pool, ModelRegistry(js), config.database_url, InputSafety(config.gateway.safety))
            try:
                await jobs.wait()
            finally:  # Ctrl-C / SIGTERM cancel the wait: let each job finish its record
                await jobs.stop()
        finally:
            if pool is not None:
                await pool.close()
            await nc.close()

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
    for line in asyncio.run(apply_prices(config.database_url, config.models)):
        print("price: " + line)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from switchyard.deploy.up import run_up

    return run_up(load_config(args))


