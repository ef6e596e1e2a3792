"""``switchyard models``: the model cache."""

from __future__ import annotations

import argparse

from switchyard.cli.options import load_config


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


