"""Freed heap memory goes back to the system: a heap left holed by freed buffers shrinks in resident size once
trimmed, and the gateway's and jobs' timer trims for as long as it runs and stops with it."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from switchyard.shared import heap_trim

pytestmark = pytest.mark.skipif(not heap_trim.can_trim(), reason="malloc_trim is glibc's")

# In a process of its own, so that its heap is this script's alone: 20,000 buffers of 2-9 KiB (under glibc's
# mmap threshold, so from the heap), every seventh kept, the rest freed. The kept ones pin the freed space below
# them, so malloc's own trimming at the top cannot return it; the script prints the heap's resident KiB before
# and after one trim_heap().
_HOLED_HEAP = """
import random
from switchyard.shared.heap_trim import trim_heap

def heap_rss_kib():
    with open("/proc/self/smaps") as f:
        in_heap = False
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                in_heap = line.rstrip().endswith("[heap]")
            elif in_heap and line.startswith("Rss:"):
                return int(line.split()[1])

rng = random.Random(0)
kept, freed = [], []
for i in range(20_000):
    (kept if i % 7 == 0 else freed).append(bytearray(rng.choice((2048, 4096, 9000))))
del freed
before = heap_rss_kib()
released = trim_heap()
print(before, heap_rss_kib(), released, len(kept))
"""


def test_a_holed_heap_shrinks_once_trimmed():
    out = subprocess.run([sys.executable, "-c", _HOLED_HEAP], capture_output=True, text=True, timeout=60, check=True)
    before_kib, after_kib, released, _ = out.stdout.split()
    assert released == "True"
    # About 6/7 of ~100 MiB was freed; most of it is whole pages between the kept buffers.
    assert int(before_kib) - int(after_kib) > 40 * 1024, out.stdout


def test_the_timer_trims_while_it_runs_and_stops_with_it(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(heap_trim, "_malloc_trim", lambda pad: calls.append(pad) or 1)

    async def run() -> int:
        async def three_trims() -> None:
            while len(calls) < 3:
                await asyncio.sleep(0.01)

        async with heap_trim.trimming_heap(every_s=0.01):
            await asyncio.wait_for(three_trims(), timeout=10)
        after_exit = len(calls)
        await asyncio.sleep(0.05)
        assert len(calls) == after_exit  # nothing trims once the block has ended
        return after_exit

    assert asyncio.run(run()) >= 3
    assert set(calls) == {0}  # malloc_trim(0): no padding kept at the top


def test_without_malloc_trim_nothing_is_called(monkeypatch):
    monkeypatch.setattr(heap_trim, "_malloc_trim", None)
    assert not heap_trim.trim_heap()

    async def run() -> None:
        async with heap_trim.trimming_heap(every_s=0.01):
            await asyncio.sleep(0.03)

    asyncio.run(run())  # enters and leaves without a task
