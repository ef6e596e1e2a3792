"""The ``switchyard`` command: the parser and dispatch; each command group lives in its own module."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from pydantic import ValidationError

from switchyard.cli.batch import add_batch_parser
from switchyard.cli.models import cmd_models
from switchyard.cli.ops import cmd_keys, cmd_tenants, cmd_tiers, cmd_usage
from switchyard.cli.options import add_common_flags, add_embedding_flags, add_http_flags, add_model_flags, load_config
from switchyard.cli.serve import cmd_gateway, cmd_jobs, cmd_migrate, cmd_up, cmd_worker
from switchyard.cli.top import cmd_top
from switchyard.shared.logs import configure_logging
from switchyard.shared.tiers import TIER_NAMES


class _Leaves:
    """Subcommands of a group (``tiers show``): each takes the common flags itself, so they may follow it."""

    def __init__(self, subparsers) -> None:
        self._subparsers = subparsers

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        leaf = self._subparsers.add_parser(name, **kwargs)
        add_common_flags(leaf)
        return leaf


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchyard", description="Self-hosted LLM serving.")
    parser.set_defaults(log_level=os.environ.get("SWITCHYARD_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("up", help="start everything: NATS, Postgres, migrations, a worker per model and the gateway")
    add_common_flags(p)
    add_model_flags(p, several=True)
    add_http_flags(p)
    add_embedding_flags(p)
    p.add_argument("--gateways", dest="processes", type=int,
                   help="gateway processes on the one port (default 1; SO_REUSEPORT spreads connections)")
    p.add_argument("--workers", type=int,
                   help="workers of the chat model on this machine (default 1), each its own process and seats")
    p.add_argument("--prefill-workers", type=int,
                   help="disaggregated serving of the chat model: this many prefill workers (needs --decode-workers)")
    p.add_argument("--decode-workers", type=int,
                   help="disaggregated serving of the chat model: this many decode workers, which go on from what "
                        "the prefill workers hand over (and serve short prompts whole)")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("gateway", help="run the HTTP gateway")
    add_common_flags(p)
    add_http_flags(p)
    p.add_argument("--no-jobs", dest="run_jobs", action="store_false", default=None,
                   help="leave the durable consumers to `switchyard jobs`")
    p.set_defaults(func=cmd_gateway)

    p = sub.add_parser("worker", help="run a worker for one model")
    add_common_flags(p)
    add_model_flags(p)
    p.add_argument("--role", choices=["both", "prefill", "decode"],
                   help="both (the default) serves whole requests; prefill takes the model's prefill queue and hands "
                        "each request to a decode worker after its first token; decode serves whole requests and "
                        "those hand-overs (disaggregated serving: docs/operating/disaggregation.md)")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("jobs", help="run the durable consumers alone: billing writer, batch runner, housekeeping")
    add_common_flags(p)
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("migrate", help="apply database migrations")
    add_common_flags(p)
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("tiers", help="show tier queues, or change a tier's limits live")
    tsub = _Leaves(p.add_subparsers(dest="tiers_cmd"))
    tsub.add_parser("show", help="per model and tier: queued, oldest wait, running, limits, 429s")
    tset = tsub.add_parser("set", help="change a tier's policy live (recorded in Postgres)")
    tset.add_argument("tier")
    tset.add_argument("--max-queued", type=int, help="queued requests in the tier before 429 queue_full")
    tset.add_argument("--max-queued-per-tenant", type=int,
                      help="queued requests of one tenant for one model (0: a quarter of --max-queued)")
    tset.add_argument("--max-wait", type=float, help="seconds a request may wait before queue_timeout")
    tset.add_argument("--weight", type=float, help="share of worker pulls when several tiers have work")
    tset.add_argument("--max-streams", type=int, help="requests one tenant may have generating at once (0: no cap)")
    tset.add_argument("--max-sequences", type=int, help="their sequences, every choice of each (0: no cap)")
    tset.add_argument("--hedge-after-ms", metavar="N|auto|off",
                      help="offer a request with no token after N ms (auto: the tier's recent TTFT p95) to a second "
                           "worker; the first to produce a token serves it")
    tset.add_argument("--hedge-budget", type=float, metavar="SHARE",
                      help="hedge at most this share of the tier's requests (default 0.05)")
    tset.add_argument("--pause-after-tokens", type=int, metavar="N",
                      help="with every seat taken, a request that has generated N tokens may be paused (its KV kept) "
                           "for a waiting tenant far below its share, and resumes next (0: off)")
    p.set_defaults(func=cmd_tiers)

    p = sub.add_parser("top", help="live view per model and tier: queued, oldest wait, running, TTFT p95, tokens/s, "
                                   "429s and 503s over the last refresh")
    add_common_flags(p)
    p.add_argument("--gateway", action="append", metavar="URL",
                   help="a gateway to scrape (repeat for several; default: the running `switchyard up`'s)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--once", action="store_true", help="print one refresh and exit")
    p.set_defaults(func=cmd_top)

    p = sub.add_parser("tenants", help="create, update or list tenants")
    tsub = _Leaves(p.add_subparsers(dest="tenants_cmd"))
    for name in ("create", "update"):
        tp = tsub.add_parser(name)
        tp.add_argument("name")
        tp.add_argument("--tier", choices=TIER_NAMES)
        tp.add_argument("--rpm", type=int, help="requests per minute per key (default: the tier's)")
        tp.add_argument("--tpm", type=int, help="tokens per minute per key (default: the tier's)")
        tp.add_argument("--monthly-budget", type=int, help="tokens per calendar month for the tenant")
        tp.add_argument("--max-streams", type=int, help="requests generating at once (default: the tier's)")
        tp.add_argument("--max-sequences", type=int,
                        help="sequences (every choice of those requests) at once (default: the tier's)")
        tp.add_argument("--priority", action=argparse.BooleanOptionalAction,
                        help="may ask for service_tier \"priority\" (the top tier); enterprise tenants always may")
        tp.add_argument("--safety", choices=["block", "log", "off", "default"],
                        help="what the safety filters do with flagged input or output: refuse/halt it, log and "
                             "count it, or nothing (default: the deployment's gateway.safety.default_policy)")
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
    add_common_flags(p)
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

    add_batch_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args)
        configure_logging(args.log_level, config.log_format, config.log_health_checks)
        # SIGTERM behaves like Ctrl-C, so every command shuts down through the same cleanup path.
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except ValidationError as exc:  # settings that cannot work together: said in a line, not a traceback
        errors = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        print(f"switchyard {args.cmd}: {errors}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
