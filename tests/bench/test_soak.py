"""The soak's five-minute version (bench/soak.py): the whole system on embedded servers and the simulated engine,
mixed traffic from tenants coming and going, a worker SIGKILLed and NATS restarted along the way. Every request
accepted is answered once and billed once, nothing a client was refused is billed, and no service process's open
files grow from one minute to the end, so a leak or a lost request cannot land unseen."""

from __future__ import annotations

import collections

from bench.soak import Soak, parse_args

FD_MARGIN = 16  # sockets and files open now and then (a pool's connection, a log rotation): not a trend


def test_five_minutes_of_mixed_traffic_through_two_faults_lose_and_leak_nothing():
    args = parse_args(["--minutes", "5", "--window", "1", "--fault-every", "2", "--faults", "worker-kill",
                       "nats-restart", "--tenants", "60", "--active", "12", "--churn", "5", "--rate", "3",
                       "--results", "-"])
    result = Soak(args).run()
    check = result.check
    outcomes = collections.Counter((o.status, o.code) for o in result.ledger)
    assert check is not None and check.completed > 300, outcomes
    assert check.exact, (check.unbilled[:5], check.misbilled[:5], check.billed_refused[:5], check.twice)
    assert check.unknown_rows == [], (check.unknown_rows, outcomes)  # no gateway killed: a client sent each
    assert not [o for o in result.ledger if o.status == "lost"], outcomes  # accepted, then no end and no error
    assert {status for status, _ in outcomes} <= {"completed", "failed", "refused", "cut"}
    assert [f.name for f in result.faults] == ["worker-kill", "nats-restart"]
    assert all(f.recovered_s is not None and f.recovered_s < 30 for f in result.faults), result.faults
    assert result.tenants_left > 30  # tenants came and went
    first, last = result.samples[0], result.samples[-1]
    for name in ("gateway-0", "gateway-1", "jobs"):
        assert last.processes[name][1] <= first.processes[name][1] + FD_MARGIN, (name, first.processes,
                                                                                last.processes)
