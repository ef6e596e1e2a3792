"""``switchyard batch``: run a JSONL file of requests as a batch through a gateway's Batch API.

    switchyard batch submit input.jsonl [--model M] [--wait] [-o out.jsonl]   prints the batch id
    switchyard batch status  BATCH_ID [--json]
    switchyard batch results BATCH_ID [-o out.jsonl] [--errors err.jsonl]
    switchyard batch cancel  BATCH_ID

It speaks HTTP with the official ``openai`` client, so it works against any gateway replica (or OpenAI itself):
``--base-url`` (default http://127.0.0.1:8000/v1) and ``--api-key`` (default: $OPENAI_API_KEY, else the key
``switchyard up`` wrote to the data directory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from switchyard.shared.config import default_data_dir

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
FINISHED = ("completed", "failed", "expired", "cancelled")


def add_batch_parser(sub) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", DEFAULT_BASE_URL))
    common.add_argument("--api-key", help="default: $OPENAI_API_KEY, else the data dir's default-api-key")
    common.add_argument("--data-dir", type=Path, help="where `switchyard up` keeps state (for the default key)")
    common.add_argument("--log-level", default="WARNING")
    p = sub.add_parser("batch", help="submit a JSONL file as a batch, watch it, fetch results, cancel")
    bsub = p.add_subparsers(dest="batch_cmd", required=True)
    s = bsub.add_parser("submit", parents=[common], help="upload the file, create the batch, print its id")
    s.add_argument("input", type=Path, help="JSONL: one {custom_id, method, url, body} per line")
    s.add_argument("--model", help="use this model for every line (overrides each body's model)")
    s.add_argument("--endpoint", help="default: the lines' url, else /v1/chat/completions")
    s.add_argument("--wait", action="store_true", help="show progress until the batch ends")
    s.add_argument("-o", "--output", type=Path, help="with --wait: write the results here")
    s = bsub.add_parser("status", parents=[common], help="a batch's state and counts")
    s.add_argument("batch_id")
    s.add_argument("--json", action="store_true", help="the whole Batch object as JSON")
    s = bsub.add_parser("results", parents=[common], help="download a finished batch's results")
    s.add_argument("batch_id")
    s.add_argument("-o", "--output", type=Path, help="default: standard output")
    s.add_argument("--errors", type=Path, help="failed/cancelled lines (default: next to --output)")
    s = bsub.add_parser("cancel", parents=[common], help="cancel a batch; finished lines are kept")
    s.add_argument("batch_id")
    p.set_defaults(func=cmd_batch)


def _api_key(args: argparse.Namespace) -> str:
    if args.api_key:
        return args.api_key
    if env := os.environ.get("OPENAI_API_KEY"):
        return env
    from switchyard.deploy.up import KEY_FILE

    path = (args.data_dir or default_data_dir()) / KEY_FILE
    try:
        return path.read_text().strip()
    except OSError:
        raise SystemExit(f"no API key: pass --api-key, set OPENAI_API_KEY, or start `switchyard up` ({path})") from None


def cmd_batch(args: argparse.Namespace) -> int:
    import openai

    client = openai.OpenAI(base_url=args.base_url, api_key=_api_key(args), max_retries=3)
    try:
        return {"submit": _submit, "status": _status, "results": _results, "cancel": _cancel}[args.batch_cmd](
            client, args)
    except openai.APIStatusError as exc:
        print(f"error: {exc.status_code} {exc.message}", file=sys.stderr)
        return 1
    except openai.APIConnectionError as exc:
        print(f"error: cannot reach {args.base_url}: {exc}", file=sys.stderr)
        return 1


def rewrite_input(data: bytes, model: str | None) -> tuple[bytes, str | None]:
    """Apply ``--model`` to every line; returns the new content and the first line's url. Lines that are not
    JSON objects are left alone (the server reports them with their line numbers); line numbers never move."""
    out, url = [], None
    for raw in data.decode("utf-8").splitlines():
        try:
            item = json.loads(raw) if raw.strip() else None
        except ValueError:
            item = None
        if isinstance(item, dict):
            url = url or item.get("url")
            if model and isinstance(item.get("body"), dict):
                item["body"]["model"] = model
                raw = json.dumps(item, ensure_ascii=False)
        out.append(raw)
    return ("\n".join(out) + "\n").encode(), url


def _submit(client, args: argparse.Namespace) -> int:
    content, url = rewrite_input(args.input.read_bytes(), args.model)
    endpoint = args.endpoint or url or "/v1/chat/completions"
    f = client.files.create(file=(args.input.name, content), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h",
                                  metadata={"source": args.input.name[:512]})
    print(batch.id, flush=True)
    if not args.wait:
        return 0
    batch = _watch(client, batch.id)
    if args.output and batch.status != "failed":
        _download(client, batch, args.output, None)
    return 0 if batch.status == "completed" else 1


def _watch(client, batch_id: str, poll_s: float = 1.0):
    """Poll until the batch ends, with a progress bar on stderr (redrawn on a terminal; elsewhere rich prints the
    final state once). Rate and time left count only lines finished since watching began."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (BarColumn(), MofNCompleteColumn(), TextColumn("done, {task.fields[failed]} failed"),
               TimeRemainingColumn(), TextColumn("{task.fields[status]}"))
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = None
        while True:
            batch = client.batches.retrieve(batch_id)
            counts = batch.request_counts
            total, completed, failed = (counts.total, counts.completed, counts.failed) if counts else (0, 0, 0)
            fields = dict(completed=completed + failed, failed=failed, status=batch.status)
            if task is None:
                task = progress.add_task("batch", total=total or None, **fields)
            else:  # the total is known once validation has read the file
                progress.update(task, total=total or None, **fields)
            if batch.status in FINISHED:
                break
            time.sleep(poll_s)
    for error in (batch.errors.data if batch.errors and batch.errors.data else []):
        print(f"  line {error.line}: {error.code}: {error.message}", file=sys.stderr)
    return batch


