"""Each transition of a relayed request's state machine (gateway/relay_state.py): what the client gets, who is told
to stop, and where the request goes on."""

from __future__ import annotations

from switchyard.gateway.relay_state import Phase, RelayState, Verdict
from switchyard.shared.messages import ErrorInfo, TokenDelta


def delta(worker: str | None, seq: int, tokens: int = 0, attempt: int = 0, last: bool = False,
          error: bool = False) -> TokenDelta:
    return TokenDelta("r", text="x" * tokens, num_tokens=tokens, seq=seq, attempt=attempt, worker_id=worker,
                      is_last=last, finish_reason="stop" if last else None,
                      error=ErrorInfo("bad", code="x", status=400) if error else None)


def test_the_first_worker_to_take_it_runs_it_and_a_second_copy_is_dismissed_once():
    state = RelayState()
    assert state.phase is Phase.WAITING and state.worker_id is None
    assert state.on_delta(delta("a", 0)).deliver
    assert state.phase is Phase.RUNNING and state.worker_id == "a"
    twice = state.on_delta(delta("b", 0))  # JetStream delivered it to b too
    assert not twice.deliver and twice.dismiss == ["b"]
    assert not state.on_delta(delta("b", 1, tokens=1)).deliver  # b's later deltas: dropped, not told again
    assert state.on_delta(delta("b", 2, tokens=1)).dismiss == []
    assert state.on_delta(delta("a", 1, tokens=1)).deliver and state.has_output


def test_a_hole_in_the_stream_breaks_the_run_and_the_continuation_goes_on_from_any_worker():
    state = RelayState()
    state.on_delta(delta("a", 0))
    state.on_delta(delta("a", 1, tokens=1))
    broken = state.on_delta(delta("a", 3, tokens=1))  # 2 never came
    assert broken.broken and not broken.deliver
    assert state.lost() == ["a"] and state.worker_id is None
    state.continued(1)
    assert state.phase is Phase.CONTINUING and not state.may_hedge
    late = state.on_delta(delta("a", 4, tokens=1))  # the old run's late delta: dropped
    assert not late.deliver and late.stale is None  # dismissed by name already: not told again
    assert state.on_delta(delta("a", 0, attempt=1)).deliver  # the continuation may run where the hole was
    assert state.phase is Phase.RUNNING and state.worker_id == "a"


def test_a_late_run_of_an_earlier_attempt_is_told_to_stop_that_attempt_once():
    state = RelayState()
    state.on_delta(delta("a", 0))
    state.continued(1)  # a prefill handed over: attempt 1 goes on elsewhere
    assert state.on_delta(delta("b", 0, attempt=1)).deliver
    first = state.on_delta(delta("c", 0, attempt=0))  # a fallback copy of attempt 0 that started late
    assert first.stale == ("c", 0) and not first.deliver
    assert state.on_delta(delta("c", 1, tokens=1, attempt=0)).stale is None


def test_a_hedged_request_is_served_by_whichever_worker_produces_a_token_first_and_the_other_is_dismissed():
    state = RelayState()
    state.on_delta(delta("a", 0))
    assert state.may_hedge
    state.hedged("b", offer_until=100.0)
    assert state.phase is Phase.HEDGED and state.worker_id == "a" and state.hedge_worker == "b"
    assert not state.on_delta(delta("b", 0)).deliver  # b took it: the client already has the request's start
    assert not state.on_delta(delta("a", 1)).deliver  # a step of a's with no token
    won = state.on_delta(delta("b", 1, tokens=2))
    assert won.deliver and won.hedge_won is True and won.dismiss == ["a"]
    assert state.phase is Phase.RUNNING and state.worker_id == "b" and not state.may_hedge
    assert not state.on_delta(delta("a", 2, tokens=1)).deliver  # the loser's late token: never streamed
    assert state.on_delta(delta("b", 2, tokens=1, last=True)).deliver and state.is_finished


def test_the_first_worker_keeps_a_hedged_request_when_its_token_comes_first():
    state = RelayState()
    state.on_delta(delta("a", 0))
    state.hedged("b", offer_until=100.0)
    kept = state.on_delta(delta("a", 1, tokens=1))
    assert kept.deliver and kept.hedge_won is False and kept.dismiss == ["b"] and state.worker_id == "a"
    assert not state.on_delta(delta("b", 0)).deliver


def test_an_error_decides_a_hedge_like_a_token():
    state = RelayState()
    state.on_delta(delta("a", 0))
    state.hedged("b", offer_until=100.0)
    failed = state.on_delta(delta("b", 0, error=True))
    assert failed.deliver and failed.dismiss == ["a"] and state.is_finished


