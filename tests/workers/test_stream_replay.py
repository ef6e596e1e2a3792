"""A worker's kept deltas of resumable streams (workers/service/stream_replay.py): what it keeps, when it lets go,
who may take a stream over and from where."""

from __future__ import annotations

import time

import msgspec

from switchyard.shared import subjects
from switchyard.shared.messages import GenerateRequest, Resume, SamplingParams, StreamResume, TokenDelta
from switchyard.workers.service.stream_replay import DEAD_AFTER_S, FINISHED_KEEP_S, StreamReplays

G1 = subjects.gateway_token_subject("g1")
G2 = subjects.gateway_token_subject("g2")


def request(request_id: str = "r", window_s: float = 30.0, tenant: str = "t", **kw) -> GenerateRequest:
    return GenerateRequest(request_id, "m", "pro", SamplingParams(max_tokens=9), created_at=time.time(),
                           deadline_at=time.time() + 30, prompt="x", tenant_id=tenant, reply_subject=G1,
                           resumable_s=window_s, **kw)


def sent(replays: StreamReplays, req: GenerateRequest, count: int, start: int = 0) -> None:
    """Deltas ``start``.. of one token each (id = seq, text "t<seq>"), encoded as b"delta<seq>"."""
    for seq in range(start, start + count):
        replays.record(req, TokenDelta(req.request_id, text=f"t{seq}", token_ids=[seq], num_tokens=1, seq=seq),
                       f"delta{seq}".encode())


def test_the_owner_takes_a_stream_over_and_gets_every_kept_delta_then_the_later_ones_go_to_it():
    replays = StreamReplays("w", started_at=0.0)
    req = request()
    sent(replays, req, 3)
    assert replays.route(req) == G1
    answer, deltas = replays.resume(StreamResume("r", "t", G2, attempt=0, seq=1))
    assert answer.status == "ok" and answer.first_seq == 1 and answer.next_seq == 3 and answer.worker_id == "w"
    assert deltas == [b"delta1", b"delta2"] and answer.request.request_id == "r"  # from the client's own delta
    assert (answer.token_ids, answer.text_len) == ([0], 2)  # what the client had before it
    assert replays.route(req) == G2  # the next delta goes to the gateway that took it over


def test_no_one_else_learns_anything_of_a_stream():
    replays = StreamReplays("w", started_at=0.0)
    req = request()
    sent(replays, req, 2)
    assert replays.resume(StreamResume("r", "intruder", G2)) is None  # another tenant: no answer at all
    assert replays.resume(StreamResume("other", "t", G2)) is None  # not held here
    assert replays.route(req) == G1


def test_a_position_never_sent_is_ahead_and_an_earlier_attempt_resumes_from_the_run_start():
    replays = StreamReplays("w", started_at=0.0)
    req = request(resume=Resume([1, 2], 2, attempt=1))
    sent(replays, req, 2)
    assert replays.resume(StreamResume("r", "t", G2, attempt=1, seq=2))[0].status == "ahead"
    assert replays.resume(StreamResume("r", "t", G2, attempt=2, seq=0))[0].status == "ahead"
    answer, deltas = replays.resume(StreamResume("r", "t", G2, attempt=0, seq=7))  # the client was on the last run
    assert answer.status == "ok" and len(deltas) == 2 and answer.first_seq == 0 and answer.token_ids == []


def test_a_later_attempt_asked_for_first_runs_only_is_moved_and_stays_with_its_gateway():
    replays = StreamReplays("w", started_at=0.0)
    later, first = request(resume=Resume([1, 2], 2, attempt=1)), request("r0")
    sent(replays, later, 2)
    sent(replays, first, 2)
    answer, deltas = replays.resume(StreamResume("r", "t", G2, first_attempt_only=True))
    assert answer.status == "moved" and deltas == [] and answer.request is None
    assert replays.route(later) == G1  # its gateway relays it on (and is told nothing)
    assert replays.resume(StreamResume("r0", "t", G2, first_attempt_only=True))[0].status == "ok"


def test_an_orphan_is_cancelled_after_its_window_and_its_owner_then_hears_it_is_gone():
    replays = StreamReplays("w", started_at=0.0)
    req = request(window_s=10.0)
    sent(replays, req, 2)
    replays.heard("g1", 1.0)
    assert replays.sweep(1.0 + DEAD_AFTER_S) == []  # its gateway not yet taken for dead
    assert replays.sweep(2.0 + DEAD_AFTER_S) == []  # dead: orphaned, its window starts
    assert replays.sweep(2.0 + DEAD_AFTER_S + 10.5) == ["r"]  # no one took it over: cancelled
    assert replays.resume(StreamResume("r", "t", G2))[0].status == "gone"
    assert replays.resume(StreamResume("r", "intruder", G2)) is None