def _status(client, args: argparse.Namespace) -> int:
    batch = client.batches.retrieve(args.batch_id)
    if args.json:
        print(batch.model_dump_json(indent=2))
        return 0
    counts = batch.request_counts
    print(f"{batch.id}  {batch.status}  {counts.completed}/{counts.total} completed, {counts.failed} failed"
          if counts else f"{batch.id}  {batch.status}")
    for name in ("endpoint", "model", "input_file_id", "output_file_id", "error_file_id"):
        if getattr(batch, name, None):
            print(f"  {name}: {getattr(batch, name)}")
    for name in ("created_at", "in_progress_at", "completed_at", "failed_at", "cancelled_at", "expired_at",
                 "expires_at"):
        if value := getattr(batch, name, None):
            print(f"  {name}: {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(value))}")
    for error in (batch.errors.data if batch.errors and batch.errors.data else []):
        print(f"  line {error.line}: {error.code}: {error.message}")
    return 0


def _download(client, batch, output: Path | None, errors: Path | None) -> None:
    """The output file to ``output`` and the error file to ``errors`` (default: beside ``output``); stdout when
    there is no path."""
    errors = errors or (output.with_name(output.stem + ".errors.jsonl") if output else None)
    for file_id, path, what in ((batch.output_file_id, output, "results"),
                                (batch.error_file_id, errors, "failed or cancelled lines")):
        if not file_id:
            continue
        data = client.files.content(file_id).read()
        if path is None:
            sys.stdout.buffer.write(data)
        else:
            path.write_bytes(data)
            print(f"{len(data.splitlines())} {what} written to {path}", file=sys.stderr)


def _results(client, args: argparse.Namespace) -> int:
    batch = client.batches.retrieve(args.batch_id)
    if batch.status not in FINISHED:
        print(f"{batch.id} is {batch.status}: no results yet (`switchyard batch status {batch.id}`)", file=sys.stderr)
        return 1
    _download(client, batch, args.output, args.errors)
    return 0


def _cancel(client, args: argparse.Namespace) -> int:
    batch = client.batches.cancel(args.batch_id)
    print(f"{batch.id}  {batch.status}")
    return 0
