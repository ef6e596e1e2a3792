"""The soak's report (bench/soak.py): per window and at the end, as markdown appended to bench/RESULTS.md and a
PNG plot of the time series beside it (when matplotlib is installed: ``pip install -e '.[bench]'``)."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from pathlib import Path

from bench.results import RESULTS, append_section, command_line, markdown_table
from bench.soak_load import Outcome

SETTLE_S = 20 * 60  # memory growth is judged after this (caches and pools fill first)
AFTER_FAULT_S = 60  # latency is judged outside this long after each fault


def _pct(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q / 100))] if values else None


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def growth_per_hour(points: list[tuple[float, int]], settle_s: float = SETTLE_S) -> float | None:
    """Relative growth per hour of a series ``(s, value)`` after ``settle_s`` (a least-squares slope over the
    first value after it); None with fewer than two points after it."""
    after = [(t, v) for t, v in points if t >= settle_s and v > 0]
    if len(after) < 2:
        return None
    n = len(after)
    mean_t, mean_v = sum(t for t, _ in after) / n, sum(v for _, v in after) / n
    var = sum((t - mean_t) ** 2 for t, _ in after)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in after) / var if var else 0.0
    return slope * 3600 / after[0][1]


def near_fault(result, out: Outcome) -> bool:
    at = out.sent_at - result.started_wall
    return any(f.at <= at <= f.ended_at + AFTER_FAULT_S for f in result.faults)


AFTER_FAULT_BUCKETS_S = (0, 30, 60, 90, 120, 180, 240, 300)  # the edges of the buckets after a fault's end


AFTER_FAULT_HEADER = ["fault", "at min", "before", *(f"{a}-{b}" for a, b in zip(
    AFTER_FAULT_BUCKETS_S, AFTER_FAULT_BUCKETS_S[1:], strict=False))]


def _around_faults(result, cell: Callable[[float, float], str]) -> list[list[str]]:
    """Per fault: ``cell(begin, end)`` (s into the soak) for the minute before it, then for each bucket after its
    last step (AFTER_FAULT_BUCKETS_S)."""
    edges = AFTER_FAULT_BUCKETS_S
    return [[fault.name, f"{fault.at / 60:.1f}", cell(fault.at - 60, fault.at),
             *(cell(fault.ended_at + a, fault.ended_at + b) for a, b in zip(edges, edges[1:], strict=False))]
            for fault in result.faults]


def after_fault_rows(result) -> list[list[str]]:
    """Per fault: streamed TTFT p99 (every tier) of the requests sent in each bucket after its last step, and in
    the minute before it, so the time latency takes to settle after each fault is read, not guessed."""
    streamed = [o for o in result.ledger if o.kind == "chat_stream" and o.ttft_s is not None]

    def p99(begin: float, end: float) -> str:
        return _s(_pct([o.ttft_s for o in streamed if begin <= o.sent_at - result.started_wall < end], 99))
    return _around_faults(result, p99)


SETTLED_S = (AFTER_FAULT_S, 300)  # after a fault's end: where the target holds latency to the first window's


def settled_rows(result) -> list[list[str]]:
    """Streamed TTFT p50/p90/p99 in the first window, then per kind of fault pooled over every fault of that kind,
    of the streams sent 60-300 s after its end. Pooled, because a 30-s bucket holds a few dozen streams and its
    p99 is one of them: the target (no worse than the first window outside the minute after a fault) is judged on
    hundreds."""
    streamed = [o for o in result.ledger if o.kind == "chat_stream" and o.ttft_s is not None]

    def row(name: str, count: int, ttft: list[float]) -> list[str]:
        return [name, str(count), str(len(ttft)), *(_s(_pct(ttft, q)) for q in (50, 90, 99))]

    first_end = result.samples[0].at if result.samples else result.seconds
    rows = [row("first window (none)", 0, [o.ttft_s for o in streamed if o.sent_at - result.started_wall < first_end
                                            and not near_fault(result, o)])]
    begin, end = SETTLED_S
    for name in dict.fromkeys(f.name for f in result.faults):
        faults = [f for f in result.faults if f.name == name]
        rows.append(row(name, len(faults), [o.ttft_s for o in streamed if any(
            f.ended_at + begin <= o.sent_at - result.started_wall < f.ended_at + end for f in faults)]))
    return rows


def prefill_after_fault_rows(result) -> list[list[str]]:
    """Per fault, over the same buckets: prompt tokens computed per second (not found in a prefix cache) by the
    requests accepted in each, and the share of prompt tokens found cached. A worker's death takes its prefix
    cache with it (unless a host KV tier outlives it): what its conversations come back with is computed again."""
    def cell(begin: float, end: float) -> str:
        mine = [(p, c) for at, p, c in result.prompts if begin <= at - result.started_wall < end]
        prompt, cached = sum(p for p, _ in mine), sum(c for _, c in mine)
        return f"{(prompt - cached) / (end - begin):.0f} ({100 * cached / prompt:.0f}%)" if prompt else "-"
    return _around_faults(result, cell)


def window_rows(result) -> list[list[str]]:
    """Per window: requests by outcome, and streamed TTFT p50/p99 per tier outside the minute after a fault."""
    rows = []
    edges = [s.at for s in result.samples]
    begin = 0.0
    for end in edges:
        mine = [o for o in result.ledger if begin <= o.sent_at - result.started_wall < end]
        by = collections.Counter(o.status for o in mine)
        cells = [f"{begin / 60:.0f}-{end / 60:.0f}", len(mine), by["completed"], by["failed"], by["refused"],
                 by["cut"], by["lost"]]
        for tier in ("enterprise", "pro", "free"):
            ttft = [o.ttft_s for o in mine if o.tier == tier and o.kind == "chat_stream" and o.ttft_s is not None
                    and not near_fault(result, o)]
            cells.append(f"{_s(_pct(ttft, 50))} / {_s(_pct(ttft, 99))}")
        rows.append([str(c) for c in cells])
        begin = end
    return rows


def life_start(result, name: str) -> float:
    """When the last run of process ``name`` started, as the sample that first saw its pid (a restarted process is
    judged from its own start, not the soak's: its first minutes fill caches and pools as everyone's did)."""
    owner = name.split(",")[0]  # "postgres, shared memory ...": the postgres process's
    seen = [(s.at, s.pids.get(owner)) for s in result.samples if owner in s.pids]
    if not seen:
        return 0.0
    last_pid, start = seen[-1][1], seen[-1][0]
    for at, pid in reversed(seen):
        if pid != last_pid:
            break
        start = at
    return 0.0 if start == seen[0][0] else start


def process_rows(result) -> list[list[str]]:
    names = sorted({n for s in result.samples for n in s.processes})
    rows = []
    for name in names:
        series = [(s.at, s.processes[name]) for s in result.samples if name in s.processes]
        started = life_start(result, name)
        growth = growth_per_hour([(t, rss) for t, (rss, _) in series if t >= started], started + SETTLE_S)
        rows.append([name, f"{series[0][1][0] / 2**20:.0f}", f"{series[-1][1][0] / 2**20:.0f}",
                     "-" if growth is None else f"{growth * 100:+.1f}%", f"{(started + SETTLE_S) / 60:.0f}",
                     str(series[0][1][1]), str(series[-1][1][1])])
    return rows


def storage_rows(result) -> list[list[str]]:
    first, last = result.samples[0], result.samples[-1]
    rows = [[f"stream {name}", f"{first.streams.get(name, (0, 0, 0))[0]}", f"{msgs}",
             f"{first.streams.get(name, (0, 0, 0))[1] / 2**20:.1f}", f"{size / 2**20:.1f}", f"{consumers}"]
            for name, (msgs, size, consumers) in sorted(last.streams.items())]
    rows += [[f"table {name}", f"{first.tables.get(name, (0, 0))[0]}", f"{count}",
              f"{first.tables.get(name, (0, 0))[1] / 2**20:.1f}", f"{size / 2**20:.1f}", ""]
             for name, (count, size) in sorted(last.tables.items())]
    rows.append(["data directory", "", "", f"{first.data_dir_bytes / 2**20:.1f}", f"{last.data_dir_bytes / 2**20:.1f}",
                 ""])
    return rows


def tenant_state_rows(result) -> list[list[str]]:
    """Per structure: the entries of every process together, at each sample (its name: which processes hold it)."""
    structures = sorted({k for s in result.samples for held in s.tenant_state.values() for k in held})
    return [[name, *(str(sum(held.get(name, 0) for held in s.tenant_state.values())) for s in result.samples)]
            for name in structures]


def outcome_rows(result) -> list[list[str]]:
    counts = collections.Counter((o.kind, o.status, o.code) for o in result.ledger)
    return [[kind, status, code or "-", str(n)] for (kind, status, code), n in sorted(counts.items())]


def report(result, args) -> str:
    check = result.check
    lines = [f"## Soak: {args.minutes:.0f} min, {args.engine} engine ({time.strftime('%Y-%m-%d')})", "",
             f"`{command_line()}`", "", "Machine: " + "; ".join(result.cpu) + ".", "",
             f"Load: {args.rate} requests/s open loop, {args.tenants} tenants ({args.active} active at a time, one "
             f"replaced every {args.churn:.0f} s; {result.tenants_left} came and went), faults every "
             f"{args.fault_every:.0f} min: {', '.join(args.faults) or 'none'}.", "",
             "### Per window", "",
             markdown_table(["minutes", "sent", "completed", "failed", "refused", "cut", "lost",
                             "TTFT s p50/p99 enterprise", "pro", "free"], window_rows(result)), "",
             "### Faults", "",
             markdown_table(["fault", "at min", "recovered in s"],
                            [[f.name, f"{f.at / 60:.1f}", _s(f.recovered_s)] for f in result.faults]), "",
             "### Streamed TTFT p99 (s) around each fault: the minute before it, then by seconds after its end", "",
             markdown_table(AFTER_FAULT_HEADER, after_fault_rows(result)), "",
             f"### Streamed TTFT (s) {SETTLED_S[0]}-{SETTLED_S[1]} s after each kind of fault's end, pooled, against "
             "the first window", "",
             markdown_table(["fault", "faults", "streams", "p50", "p90", "p99"], settled_rows(result)), "",
             "### Prompt tokens computed per second around each fault (every tier; in brackets, the share found "
             "cached)", "",
             markdown_table(AFTER_FAULT_HEADER, prefill_after_fault_rows(result)), "",
             "### Processes (memory as PSS MiB, open fds; growth per hour from 20 min after the process's own start)",
             "",
             markdown_table(["process", "MiB first", "MiB last", "growth/h", "from min", "fds first", "fds last"],
                            process_rows(result)), "",
             "### Storage (first sample, last sample)", "",
             markdown_table(["what", "rows first", "rows last", "MiB first", "MiB last", "consumers"],
                            storage_rows(result)), "",
             "### State held per tenant, key or conversation (entries, all processes; at each sample)", "",
             markdown_table(["structure", *(f"{s.at / 60:.0f} min" for s in result.samples)],
                            tenant_state_rows(result)), "",
             "### Requests by kind and outcome", "",
             markdown_table(["kind", "outcome", "code", "requests"], outcome_rows(result)), ""]
    if check is not None:
        lines += ["### Ledger", "",
                  f"{check.completed} completed; {check.billed_ok} billed once with the tokens their client was told; "
                  f"unbilled {len(check.unbilled)}, misbilled {len(check.misbilled)}, refused yet billed "
                  f"{len(check.billed_refused)}, usage recorded twice {check.twice}; failed after they ran, billed "
                  f"once for what ran {check.failed_billed}; rows no client can name {len(check.unknown_rows)} (a "
                  f"gateway killed after publishing, before its client heard); seats "
                  f"still held (open_requests rows) at the end {len(check.seats_held)}.",
                  "", *(f"- {line}" for line in (check.unbilled + check.misbilled + check.billed_refused)[:10]),
                  *(f"- no client names {line}" for line in check.unknown_rows[:10]),
                  *(f"- a seat still held by {line}" for line in check.seats_held[:10]),
                  *(f"- usage recorded twice for {rid}: completion tokens {tokens}"
                    for rid, tokens in result.usage_duplicates), ""]
    plot = None if args.results == "-" else plot_series(result, Path(args.results or RESULTS).with_name(
        f"soak-{args.engine}-{time.strftime('%Y%m%d-%H%M')}.png"))
    if plot is not None:
        lines += [f"Plot: `bench/{plot.name}`", ""]
    text = "\n".join(lines)
    print(text, flush=True)
    if args.results != "-":
        append_section(text, *([args.results] if args.results else []))
    return text


def plot_series(result, path: Path) -> Path | None:
    """Resident memory per process, stream messages, table rows and TTFT p99 over time; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')", flush=True)
        return None
    if len(result.samples) < 2:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    minutes = [s.at / 60 for s in result.samples]
    for name in sorted({n for s in result.samples for n in s.processes}):
        # NaN where the process was not there (killed, or not started yet): a gap, not a fall to zero.
        axes[0][0].plot(minutes, [s.processes[name][0] / 2**20 if name in s.processes else float("nan")
                                  for s in result.samples], label=name)
    axes[0][0].set_title("memory, PSS (MiB, log scale: NATS beside a model's worker)")
    axes[0][0].set_yscale("log")
    for name in sorted({n for s in result.samples for n in s.streams}):
        axes[0][1].plot(minutes, [s.streams.get(name, (0, 0, 0))[0] for s in result.samples], label=name)
    axes[0][1].set_title("JetStream messages")
    for name in sorted({n for s in result.samples for n in s.tables}):
        axes[1][0].plot(minutes, [s.tables.get(name, (0, 0))[0] for s in result.samples], label=name)
    axes[1][0].set_title("table rows")
    axes[1][0].set_yscale("symlog")
    for tier in ("enterprise", "pro", "free"):
        values, begin = [], 0.0
        for s in result.samples:
            ttft = [o.ttft_s for o in result.ledger if o.tier == tier and o.kind == "chat_stream"
                    and o.ttft_s is not None and begin <= o.sent_at - result.started_wall < s.at]
            values.append(_pct(ttft, 99) or 0.0)
            begin = s.at
        axes[1][1].plot(minutes, values, label=tier)
    axes[1][1].set_title("streamed TTFT p99 (s)")
    for ax in (a for row in axes for a in row):
        ax.set_xlabel("minutes")
        for fault in result.faults:
            ax.axvline(fault.at / 60, color="grey", linestyle=":", linewidth=0.8)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
