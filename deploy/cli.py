"""The ``switchyard`` command: ``up``, ``gateway``, ``worker``, ``migrate``, ``models``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from shared.config import SwitchyardConfig


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=Path, help="state directory (JetStream store, Postgres data, model cache)")
    p.add_argument("--nats-url", help="use this NATS server instead of an embedded one")
    p.add_argument("--database-url", help="use this Postgres instead of an embedded one")
    p.add_argument("--log-level", default=os.environ.get("SWITCHYARD_LOG_LEVEL", "INFO"))


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="registry name (smollm2) or a local Hugging Face model directory")
    p.add_argument("--served-model-name", help="the name clients use in the `model` field")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", help="auto, cpu or cuda")
    p.add_argument("--max-num-seqs", type=int, help="sequences a worker runs at once")
    p.add_argument("--max-num-batched-tokens", type=int, help="per-step token budget (prefill chunks + decodes)")
    p.add_argument("--kv-cache-gib", type=float, help="KV cache size (default: 2 GiB on CPU, 80%% of free GPU memory)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None)


def _add_http(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host")
    p.add_argument("--port", type=int)


def load_config(args: argparse.Namespace) -> SwitchyardConfig:
    """Environment first, then flags: a flag given on the command line always wins."""
    config = SwitchyardConfig()
    for flag, attr in (("data_dir", "data_dir"), ("nats_url", "nats_url"), ("database_url", "database_url")):
        if getattr(args, flag, None) is not None:
            setattr(config, attr, getattr(args, flag))
    worker_fields = {"model": "model", "served_model_name": "served_model_name", "dtype": "dtype",
                     "device": "device", "max_num_seqs": "max_num_seqs",
                     "max_num_batched_tokens": "max_num_batched_tokens", "kv_cache_gib": "kv_cache_gib",
                     "enable_prefix_caching": "enable_prefix_caching"}
    worker = {f: getattr(args, a) for a, f in worker_fields.items() if getattr(args, a, None) is not None}
    gateway = {f: getattr(args, f) for f in ("host", "port") if getattr(args, f, None) is not None}
    return config.model_copy(update={
        "worker": config.worker.model_copy(update=worker),
        "gateway": config.gateway.model_copy(update=gateway),
    })


def cmd_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app

    config = load_config(args)
    app = create_app(config)
    uvicorn.run(app, host=config.gateway.host, port=config.gateway.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=5)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from workers.main import serve_worker

    config = load_config(args)
    if not config.nats_url:
        print("switchyard worker needs --nats-url (or SWITCHYARD_NATS_URL); `switchyard up` starts one.",
              file=sys.stderr)
        return 2
    return serve_worker(config)


def cmd_migrate(args: argparse.Namespace) -> int:
    from migrations import apply_migrations

    config = load_config(args)
    if not config.database_url:
        print("switchyard migrate needs --database-url (or SWITCHYARD_DATABASE_URL).", file=sys.stderr)
        return 2
    applied = asyncio.run(apply_migrations(config.database_url))
    print("applied: " + (", ".join(applied) if applied else "nothing (up to date)"))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from workers import model_store

    config = load_config(args)
    if args.models_cmd == "pull":
        path = model_store.pull(args.name, config.model_cache_dir)
        print(path)
    else:
        for name in model_store.REGISTRY:
            state = "pulled" if model_store.is_pulled(name, config.model_cache_dir) else "not pulled"
            print(f"{name}\t{state}")
    return 0


def _ops_config(args: argparse.Namespace) -> SwitchyardConfig:
    """Config for ops commands: flags or env first, else the servers of a running `switchyard up`."""
    from deploy.up import read_run_file

    config = load_config(args)
    running = read_run_file(config.data_dir)
    config.nats_url = config.nats_url or running.get("nats_url")
    config.database_url = config.database_url or running.get("database_url")
    if not config.nats_url or not config.database_url:
        raise SystemExit("no running system found: start `switchyard up`, or pass --nats-url and --database-url")
    return config


def cmd_tiers(args: argparse.Namespace) -> int:
    import getpass

    import asyncpg
    import nats

    from gateway.registry import ModelRegistry
    from gateway.tier_admin import TierChangeError, change_tier, format_status, tier_status

    config = _ops_config(args)

    async def run() -> int:
        nc = await nats.connect(config.nats_url, max_reconnect_attempts=1)
        js = nc.jetstream()
        try:
            if args.tiers_cmd == "set":
                pool = await asyncpg.create_pool(config.database_url, min_size=1, max_size=1)
                try:
                    old, new = await change_tier(js, pool, args.tier, getpass.getuser(), max_queued=args.max_queued,
                                                 max_wait_s=args.max_wait, weight=args.weight)
                except TierChangeError as exc:
                    print(f"error: {exc}", file=sys.stderr)
                    return 2
                finally:
                    await pool.close()
                print(f"{args.tier}: max_queued {old.max_queued} -> {new.max_queued}, "
                      f"max_wait_s {old.max_wait_s:g} -> {new.max_wait_s:g}, weight {old.weight:g} -> {new.weight:g}")
            else:
                served = await ModelRegistry(js).models(fresh=True)
                print(format_status(await tier_status(js, served)))
            return 0
        finally:
            await nc.close()

    return asyncio.run(run())


def cmd_up(args: argparse.Namespace) -> int:
    from deploy.up import run_up

    return run_up(load_config(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchyard", description="Self-hosted LLM serving.")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("up", help="start everything: NATS, Postgres, migrations, a worker and the gateway")
    _add_common(p), _add_model(p), _add_http(p)
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("gateway", help="run the HTTP gateway")
    _add_common(p), _add_http(p)
    p.set_defaults(func=cmd_gateway)

    p = sub.add_parser("worker", help="run a worker for one model")
    _add_common(p), _add_model(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("migrate", help="apply database migrations")
    _add_common(p)
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("tiers", help="show tier queues, or change a tier's limits live")
    _add_common(p)
    tsub = p.add_subparsers(dest="tiers_cmd")
    tsub.add_parser("show", help="per model and tier: queued, oldest wait, running, limits, 429s")
    tset = tsub.add_parser("set", help="change a tier's policy live (recorded in Postgres)")
    tset.add_argument("tier")
    tset.add_argument("--max-queued", type=int, help="queued requests per model before 429 queue_full")
    tset.add_argument("--max-wait", type=float, help="seconds a request may wait before queue_timeout")
    tset.add_argument("--weight", type=float, help="share of worker pulls when several tiers have work")
    p.set_defaults(func=cmd_tiers)

    p = sub.add_parser("models", help="list or pull models into the cache")
    _add_common(p)
    msub = p.add_subparsers(dest="models_cmd")
    pull = msub.add_parser("pull", help="download and convert a model once")
    pull.add_argument("name")
    msub.add_parser("list", help="known models and whether they are pulled")
    p.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # readiness polling is not news
    # SIGTERM behaves like Ctrl-C, so every command shuts down through the same cleanup path.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