def test_a_stream_taken_over_is_no_orphan_while_its_new_gateway_lives():
    replays = StreamReplays("w", started_at=0.0)
    req = request(window_s=5.0)
    sent(replays, req, 2)
    replays.sweep(10.0)  # g1 never heard: orphaned
    replays.resume(StreamResume("r", "t", G2, seq=1))
    for now in range(11, 40):
        replays.heard("g2", float(now))
        assert replays.sweep(float(now)) == []


def test_a_finished_stream_is_kept_briefly_or_until_its_window_ends_if_its_gateway_dies():
    replays = StreamReplays("w", started_at=0.0)
    alive, dies = msgspec.structs.replace(request("alive"), reply_subject=G2), request("dies", window_s=10.0)
    for req in (alive, dies):
        sent(replays, req, 2)
        replays.finished(req.request_id, 1.0)
    for now in range(1, 8):
        replays.heard("g2", float(now))
    assert replays.sweep(1.0 + FINISHED_KEEP_S + 0.5) == []  # g1 dead since 3 s: "dies" kept
    assert replays.resume(StreamResume("alive", "t", G2))[0].status == "gone"  # let go: its gateway read it all
    assert replays.resume(StreamResume("dies", "t", G2, seq=0))[0].status == "ok"


def test_a_stream_cancelled_by_its_gateway_is_gone_at_once():
    replays = StreamReplays("w", started_at=0.0)
    req = request()
    sent(replays, req, 2)
    replays.finished("r", 1.0, cancelled=True)
    assert replays.resume(StreamResume("r", "t", G2))[0].status == "gone"


def test_kept_deltas_are_bounded_the_oldest_go_while_read_and_an_orphan_overflowing_is_cancelled():
    replays = StreamReplays("w", started_at=0.0, max_bytes=30)
    req = request()
    sent(replays, req, 10)  # 6 bytes each: the 5 newest kept
    answer, deltas = replays.resume(StreamResume("r", "t", G1, seq=8))
    assert answer.first_seq == 8 and deltas == [b"delta8", b"delta9"] and answer.token_ids == list(range(8))
    assert replays.resume(StreamResume("r", "t", G1, seq=4))[0].status == "gone"  # the client needs 4 again
    assert replays.resume(StreamResume("r", "t", G1, seq=5))[0].first_seq == 5
    replays.sweep(10.0)  # g1 never heard: orphaned
    sent(replays, req, 1, start=10)
    assert replays.sweep(10.5) == ["r"]  # no room left for what a resume needs: ended


def test_a_superseded_run_lets_go_without_a_trace_so_only_the_run_that_goes_on_answers():
    replays = StreamReplays("w", started_at=0.0)
    req = request()
    sent(replays, req, 3)
    replays.drop("r", attempt=0)  # a gateway dismissed it: the winner of a hedge, or a continuation, answers
    assert replays.resume(StreamResume("r", "t", G2)) is None  # not even "gone": another worker has it
    sent(replays, req, 1, start=3)  # its last deltas before the cancel took effect
    assert replays.resume(StreamResume("r", "t", G2)) is None
    continuation = request(resume=Resume([1], 1, attempt=1))
    sent(replays, continuation, 2)  # a later attempt here starts afresh
    replays.drop("r", attempt=0)  # the old run's end: it does not take the new one with it
    assert replays.resume(StreamResume("r", "t", G2, attempt=1, seq=0))[0].status == "ok"


def test_every_streams_kept_deltas_together_are_bounded_too():
    replays = StreamReplays("w", started_at=0.0, max_bytes=1000, max_bytes_total=40)
    a, b = request("a"), request("b")
    sent(replays, a, 4)  # 24 bytes
    sent(replays, b, 4)  # 48 in all: b, growing, lets its oldest go
    assert replays.resume(StreamResume("b", "t", G1, seq=1))[0].status == "gone"  # b let its first two go
    assert replays.resume(StreamResume("b", "t", G1, seq=2))[0].first_seq == 2
    assert replays.resume(StreamResume("a", "t", G1, seq=0))[0].first_seq == 0


def test_gateways_missed_while_the_worker_itself_was_away_are_not_taken_for_dead():
    replays = StreamReplays("w", started_at=0.0)
    req = request(window_s=5.0)
    sent(replays, req, 1)
    replays.heard("g1", 1.0)
    replays.reconnected(100.0)  # NATS came back after a long outage: g1's pings were lost, not missing
    assert replays.sweep(101.0) == [] and replays.sweep(100.0 + DEAD_AFTER_S + 5.5) == []
    assert replays.resume(StreamResume("r", "t", G2))[0].status == "ok"  # still there: g1 was never orphaning it
