"""Flags shared by commands, and the configuration they make: environment first, then flags."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from switchyard.shared.config import ModelEntry, SwitchyardConfig


def add_common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=Path, help="state directory (JetStream store, Postgres data, model cache)")
    p.add_argument("--nats-url", help="use this NATS server instead of an embedded one")
    p.add_argument("--database-url", help="use this Postgres instead of an embedded one")
    p.add_argument("--log-level", default=os.environ.get("SWITCHYARD_LOG_LEVEL", "INFO"))
    p.add_argument("--log-format", choices=["text", "json"], help="json: one object a line, with the request id")
    p.add_argument("--config", type=Path, help="a YAML or JSON file of settings (models, gateway.routes, ...); "
                                               "environment variables and flags override it")


def add_model_flags(p: argparse.ArgumentParser, several: bool = False) -> None:
    if several:
        p.add_argument("--model", action="append", metavar="[NAME=]MODEL",
                       help="registry name (smollm2) or a local Hugging Face model directory, served as NAME; "
                            "repeat it to serve several models (a worker each)")
    else:
        p.add_argument("--model", help="registry name (smollm2) or a local Hugging Face model directory")
    p.add_argument("--served-model-name", help="the name clients use in the `model` field")
    p.add_argument("--engine", help="which engine runs the model: switchyard (ours, the default) or simulated (a "
                                    "test double for load tests: made-up tokens, no model)")
    p.add_argument("--simulated-tokens-per-s", type=float, help="engine simulated: tokens/s of each sequence")
    p.add_argument("--simulated-prefill-us-per-token", type=float,
                   help="engine simulated: microseconds of prefill per prompt token")
    p.add_argument("--simulated-output-tokens", type=int, help="engine simulated: a reply's length without max_tokens")
    p.add_argument("--simulated-tokens-per-delta", type=int,
                   help="engine simulated: tokens sent together after the first (default 1)")
    p.add_argument("--simulated-step-ms", type=float,
                   help="engine simulated: how often it steps, every sequence's due tokens in one step (default 0: "
                        "whenever a token is due)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", help="auto, cpu or cuda")
    p.add_argument("--max-num-seqs", type=int, help="sequences a worker runs at once")
    p.add_argument("--max-num-batched-tokens", type=int, help="per-step token budget (prefill chunks + decodes)")
    p.add_argument("--kv-cache-gib", type=float, help="KV cache size (default: 2 GiB on CPU, 80%% of free GPU memory)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None)
    p.add_argument("--kv-offload-gib", type=float,
                   help="host-memory KV tier below the pool, shared by the host's workers of the model (default: a "
                        "tenth of available memory on a GPU worker, off on a CPU one; 0: off)")
    p.add_argument("--kv-offload-dir", type=Path, help="a disk KV tier in this directory (default: none)")
    p.add_argument("--kv-offload-disk-gib", type=float, help="the disk tier's size (default 16)")
    p.add_argument("--kv-offload-host-dir", type=Path,
                   help="where the host tier's files live (default: /dev/shm/switchyard-kv; `up`: one of its own)")
    p.add_argument("--quantization", choices=["int8", "w8a8", "int4"],
                   help="our engine's weights as int8 with a scale per output feature; w8a8: each step's activations "
                        "as int8 too, products in int32 (a CPU); int4: 4 bits a weight in groups of 32 (GGUF's "
                        "Q4_1), on int8 activations (a CPU; default: as loaded)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8"],
                   help="our engine's KV cache: int8 holds 3.8x the positions of float32, a quarter of "
                        "the bytes a step reads (a CPU; default: auto, the model's dtype)")
    p.add_argument("--speculative", choices=["ngram", "draft"],
                   help="speculative decoding: ngram guesses a greedy request's next tokens from its own prompt and "
                        "output (prompt lookup); draft runs --speculative-model ahead of each request; either's "
                        "drafts are checked several at once (default: off)")
    p.add_argument("--speculative-model",
                   help="--speculative draft: the draft model, of the same tokenizer (a name as for --model, or a "
                        "directory)")
    p.add_argument("--speculative-quantization", choices=["int8", "w8a8", "int4"],
                   help="--speculative draft: the draft model's weights, as --quantization (default: as loaded)")
    p.add_argument("--num-speculative-tokens", type=int, help="the most drafts a step checks per request (default 4)")
    p.add_argument("--tune-threads", dest="tune_threads", action="store_true", default=None,
                   help="our engine on a CPU: run each step on the thread count its recent steps of that size ran "
                        "fastest on, measured while serving (default: off)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", default=None,
                   help="run every GPU step eagerly (no CUDA graphs captured at start)")
    p.add_argument("--batch-seqs-when-busy", type=int,
                   help="batch-tier sequences a worker runs per step while interactive traffic is about "
                        "(default: 2 on CPU, no limit on GPU; 0: no limit)")
    p.add_argument("--metrics-port", type=int,
                   help="the worker's Prometheus /metrics port (default 0: any free port; the worker registry has it)")


def add_embedding_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--embedding-model", help="the embedding model served beside the chat model when no --model "
                                             "list is given (default all-minilm-l6-v2)")
    p.add_argument("--no-embeddings", dest="embedding_model", action="store_const", const="",
                   help="serve no embedding model")


def add_http_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host")
    p.add_argument("--port", type=int)


def load_config(args: argparse.Namespace) -> SwitchyardConfig:
    """Environment first, then flags: a flag given on the command line always wins.

    Flags are named after the settings they set (``--max-num-seqs`` sets ``worker.max_num_seqs``), so the mapping
    needs no table: every flag whose destination is a field of a section goes to that section.
    """
    config = SwitchyardConfig(**read_config_file(args.config)) if getattr(args, "config", None) else \
        SwitchyardConfig()

    def given(fields) -> dict:
        return {f: v for f in fields if (v := getattr(args, f, None)) is not None}

    worker = given(type(config.worker).model_fields)
    models = config.models
    if isinstance(worker.get("model"), list):  # `up --model a --model b`: a worker each
        specs = [_model_entry(spec) for spec in worker.pop("model")]
        if len(specs) == 1 and not models:
            worker.update(specs[0].model_dump(include={"model", "served_model_name"}, exclude_none=True))
        else:
            models = specs
    return config.model_copy(update={
        **given(("data_dir", "nats_url", "database_url", "log_format", "embedding_model", "workers",
                 "prefill_workers", "decode_workers")),
        "worker": config.worker.model_copy(update=worker),
        "gateway": config.gateway.model_copy(update=given(type(config.gateway).model_fields)),
        "models": models,
    })


def _model_entry(spec: str) -> ModelEntry:
    """``NAME=MODEL`` or ``MODEL`` (a path may hold '=' only after its first '/')."""
    name, sep, model = spec.partition("=")
    if not sep or "/" in name:
        return ModelEntry(model=spec)
    return ModelEntry(model=model, served_model_name=name)


def read_config_file(path: Path) -> dict:
    """A settings file's contents (YAML, or JSON which YAML reads too), fields as ``SwitchyardConfig`` has them."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"cannot read the settings file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"the settings file {path} must hold a mapping of settings")
    # Environment variables still win over the file: they are what a deployment sets last.
    return _merged(data, SwitchyardConfig().model_dump(exclude_unset=True))


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