def test_a_hedged_request_goes_on_on_the_other_worker_when_one_is_gone():
    dead: set[str] = set()
    state = RelayState()
    state.on_delta(delta("a", 0))
    state.hedged("b", offer_until=100.0)
    assert state.drop_gone(dead.__contains__, now=50.0) == []  # both alive, b's offer still open
    dead.add("a")
    assert state.drop_gone(dead.__contains__, now=50.0) == ["a"]  # a dead: b's offer may still be taken
    assert state.phase is Phase.RUNNING and state.worker_id == "b" and not state.offer_unused(50.0)
    assert state.offer_unused(101.0)  # b never took it: no one runs the request, the relay continues it
    assert not state.on_delta(delta("a", 1, tokens=1)).deliver  # a was only stalled: its token is dropped


def test_the_hedge_is_dropped_when_its_worker_dies_or_never_takes_it():
    for dead, now in (({"b"}, 50.0), (set(), 101.0)):
        state = RelayState()
        state.on_delta(delta("a", 0))
        state.hedged("b", offer_until=100.0)
        assert state.drop_gone(dead.__contains__, now) == ["b"]
        assert state.phase is Phase.RUNNING and state.worker_id == "a"


def test_both_hedged_runs_gone_is_the_relays_to_continue():
    state = RelayState()
    state.on_delta(delta("a", 0))
    state.hedged("b", offer_until=100.0)
    state.on_delta(delta("b", 0))
    assert state.drop_gone(lambda w: True, now=50.0) == []  # both dead: no run to go on alone
    assert state.phase is Phase.HEDGED
    assert sorted(state.lost()) == ["a", "b"]
    state.continued(1)
    assert state.on_delta(delta("c", 0, attempt=1)).deliver and state.worker_id == "c"


def test_a_hole_in_one_hedged_run_leaves_the_other():
    state = RelayState()
    state.on_delta(delta("a", 0))
    state.hedged("b", offer_until=100.0)
    state.on_delta(delta("b", 0))
    hole = state.on_delta(delta("a", 2))
    assert hole.dismiss == ["a"] and not hole.broken and state.worker_id == "b" and state.phase is Phase.RUNNING


def test_nothing_is_delivered_after_the_end():
    state = RelayState()
    state.on_delta(delta("a", 0))
    assert state.on_delta(delta("a", 1, tokens=1, last=True)).deliver and state.is_finished
    assert not state.on_delta(delta("a", 2, tokens=1)).deliver
    state = RelayState()
    state.on_delta(delta("a", 0))
    state.finish()  # the relay gave up (the client left, an abandon)
    assert not state.on_delta(delta("a", 1, tokens=1)).deliver


def test_deltas_naming_no_worker_are_the_run_the_client_is_on():
    state = RelayState()
    assert state.on_delta(delta(None, 0)).deliver and state.worker_id is None and state.phase is Phase.RUNNING
    assert state.on_delta(delta(None, 1, tokens=1)).deliver
    assert state.on_delta(delta(None, 3, tokens=1)).broken
    assert state.lost() == []  # an unnamed run cannot be told to stop by name


def test_a_stream_another_gateway_took_over_ends_here_whatever_its_numbering():
    state = RelayState()
    state.on_delta(delta("a", 0))
    state.on_delta(delta("a", 1, tokens=1))
    notice = TokenDelta("r", seq=7, worker_id="a", is_last=True,
                        error=ErrorInfo("taken over", code="stream_taken_over", status=409))
    assert not state.handed_off
    verdict = state.on_delta(notice)  # seq 7 after 1: not a hole, the worker's word that the stream moved
    assert verdict.deliver and not verdict.broken and not verdict.dismiss and state.is_finished
    assert state.handed_off  # the relay neither bills it nor stores its end: the other gateway does
    other = RelayState()
    other.on_delta(delta("a", 0))
    forged = TokenDelta("r", seq=1, worker_id="b", is_last=True,
                        error=ErrorInfo("taken over", code="stream_taken_over", status=409))
    assert not other.on_delta(forged).deliver and not other.is_finished  # only the worker running it says so
    assert not other.handed_off


def test_a_run_that_ends_in_an_error_or_its_last_delta_is_not_handed_off():
    for last in (delta("a", 1, error=True), delta("a", 1, tokens=1, last=True)):
        state = RelayState()
        state.on_delta(delta("a", 0))
        assert state.on_delta(last).deliver and state.is_finished and not state.handed_off


def test_a_stream_taken_over_on_its_own_gateway_drops_the_live_copies_that_come_ahead_of_the_resend():
    # The new inbox opened before the worker answered: the worker's token 2 and 3, sent meanwhile, came first.
    state = RelayState()
    state.taken_over("a", 0, resent_until=4)
    assert state.on_delta(delta("a", 2, tokens=1)) == Verdict()  # dropped, not a hole: the resend repeats it
    assert state.on_delta(delta("a", 3, tokens=1)) == Verdict()
    assert [state.on_delta(delta("a", seq, tokens=1)).deliver for seq in range(5)] == [True] * 5
    assert state.on_delta(delta("a", 6, tokens=1)).broken  # once the resend began, a hole is a hole
    elsewhere = RelayState()
    elsewhere.taken_over("a", 0)  # taken over from another gateway: nothing came before the resend
    assert elsewhere.on_delta(delta("a", 2, tokens=1)).broken
