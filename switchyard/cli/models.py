"""``switchyard models``: the model cache (``list``, and ``pull`` with its progress on the terminal)."""

from __future__ import annotations

import argparse

from switchyard.cli.options import load_config
from switchyard.cli.tables import print_table


def cmd_models(args: argparse.Namespace) -> int:
    from rich.console import Console

    from switchyard.workers import model_store

    config = load_config(args)
    if args.models_cmd == "pull":
        console = Console(stderr=True)
        if model_store.is_pulled(args.name, config.model_cache_dir):
            console.print(f"{args.name} is already pulled")
        else:
            # Each step (download, conversion, save) is a line once done; the one under way spins meanwhile.
            with console.status(f"pulling {args.name} ...") as status:
                def progress(line: str) -> None:
                    console.print(f"  {line}")
                    status.update(f"{args.name}: {line}")

                model_store.pull(args.name, config.model_cache_dir, progress=progress)
        print(config.model_cache_dir / args.name)
    else:
        print_table([{"model": name, "pulled": "yes" if model_store.is_pulled(name, config.model_cache_dir) else "no"}
                     for name in model_store.REGISTRY])
    return 0
