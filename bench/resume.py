"""Streams that outlive their gateway: 200 streams through one gateway, that gateway killed (SIGKILL) mid-stream,
every client resuming on a second gateway with Last-Event-ID. Are tokens lost or doubled, and how long is the gap?

    .venv/bin/python bench/resume.py                      # 200 streams of 200 tokens at 20/s, killed 2 s in
    .venv/bin/python bench/resume.py --streams 100 --kill-after 2

One simulated worker (workers/simulated_engine.py, a test double: the model's speed does not matter here), two
gateways. Each client reads its stream from gateway 1, noting every event's id and the time it came; when the
connection breaks it sends the same request to gateway 2 with the last id it got, as a resuming client does
(docs/api/chat.md), and reads on. Reported: streams completed, tokens lost (asked and billed, never received),
tokens received twice (an event id seen twice, or more tokens than asked), and the added gap: from the last event
before the break to the first after the resume, less the stream's own interval between tokens (p50, p99, max).
Target (issue 41): none lost, none doubled, added gap under 1 s. ``lscpu`` is printed and the CPU named.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.local import cpu_name, lscpu  # noqa: E402
from bench.overload import ms, pct  # noqa: E402
from bench.results import append_section, command_line, markdown_table  # noqa: E402

MODEL = "sim"


def start_system(work: Path, args):
    from switchyard.deploy.system import LocalSystem
    from switchyard.shared.config import GatewayConfig, SwitchyardConfig, WorkerConfig
    from tests.support.system import free_port

    config = SwitchyardConfig(data_dir=work, gateway=GatewayConfig(port=free_port(), affinity=False),
                              worker=WorkerConfig(engine="simulated"))
    system = LocalSystem(config, log_dir=work, log_level="WARNING", ephemeral=True)
    system.start_servers()
    system.start_worker("worker-sim", model=MODEL, max_num_seqs=args.streams + 56,
                        simulated_tokens_per_s=args.rate)
    system.start_gateway()
    second_port = free_port()
    second = system.start_gateway("gateway-2", port=second_port)
    system.wait_until_ready(MODEL, timeout_s=120)
    return system, second, f"http://127.0.0.1:{second_port}"


class Client:
    """One stream, resumed once if its connection breaks."""

    def __init__(self, index: int, tokens: int) -> None:
        self.body = {"model": MODEL, "prompt": f"stream {index}", "max_tokens": tokens, "ignore_eos": True,
                     "stream": True, "stream_options": {"include_usage": True}}
        self.ids: list[str] = []
        self.texts = 0  # text events
        self.text = ""
        self.billed: int | None = None
        self.broke_at: float | None = None
        self.resumed_at: float | None = None
        self.done = False
        self.error: str | None = None

    async def read(self, http, url: str, last_event_id: str | None = None) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        async with http.stream("POST", f"{url}/v1/completions", json=self.body, headers=headers) as r:
            if r.status_code != 200:
                self.error = f"{r.status_code} {(await r.aread())[:200]!r}"
                return
            event_id = None
            async for line in r.aiter_lines():
                if line.startswith("id: "):
                    event_id = line[4:]
                elif line.startswith("data: "):
                    if last_event_id is not None and self.resumed_at is None:
                        self.resumed_at = time.perf_counter()
                    if event_id is not None:
                        self.ids.append(event_id)
                    if line == "data: [DONE]":
                        self.done = True
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = event["error"]["code"]
                        return
                    if event.get("usage"):
                        self.billed = event["usage"]["completion_tokens"]
                    if event["choices"] and event["choices"][0]["text"]:
                        self.texts += 1
                        self.text += event["choices"][0]["text"]

    async def run(self, http, first: str, second: str) -> None:
        try:
            await self.read(http, first)
        except Exception as exc:  # the gateway died under it
            self.broke_at = time.perf_counter()
            if not self.ids:
                self.error = f"broke before any event: {exc!r}"[:120]
                return
            try:
                await self.read(http, second, self.ids[-1])
            except Exception as exc:
                self.error = f"resume failed: {exc!r}"


async def run(args, system, second_url: str, report: str) -> None:
    import httpx

    from bench.local import unlimited_keys

    first_gateway = next(s for s in system.services if s.name == "gateway")
    (key,) = await unlimited_keys(system.config.database_url, "enterprise", "resume")
    clients = [Client(i, args.tokens) for i in range(args.streams)]
    for c in clients:
        c.key = key
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=args.streams * 2)) as http:
        tasks = [asyncio.create_task(c.run(http, system.url(), second_url)) for c in clients]
        # Every stream under way first (a burst of opens takes seconds on a small machine), then the kill.
        started = time.perf_counter()
        while not all(c.ids for c in clients) and time.perf_counter() - started < 120:
            await asyncio.sleep(0.1)
        await asyncio.sleep(args.kill_after)
        os.kill(first_gateway.pid, signal.SIGKILL)
        killed_at = time.perf_counter()
        await asyncio.gather(*tasks)
    interval = 1.0 / args.rate
    gaps = [c.resumed_at - c.broke_at - interval for c in clients if c.resumed_at and c.broke_at]
    # The simulated engine's tokens are words, each with its space before it: a client's tokens are its spaces.
    lost = sum(max(0, (c.billed or args.tokens) - c.text.count(" ")) for c in clients)
    doubled = sum(len(c.ids) - len(set(c.ids)) + max(0, c.text.count(" ") - args.tokens) for c in clients)
    failed = [c.error for c in clients if c.error or not c.done]
    rows = [("streams", args.streams),
            ("broken by the kill, then resumed", sum(bool(c.resumed_at) for c in clients)),
            ("completed whole", sum(c.done and not c.error for c in clients)),
            ("failed", f"{len(failed)} {sorted(set(map(str, failed)))[:3]}"),
            ("tokens lost", lost), ("tokens received twice", doubled),
            ("added gap p50 / p99 / max (ms)",
             f"{ms(pct(gaps, 50))} / {ms(pct(gaps, 99))} / {ms(max(gaps, default=None))}"),
            ("first resume after the kill (ms)",
             f"{(min((c.resumed_at for c in clients if c.resumed_at), default=killed_at) - killed_at) * 1000:.0f}")]
    table = markdown_table(("measure", "value"), rows)
    section = (f"## Streams resumed on another gateway ({time.strftime('%Y-%m-%d')}, {cpu_name(report)}, "
               f"{os.cpu_count()} cores)\n\n`{command_line()}`\n\n{args.streams} streams of {args.tokens} "
               f"tokens at {args.rate:g}/s through gateway 1, killed (SIGKILL) {args.kill_after:g} s after every "
               f"stream had its first event; each client resumes on gateway 2 with its last event id.\n\n"
               f"{table}\n")
    print(section)
    append_section(section, args.results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0, help="tokens a second per stream")
    parser.add_argument("--kill-after", type=float, default=2.0,
                        help="seconds after every stream has its first event")
    parser.add_argument("--results", default=None, help="where to append the section ('-': nowhere)")
    args = parser.parse_args()
    if args.results is None:
        from bench.results import RESULTS

        args.results = RESULTS
    report = lscpu()
    work = Path(tempfile.mkdtemp(prefix="switchyard-bench-resume-"))
    os.chmod(work, 0o755)
    system, _, second_url = start_system(work, args)
    try:
        asyncio.run(run(args, system, second_url, report))
    finally:
        system.stop()  # the second gateway too
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
