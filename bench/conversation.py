"""Conversation turns and the prefix cache: TTFT of turn N vs turn 1 on a long server-side conversation.

Each turn sends the whole history; with prefix caching the worker computes only the new tail, so a late turn's
time to first token should stay near the first turn's although its prompt is several times longer.

Run against a running system (``make up``; the key is in the data dir's ``default-api-key``)::

    .venv/bin/python bench/conversation.py --api-key "$(cat /var/lib/switchyard/default-api-key)"

Prints a table and appends it to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.results import append_section, markdown_table  # noqa: E402

SYSTEM = ("You are a meticulous railway operations assistant. " * 60).strip()  # a long shared prefix
QUESTION = ("Describe, in detail, how a classification yard sorts freight cars onto outbound tracks, "
            "including humps, retarders and the bowl. ") * 3


def turn(http: httpx.Client, cid: str, content: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ttft = None
    usage = {}
    with http.stream("POST", f"/v1/conversations/{cid}/messages",
                     json={"content": content, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                           "stream": True, "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"ttft_ms": 1000 * (ttft or float("nan")), "total_ms": 1000 * (time.perf_counter() - t0),
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    with httpx.Client(base_url=args.base_url, headers={"Authorization": f"Bearer {args.api_key}"},
                      timeout=300) as http:
        cid = http.post("/v1/conversations", json={"model": args.model, "system": SYSTEM}).json()["id"]
        rows = [turn(http, cid, f"Turn {i + 1}. {QUESTION}", args.max_tokens) for i in range(args.turns)]

    table = markdown_table(("turn", "prompt tokens", "cached tokens", "TTFT ms", "total ms"),
                           [(i, r["prompt_tokens"], r["cached_tokens"], f"{r['ttft_ms']:.0f}", f"{r['total_ms']:.0f}")
                            for i, r in enumerate(rows, 1)])
    ratio = rows[-1]["ttft_ms"] / rows[0]["ttft_ms"]
    summary = (f"TTFT turn {args.turns} / turn 1 = {ratio:.2f} with a {rows[-1]['prompt_tokens']}-token prompt "
               f"at turn {args.turns} vs {rows[0]['prompt_tokens']} at turn 1")
    print(table + "\n\n" + summary)
    append_section(f"## Conversation turns and prefix caching ({dt.date.today()})\n\n"
                   f"`{' '.join(['.venv/bin/python', 'bench/conversation.py', '--api-key', '...'])}` against "
                   f"`make up` ({args.model}, {os.cpu_count()} CPUs, {platform.machine()}, load "
                   f"{os.getloadavg()[0]:.1f}); {args.max_tokens} output tokens per turn, streamed.\n\n"
                   f"{table}\n\n{summary}.\n")


if __name__ == "__main__":
    main()
