"""Operator commands on a running system: ``tiers``, ``tenants``, ``keys``, ``usage``."""

from __future__ import annotations

import argparse
import asyncio
import sys

from switchyard.cli.options import load_config
from switchyard.cli.tables import print_table
from switchyard.shared.config import SwitchyardConfig
from switchyard.shared.tiers import NEW_TENANT_TIER


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

    from switchyard.domain.registry import ModelRegistry
    from switchyard.domain.tier_admin import TierChangeError, change_tier, tier_status
    from switchyard.shared import nats_client

    config = _ops_config(args)
    nats_url = config.nats_url
    assert nats_url is not None  # _ops_config exits without one

    async def run() -> int:
        nc = await nats_client.connect(nats_url, "switchyard-cli", reconnect_forever=False,
                                       tls_ca=config.nats_tls_ca)
        js = nc.jetstream()
        try:
            if args.tiers_cmd == "set":
                pool = await asyncpg.create_pool(config.database_url, min_size=1, max_size=1)
                try:
                    old, new = await change_tier(js, pool, args.tier, getpass.getuser(), max_queued=args.max_queued,
                                                 max_wait_s=args.max_wait, weight=args.weight,
                                                 max_queued_per_tenant=args.max_queued_per_tenant,
                                                 max_streams=args.max_streams, max_sequences=args.max_sequences,
                                                 hedge_after_ms=args.hedge_after_ms, hedge_budget=args.hedge_budget,
                                                 pause_after_tokens=args.pause_after_tokens)
                except TierChangeError as exc:
                    print(f"error: {exc}", file=sys.stderr)
                    return 2
                finally:
                    await pool.close()
                print(f"{args.tier}: max_queued {old.max_queued} -> {new.max_queued}, per tenant "
                      f"{old.tenant_cap} -> {new.tenant_cap}, "
                      f"max_wait_s {old.max_wait_s:g} -> {new.max_wait_s:g}, weight {old.weight:g} -> {new.weight:g}, "
                      f"max_streams {old.max_streams} -> {new.max_streams}, max_sequences {old.max_sequences} -> "
                      f"{new.max_sequences}, hedging {old.describe_hedging()} -> {new.describe_hedging()}, "
                      f"pausing {old.describe_pausing()} -> {new.describe_pausing()}")
            else:
                served = await ModelRegistry(nc).models(fresh=True)
                rows = await tier_status(js, served)
                for r in rows:  # seconds as an operator reads them
                    r["oldest_wait_s"] = None if r["oldest_wait_s"] is None else f"{r['oldest_wait_s']:.1f}s"
                print_table(rows, ("model", "tier", "queued", "oldest_wait_s", "backlog_tokens", "running",
                                   "max_queued", "max_queued_per_tenant", "max_wait_s", "weight", "hedge_after_ms",
                                   "pause_after_tokens", "workers",
                                   "rejected_5m"))
            return 0
        finally:
            await nc.close()

    return asyncio.run(run())


def _with_db(args: argparse.Namespace, work) -> int:
    """Run ``work(conn)`` against the configured (or running system's) Postgres; TenancyError → exit 2."""
    import asyncpg

    from switchyard.domain.tenancy import TenancyError

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


def cmd_tenants(args: argparse.Namespace) -> int:
    from switchyard.domain import tenancy

    async def work(conn) -> None:
        limits = {"rpm_limit": args.rpm, "tpm_limit": args.tpm, "monthly_token_budget": args.monthly_budget,
                  "max_streams": args.max_streams, "max_sequences": args.max_sequences} \
            if args.tenants_cmd in ("create", "update") else {}
        if args.tenants_cmd == "create":
            tenant_id = await tenancy.create_tenant(conn, args.name, args.tier or NEW_TENANT_TIER, **limits)
            if args.priority is not None:
                await tenancy.update_tenant(conn, args.name, priority_allowed=args.priority)
            if args.safety is not None:
                await tenancy.update_tenant(conn, args.name, safety_policy=_safety_policy(args.safety))
            print(f"created tenant {args.name} ({tenant_id})")
        elif args.tenants_cmd == "update":
            changes = {k: v for k, v in limits.items() if v is not None}
            if args.tier:
                changes["tier"] = args.tier
            if args.priority is not None:
                changes["priority_allowed"] = args.priority
            if args.safety is not None:
                changes["safety_policy"] = _safety_policy(args.safety)
            await tenancy.update_tenant(conn, args.name, **changes)
            print(f"updated tenant {args.name}")
        else:
            print_table([dict(r) for r in await tenancy.list_tenants(conn)])

    return _with_db(args, work)


def _safety_policy(choice: str) -> str | None:
    return None if choice == "default" else choice  # NULL: the deployment's default policy


def cmd_keys(args: argparse.Namespace) -> int:
    from switchyard.domain import tenancy

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
            print_table([dict(r) for r in await tenancy.list_keys(conn, args.tenant)])

    return _with_db(args, work)


def cmd_usage(args: argparse.Namespace) -> int:
    from switchyard.domain.usage_report import usage_rows

    async def work(conn) -> None:
        from switchyard.domain import tenancy

        tenant_id = await tenancy.tenant_id_by_name(conn, args.tenant)
        print_table(await usage_rows(conn, tenant_id, args.start, args.end, args.group_by))

    return _with_db(args, work)


