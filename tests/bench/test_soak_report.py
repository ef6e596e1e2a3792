"""The soak report's judgements on made-up samples (bench/soak_report.py): a process restarted by a fault is
judged from its own start, and the latency and the prefill recomputed around a fault are read per bucket after the
fault's end."""

from __future__ import annotations

from bench.soak import FaultRun, SoakResult
from bench.soak_load import Outcome
from bench.soak_report import after_fault_rows, life_start, prefill_after_fault_rows, process_rows, settled_rows
from bench.soak_sample import Sample

MIB = 2**20


def _samples(gateway_mib: list[int], gateway_pids: list[int]) -> list[Sample]:
    return [Sample(at=600.0 * i, processes={"gateway-0": (mib * MIB, 10), "nats": (50 * MIB, 8)},
                   pids={"gateway-0": pid, "nats": 1})
            for i, (mib, pid) in enumerate(zip(gateway_mib, gateway_pids, strict=True))]


def test_a_restarted_process_is_judged_from_twenty_minutes_after_its_own_start():
    # Grows at first, killed at 40 min, restarted (a new pid) and flat from 20 min after that.
    mib = [100, 110, 120, 125, 60, 80, 90, 90, 90, 90, 90, 90, 90]
    pids = [7, 7, 7, 7, 8, 8, 8, 8, 8, 8, 8, 8, 8]
    result = SoakResult(cpu=[], seconds=7200, samples=_samples(mib, pids))
    assert life_start(result, "gateway-0") == 2400.0
    assert life_start(result, "nats") == 0.0  # never restarted: the soak's own settling applies
    rows = {row[0]: row for row in process_rows(result)}
    assert rows["gateway-0"][3] == "+0.0%" and rows["gateway-0"][4] == "60"
    assert rows["nats"][3] == "+0.0%" and rows["nats"][4] == "20"


def test_the_latency_after_a_fault_is_read_per_bucket_after_its_end():
    fault = FaultRun("worker-stop", at=600.0, ended_at=630.0)
    ledger = [Outcome("chat_stream", "pro", sent_at=1000.0 + at, status="completed", ttft_s=ttft)
              for at, ttft in ((570, 0.1), (640, 9.0), (665, 5.0), (700, 0.2), (900, 0.1))]
    result = SoakResult(cpu=[], seconds=1200, ledger=ledger, faults=[fault], started_wall=1000.0)
    (row,) = after_fault_rows(result)
    assert row[:3] == ["worker-stop", "10.0", "0.10"]  # the minute before it
    assert row[3:] == ["9.00", "5.00", "0.20", "-", "-", "-", "0.10"]  # 0-30 s after its end, 30-60, ...


def test_the_prefill_recomputed_after_a_fault_is_read_per_bucket_after_its_end():
    fault = FaultRun("worker-kill", at=600.0, ended_at=610.0)
    # (accepted at, prompt tokens, cached): before the kill most of each prompt is cached; just after it none is.
    prompts = [(1000.0 + at, prompt, cached) for at, prompt, cached in
               ((560, 400, 300), (590, 200, 100), (615, 600, 0), (630, 300, 0), (660, 100, 50))]
    result = SoakResult(cpu=[], seconds=1200, faults=[fault], started_wall=1000.0, prompts=prompts)
    (row,) = prefill_after_fault_rows(result)
    assert row[:3] == ["worker-kill", "10.0", "3 (67%)"]  # 200 computed over the minute before, 400 of 600 cached
    assert row[3:6] == ["30 (0%)", "2 (50%)", "-"]  # 900 computed in the 30 s after its end; then 50


def test_the_latency_settled_after_a_kind_of_fault_is_pooled_over_its_faults_against_the_first_window():
    faults = [FaultRun("worker-kill", at=600.0, ended_at=610.0), FaultRun("worker-kill", at=1200.0, ended_at=1210.0)]
    sent = [(100, 0.1), (200, 0.3), (615, 9.0), (700, 0.2), (950, 0.9), (1300, 0.4), (1600, 5.0)]
    ledger = [Outcome("chat_stream", "pro", sent_at=1000.0 + at, status="completed", ttft_s=ttft) for at, ttft in sent]
    result = SoakResult(cpu=[], seconds=1800, ledger=ledger, faults=faults, started_wall=1000.0,
                        samples=[Sample(at=300.0, processes={}, pids={})])
    first, kills = settled_rows(result)
    assert first == ["first window (none)", "0", "2", "0.30", "0.30", "0.30"]  # 100 and 200 s: before any fault
    # 60-300 s after either end: 700 and 1300 (615 is in the minute after, 950 and 1600 past 300 s)
    assert kills == ["worker-kill", "2", "2", "0.40", "0.40", "0.40"]
