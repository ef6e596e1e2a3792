"""What a benchmark reads of other processes: CPU seconds, resident memory and system calls from /proc, and where a
Python process spends its time (py-spy, when installed: ``pip install -e '.[bench]'``)."""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime: fields 14 and 15 of stat(5)


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and every process below it (Postgres runs a process per connection)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children[ppid].append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu_seconds(p)
        todo += children.get(p, [])
    return total


def machine_busy_seconds() -> float:
    """The machine's busy CPU seconds so far, every core and every process (user, nice, system, irq, softirq,
    steal: /proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(v) / _TICKS for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9])
    return user + nice + system + irq + softirq + steal


def io_calls(pid: int) -> tuple[int, int]:
    """Write and read system calls ``pid`` has made so far (``/proc/<pid>/io``: ``syscw``, ``syscr``): sockets,
    pipes and files alike."""
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["syscw"]), int(fields["syscr"])


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakRss:
    """The largest resident memory of some processes (summed), sampled every ``interval_s`` until ``stop()``."""

    def __init__(self, pids: list[int], interval_s: float = 0.25) -> None:
        self.pids, self.peak = pids, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, sum(rss_bytes(p) for p in self.pids))
            self._stop.wait(interval_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def profile(pid: int, seconds: float, top: int = 15, watch: tuple[str, ...] = ()) -> tuple[str, dict[str, float]]:
    """Where ``pid`` spent ``seconds``: the functions with most samples on top of the stack (self time) and most
    samples anywhere on it (inclusive), from ``py-spy record``; a note instead when py-spy is missing. Also the
    inclusive share of each function named in ``watch`` (its samples over all samples).

    py-spy leaves out threads it finds idle (in a sleep or a wait), so shares are of the time the process ran."""
    beside = Path(sys.executable).with_name("py-spy")  # in the venv that runs the benchmark
    spy = str(beside) if beside.exists() else shutil.which("py-spy")
    if spy is None:
        return "(py-spy not installed: `pip install -e '.[bench]'` for the profile)", {}
    out = Path(f"/tmp/switchyard-pyspy-{pid}-{time.time_ns()}.txt")
    done = subprocess.run([spy, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "200", "-f", "raw",
                           "-o", str(out), "--nonblocking"], capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        return f"(py-spy failed: {done.stderr.strip()[-300:]})", {}
    own, anywhere, total = collections.Counter(), collections.Counter(), 0
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f.split(" (")[0] for f in stack.split(";") if f]
        if not frames:
            continue
        n = int(count)
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            anywhere[frame] += n
    out.unlink()
    lines = [f"{total} samples; self time (top of stack), then inclusive:"]
    lines += [f"  {n / total:6.1%}  {name}" for name, n in own.most_common(top)]
    lines += ["  --"] + [f"  {n / total:6.1%}  {name}" for name, n in anywhere.most_common(top)]
    return "\n".join(lines), {name: anywhere[name] / max(1, total) for name in watch}
