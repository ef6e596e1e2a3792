"""bench/chaos.py's accounting and report: what the clients saw against what Postgres and the USAGE stream
billed, a row and notes per case, and the logs worth reading when something went wrong."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import asyncpg
from nats.js.errors import NotFoundError

from bench.results import markdown_table
from switchyard.shared import nats_client, subjects
from switchyard.shared.messages import UsageRecord, decode

if TYPE_CHECKING:
    from bench.chaos import Stream


# -- billing ------------------------------------------------------------------------------------------------------
async def billing(url: str, streams: list[Stream], wait_s: float = 60.0) -> dict:
    """Unbilled, misbilled and billed twice among the completed streams, after waiting up to ``wait_s``; and how
    many failed (accepted) streams have a row."""
    completed = {s.request_id: s.completion_tokens for s in streams if s.outcome == "completed" and s.request_id}
    failed_ids = [s.request_id for s in streams if s.outcome == "failed" and s.accepted and s.request_id]
    conn = await asyncpg.connect(url)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            rows = await conn.fetch("SELECT request_id, completion_tokens FROM requests WHERE request_id = ANY($1)",
                                    list(completed))
            if len(rows) >= len(completed) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        twice = await conn.fetchval("SELECT count(*) FROM (SELECT request_id FROM requests GROUP BY request_id "
                                    "HAVING count(*) > 1) d")
        failed_billed = await conn.fetchval("SELECT count(*) FROM requests WHERE request_id = ANY($1)", failed_ids)
    finally:
        await conn.close()
    billed = {r["request_id"]: r["completion_tokens"] for r in rows}
    misbilled = [(rid, tokens, billed[rid]) for rid, tokens in completed.items()
                 if rid in billed and billed[rid] != tokens]
    return dict(unbilled=[rid for rid in completed if rid not in billed], misbilled=misbilled, twice=twice,
                failed_billed=(failed_billed, len(failed_ids)),
                no_usage_chunk=sum(t is None for t in completed.values()))


async def usage_duplicates(url: str) -> tuple[int, list]:
    """(records on the USAGE stream, request ids with more than one record and their completion_tokens)."""
    nc = await nats_client.connect(url, "chaos-probe", reconnect_forever=False)
    try:
        js = nc.jetstream()
        state = (await js.stream_info(subjects.USAGE_STREAM)).state
        tokens: dict[str, list[int]] = {}
        for seq in range(state.first_seq, state.last_seq + 1):
            try:
                record = decode((await js.get_msg(subjects.USAGE_STREAM, seq)).data, UsageRecord)
            except NotFoundError:
                continue
            tokens.setdefault(record.request_id, []).append(record.completion_tokens)
        return sum(map(len, tokens.values())), [(rid, t) for rid, t in tokens.items() if len(t) > 1]
    finally:
        await nc.close()


# -- the case's logs ------------------------------------------------------------------------------------------------
def case_logs(work: Path, pg_dir: Path) -> list[Path]:
    """Every log of a case: the gateway's and workers' (in ``work``), NATS's, Postgres's."""
    return [*sorted(work.glob("*.log")), *sorted(work.glob("nats/**/nats-server.log")), pg_dir / "postgres.log"]


def log_excerpt(work: Path, pg_dir: Path, lines: int = 25) -> str:
    """The WARNING/ERROR lines of every log of the case, the last ``lines`` of each."""
    out = []
    for path in case_logs(work, pg_dir):
        try:
            text = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        hits = [ln for ln in text if any(w in ln for w in ("WARNING", "ERROR", "[ERR]", "[WRN]", "FATAL", "PANIC",
                                                             "CRITICAL", "Error:"))]
        routes = [ln for ln in hits if "Error trying to connect to route" in ln]  # a killed node's peers, 1/s
        hits = [ln for ln in hits if ln not in routes]
        if hits or routes:
            out.append(f"--- {path.relative_to(path.parents[1])}: {len(hits)} lines, the last {lines}"
                       + (f" ({len(routes)} 'Error trying to connect to route' lines left out)" if routes else ""))
            out += [ln[:300] for ln in hits[-lines:]]
    return "\n".join(out)


# -- the report ----------------------------------------------------------------------------------------------------
def summarize(case: str, streams: list[Stream], marks: list, bill: dict, records: int, dups: list) -> dict:
    by = Counter(s.outcome for s in streams)
    fault_end = marks[-2][0] if len(marks) >= 2 else 0.0  # the last step before "load over"
    after = [s for s in streams if s.sent_at >= fault_end]
    firsts = sorted(s.first_chunk_s for s in streams if s.first_chunk_s is not None)
    return dict(
        case=case, sent=len(streams), completed=by["completed"], lost=by["lost"],
        failed=Counter(s.error for s in streams if s.outcome == "failed"),
        windows={why: (min(t), max(t)) for why in {s.error or s.lost_why or "?" for s in streams
                                                   if s.outcome != "completed"}
                 for t in [[s.sent_at for s in streams if (s.error or s.lost_why or "?") == why]]},
        stall_at=max(((s.longest_gap_s, s.sent_at) for s in streams), default=(0.0, 0.0))[1],
        lost_why=Counter(s.lost_why or "?" for s in streams if s.outcome == "lost"),
        unbilled=len(bill["unbilled"]), misbilled=len(bill["misbilled"]), twice=bill["twice"], usage_dup=len(dups),
        stall=max((s.longest_gap_s for s in streams), default=0.0), first=firsts[-1] if firsts else 0.0,
        first_p50=firsts[len(firsts) // 2] if firsts else 0.0,
        after=(sum(s.outcome == "completed" for s in after), len(after)),
        marks=marks, bill=bill, records=records, dups=dups)


COLUMNS = ["case", "sent", "completed", "failed (reason: count)", "lost", "unbilled", "misbilled", "billed twice",
           "usage dup", "longest stall s", "first chunk p50 / max s", "after: completed/sent"]


def row(r: dict) -> list:
    failed = ", ".join(f"{reason}: {n}" for reason, n in r["failed"].most_common()) or "0"
    lost = str(r["lost"]) + (" (" + ", ".join(f"{w}: {n}" for w, n in r["lost_why"].most_common()) + ")"
                             if r["lost"] else "")
    return [r["case"], r["sent"], r["completed"], failed, lost, r["unbilled"], r["misbilled"], r["twice"],
            r["usage_dup"], f"{r['stall']:.1f}", f"{r['first_p50']:.2f} / {r['first']:.1f}",
            f"{r['after'][0]}/{r['after'][1]}"]


def notes(r: dict) -> list[str]:
    lines = [f"- {r['case']}: fault " + "; ".join(f"{t:.1f} s {what}" for t, what in r["marks"])]
    if r["windows"]:
        lines.append("  - not completed, by reason, sent between: " + "; ".join(
            f"{why} {lo:.1f}-{hi:.1f} s" for why, (lo, hi) in sorted(r["windows"].items(), key=lambda kv: kv[1])))
    lines.append(f"  - longest stall {r['stall']:.1f} s in a stream sent at {r['stall_at']:.1f} s")
    bill = r["bill"]
    billed, failed = bill["failed_billed"]
    lines.append(f"  - billing: {r['records']} USAGE records; {billed} of {failed} accepted-then-failed requests "
                 f"billed (streamed tokens)" + (f"; {bill['no_usage_chunk']} completed without a usage chunk"
                                                if bill["no_usage_chunk"] else ""))
    if bill["unbilled"]:
        lines.append(f"  - unbilled ids (first 5): {bill['unbilled'][:5]}")
    if bill["misbilled"]:
        lines.append(f"  - misbilled (id, client tokens, billed tokens; first 5): {bill['misbilled'][:5]}")
    if r["dups"]:
        lines.append(f"  - USAGE records twice (id, completion_tokens of each; first 5): {r['dups'][:5]}")
    return lines


def print_table(title: str, rows: list[list]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(markdown_table(COLUMNS, rows), flush=True)
        return
    table = Table(title=title, show_lines=True)
    for c in COLUMNS:
        table.add_column(c, overflow="fold")
    for r in rows:
        table.add_row(*map(str, r))
    Console(width=200).print(table)


def cpu_lines() -> list[str]:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    lines = [ln for ln in out if ln.startswith(("Model name", "CPU(s)", "Thread(s) per core"))]
    flags = next((ln.split(":", 1)[1].split() for ln in out if ln.startswith("Flags")), [])
    lines.append("Flags of interest: " + " ".join(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))))
    return [" ".join(ln.split()) for ln in lines]
