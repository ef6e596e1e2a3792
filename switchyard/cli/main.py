"""The ``switchyard`` command: ``up``, ``gateway``, ``worker``, ``migrate``, ``models``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from switchyard.shared.config import SwitchyardConfig


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
    p.add_argument("--batch-seqs-when-busy", type=int,
                   help="batch-tier sequences a worker runs per step while interactive traffic is about "
                        "(default: 2 on CPU, no limit on GPU; 0: no limit)")


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
                     "enable_prefix_caching": "enable_prefix_caching", "batch_seqs_when_busy": "batch_seqs_when_busy"}
    worker = {f: getattr(args, a) for a, f in worker_fields.items() if getattr(args, a, None) is not None}
    gateway = {f: getattr(args, f) for f in ("host", "port") if getattr(args, f, None) is not None}
    return config.model_copy(update={
        "worker": config.worker.model_copy(update=worker),
        "gateway": config.gateway.model_copy(update=gateway),
    })


def cmd_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from switchyard.gateway.app import create_app

    config = load_config(args)
    app = create_app(config)
    uvicorn.run(app, host=config.gateway.host, port=config.gateway.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=5)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from switchyard.workers.service.main import serve_worker

    config = load_config(args)
    if not config.nats_url:
        print("switchyard worker needs --nats-url (or SWITCHYARD_NATS_URL); `switchyard up` starts one.",
              file=sys.stderr)
        return 2
    return serve_worker(config)


def cmd_migrate(args: argparse.Namespace) -> int:
    from switchyard.migrations import apply_migrations

    config = load_config(args)
    if not config.database_url:
        print("switchyard migrate needs --database-url (or SWITCHYARD_DATABASE_URL).", file=sys.stderr)
        return 2
    applied = asyncio.run(apply_migrations(config.database_url))
    print("applied: " + (", ".join(applied) if applied else "nothing (up to date)"))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from switchyard.workers import model_store

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
    from switchyard.deploy.up import read_run_file

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

    from switchyard.gateway.registry import ModelRegistry
    from switchyard.gateway.tier_admin import TierChangeError, change_tier, format_status, tier_status

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


def _with_db(args: argparse.Namespace, work) -> int:
    """Run ``work(conn)`` against the configured (or running system's) Postgres; TenancyError → exit 2."""
    import asyncpg

    from switchyard.gateway.tenancy import TenancyError

    config = load_config(args)
    if not config.database_url:
        from switchyard.deploy.up import read_run_file

        config.database_url = read_run_file(config.data_dir).get("database_url")
    if not config.database_url:
        raise SystemExit("no running system found: start `switchyard up`, or pass --database-url")

    async def run() -> int:
        conn = await asyncpg.connect(config.database_url)
        try:
            await work(conn)
            return 0
        except TenancyError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        finally:
            await conn.close()

    return asyncio.run(run())


def _table(rows: list[dict]) -> str:
    if not rows:
        return "(none)"
    head = list(rows[0])
    cells = [head] + [["-" if r[h] is None else str(r[h]) for h in head] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells)


def cmd_tenants(args: argparse.Namespace) -> int:
    from switchyard.gateway import tenancy

    async def work(conn) -> None:
        limits = {"rpm_limit": args.rpm, "tpm_limit": args.tpm, "monthly_token_budget": args.monthly_budget} \
            if args.tenants_cmd in ("create", "update") else {}
        if args.tenants_cmd == "create":
            tenant_id = await tenancy.create_tenant(conn, args.name, args.tier or "free", **limits)
            print(f"created tenant {args.name} ({tenant_id})")
        elif args.tenants_cmd == "update":
            changes = {k: v for k, v in limits.items() if v is not None}
            if args.tier:
                changes["tier"] = args.tier
            await tenancy.update_tenant(conn, args.name, **changes)
            print(f"updated tenant {args.name}")
        else:
            print(_table([dict(r) for r in await tenancy.list_tenants(conn)]))

    return _with_db(args, work)


def cmd_keys(args: argparse.Namespace) -> int:
    from switchyard.gateway import tenancy

    async def work(conn) -> None:
        if args.keys_cmd == "create":
            if args.tier and not await conn.fetchval("SELECT 1 FROM tenants WHERE name = $1", args.tenant):
                await tenancy.create_tenant(conn, args.tenant, args.tier)
            key = await tenancy.create_key(conn, args.tenant, args.name)
            print(f"key id: {key.id}\ntenant: {args.tenant}\n\n  {key.secret}\n\nStore it now: it is not shown again.")
        elif args.keys_cmd == "revoke":
            await tenancy.revoke_key(conn, args.key_id)
            print(f"revoked {args.key_id} (every gateway refuses it within a few seconds)")
        else:
            print(_table([dict(r) for r in await tenancy.list_keys(conn, args.tenant)]))

    return _with_db(args, work)


def cmd_usage(args: argparse.Namespace) -> int:
    from switchyard.gateway.usage_report import usage_rows

    async def work(conn) -> None:
        from switchyard.gateway import tenancy

        tenant_id = await tenancy.tenant_id_by_name(conn, args.tenant)
        print(_table(await usage_rows(conn, tenant_id, args.start, args.end, args.group_by)))

    return _with_db(args, work)


def cmd_up(args: argparse.Namespace) -> int:
    from switchyard.deploy.up import run_up

    return run_up(load_config(args))


class _Leaves:
    """Subcommands of a group (``tiers show``): each takes the common flags itself, so they may follow it."""

    def __init__(self, subparsers) -> None:
        self._subparsers = subparsers

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        leaf = self._subparsers.add_parser(name, **kwargs)
        _add_common(leaf)
        return leaf


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchyard", description="Self-hosted LLM serving.")
    parser.set_defaults(log_level=os.environ.get("SWITCHYARD_LOG_LEVEL", "INFO"))
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
    tsub = _Leaves(p.add_subparsers(dest="tiers_cmd"))
    tsub.add_parser("show", help="per model and tier: queued, oldest wait, running, limits, 429s")
    tset = tsub.add_parser("set", help="change a tier's policy live (recorded in Postgres)")
    tset.add_argument("tier")
    tset.add_argument("--max-queued", type=int, help="queued requests per model before 429 queue_full")
    tset.add_argument("--max-wait", type=float, help="seconds a request may wait before queue_timeout")
    tset.add_argument("--weight", type=float, help="share of worker pulls when several tiers have work")
    p.set_defaults(func=cmd_tiers)

    p = sub.add_parser("tenants", help="create, update or list tenants")
    tsub = _Leaves(p.add_subparsers(dest="tenants_cmd"))
    for name in ("create", "update"):
        tp = tsub.add_parser(name)
        tp.add_argument("name")
        tp.add_argument("--tier", choices=["enterprise", "pro", "free", "batch"])
        tp.add_argument("--rpm", type=int, help="requests per minute per key (default: the tier's)")
        tp.add_argument("--tpm", type=int, help="tokens per minute per key (default: the tier's)")
        tp.add_argument("--monthly-budget", type=int, help="tokens per calendar month for the tenant")
    tsub.add_parser("list")
    p.set_defaults(func=cmd_tenants, tenants_cmd="list")

    p = sub.add_parser("keys", help="create, list or revoke API keys")
    ksub = _Leaves(p.add_subparsers(dest="keys_cmd"))
    kc = ksub.add_parser("create", help="print a new key once")
    kc.add_argument("--tenant", required=True)
    kc.add_argument("--tier", help="create the tenant on this tier if it does not exist")
    kc.add_argument("--name", help="a label for the key")
    kl = ksub.add_parser("list")
    kl.add_argument("--tenant")
    kr = ksub.add_parser("revoke")
    kr.add_argument("key_id")
    p.set_defaults(func=cmd_keys, keys_cmd="list", tenant=None)

    p = sub.add_parser("usage", help="a tenant's usage and cost")
    _add_common(p)
    p.add_argument("--tenant", required=True)
    p.add_argument("--start", help="ISO date or time (default: start of this month)")
    p.add_argument("--end", help="ISO date or time (default: now)")
    p.add_argument("--group-by", choices=["model", "day"], default="model")
    p.set_defaults(func=cmd_usage)

    p = sub.add_parser("models", help="list or pull models into the cache")
    msub = _Leaves(p.add_subparsers(dest="models_cmd"))
    pull = msub.add_parser("pull", help="download and convert a model once")
    pull.add_argument("name")
    msub.add_parser("list", help="known models and whether they are pulled")
    p.set_defaults(func=cmd_models)

    from switchyard.cli.batch import add_batch_parser

    add_batch_parser(sub)
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
