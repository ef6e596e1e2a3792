"""Scheduler: token budget, chunking, admission, preemption, prefix hits, aborts, finishing."""

from __future__ import annotations

import pytest

from switchyard.scheduler import RequestStatus, Scheduler, SchedulerConfig, Sequence


def chunks(output) -> list[tuple[str, int, int, bool]]:
    return [(e.seq.seq_id, e.start_pos, e.num_new_tokens, e.needs_sample) for e in output.scheduled]


def test_long_prompt_is_chunked_by_the_token_budget(make_seq, step) -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, num_blocks=64, max_model_len=256))
    sched.add_request(make_seq("a", num_prompt_tokens=100, max_tokens=3))
    plan = []
    for _ in range(4):
        output, got = step(sched)
        plan.append((*chunks(output)[0][1:], len(output.scheduled[0].block_table), len(got)))
    assert plan == [
        (0, 32, False, 2, 0),
        (32, 32, False, 4, 0),
        (64, 32, False, 6, 0),
        (96, 4, True, 7, 1),  # the chunk reaching the end samples the first token
    ]
    output, _ = step(sched)
    assert chunks(output) == [("a", 100, 1, True)]  # a decode is just a one-token chunk


def test_the_prefill_backlog_counts_uncomputed_prompts_waiting_or_running(make_seq, step) -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, num_blocks=64, max_model_len=256))
    sched.add_request(make_seq("a", num_prompt_tokens=100, max_tokens=3))
    sched.add_request(make_seq("b", num_prompt_tokens=10, max_tokens=3))
    assert sched.prefill_backlog_tokens == 99 + 9  # each prompt but its last token (the first decode's input)
    step(sched)  # a's first chunk of 32
    assert sched.prefill_backlog_tokens == 67 + 9
    for _ in range(4):
        step(sched)
    assert sched.prefill_backlog_tokens == 0, "decoding sequences queue no prefill"


def test_decodes_and_running_chunks_go_before_new_prompts(make_seq, step) -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, num_blocks=64, max_model_len=256))
    sched.add_request(make_seq("a", num_prompt_tokens=10, max_tokens=8))
    step(sched)
    sched.add_request(make_seq("b", num_prompt_tokens=100, max_tokens=8))
    output, _ = step(sched)
    assert chunks(output) == [("a", 10, 1, True), ("b", 0, 31, False)]
    assert output.num_batched_tokens == 32
    sched.add_request(make_seq("c", num_prompt_tokens=10, max_tokens=8, arrival=-1.0))
    output, _ = step(sched)
    # b's continuing chunk is running work: it beats c even though c arrived "earlier".
    assert chunks(output) == [("a", 11, 1, True), ("b", 31, 31, False)]


def test_long_prefill_threshold_caps_each_chunk(make_seq, step) -> None:
    config = SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=8, max_model_len=64)
    sched = Scheduler(config)
    sched.add_request(make_seq("a", num_prompt_tokens=20))
    sizes = [step(sched)[0].scheduled[0].num_new_tokens for _ in range(3)]
    assert sizes == [8, 8, 4]


def test_max_num_seqs_and_priority_order_of_admission(make_seq, step) -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=2))
    sched.add_request(make_seq("late-low", max_tokens=2, priority=1, arrival=0.0))
    sched.add_request(make_seq("b", max_tokens=2, arrival=2.0))
    sched.add_request(make_seq("a", max_tokens=2, arrival=1.0))
    assert sched.num_free_slots == 0
    output, _ = step(sched)
    assert [e.seq.seq_id for e in output.scheduled] == ["a", "b"]
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    output, got = step(sched)  # a and b finish on their second token, after this step was planned
    assert [s.status for s in got] == [RequestStatus.FINISHED_LENGTH] * 2
    assert sched.num_free_slots == 1
    output, _ = step(sched)
    assert [e.seq.seq_id for e in output.scheduled] == ["late-low"]


def test_preemption_takes_lowest_priority_then_latest_arrival_and_recomputes(
    make_seq, step, reference_outputs
) -> None:
    config = SchedulerConfig(block_size=4, num_blocks=6, max_model_len=24, enable_prefix_caching=False)
    sched = Scheduler(config)
    seqs = {
        "a": make_seq("a", num_prompt_tokens=4, max_tokens=10, priority=0, arrival=2.0),
        "b": make_seq("b", num_prompt_tokens=4, max_tokens=10, priority=1, arrival=0.0),
        "c": make_seq("c", num_prompt_tokens=4, max_tokens=10, priority=1, arrival=1.0),
    }
    for seq in seqs.values():
        sched.add_request(seq)
    preempted, first_chunk_after = [], {}
    while sched.has_unfinished_requests():
        output, _ = step(sched)
        preempted += output.preempted_ids
        for e in output.scheduled:
            if e.seq.num_preemptions and e.seq.seq_id not in first_chunk_after:
                first_chunk_after[e.seq.seq_id] = (e.start_pos, e.num_new_tokens)
    # Each holds 2 blocks at 8 tokens; at the 9th, a needs a 3rd: c (priority 1, arrived later) goes first.
    # Later a needs a 4th block and b, the lowest running, goes.
    assert preempted == ["c", "b"]
    assert seqs["a"].num_preemptions == 0
    # c had 4 prompt + 5 output tokens when preempted: all recomputed from position 0 in one chunk.
    assert first_chunk_after["c"] == (0, 9)
    for seq in seqs.values():
        assert seq.status == RequestStatus.FINISHED_LENGTH
        assert seq.output_token_ids == reference_outputs(seq.prompt_token_ids, 10)
    assert sched.kv_cache.num_free_blocks == 6


def test_a_sequence_can_preempt_itself_and_resumes_from_its_cached_prefix(
    make_seq, step, reference_outputs
) -> None:
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=3, max_model_len=12))
    a = make_seq("a", num_prompt_tokens=6, max_tokens=2)
    b = make_seq("b", num_prompt_tokens=4, max_tokens=3, priority=1)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a: 2 blocks, b: 1 block, pool full
    output, _ = step(sched)  # b's 5th token needs a 2nd block; b is itself the lowest
    assert output.preempted_ids == ["b"] and chunks(output) == [("a", 6, 1, True)]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    output, _ = step(sched)  # a finished last step: b comes back, its full first block still cached
    assert chunks(output) == [("b", 4, 1, True)]
    assert b.num_cached_tokens == 0  # usage reports hits of the first admission only
    while sched.has_unfinished_requests():
        step(sched)
    assert b.output_token_ids == reference_outputs(b.prompt_token_ids, 3)


def test_a_resumed_sequence_counts_as_cached_only_its_prompt(make_seq, step) -> None:
    """A continuation (``Sequence.resume``) whose prefix hit runs past its prompt into the resumed tokens: usage's
    cached tokens are a part of its prompt tokens, as OpenAI's ``cached_tokens`` is of ``prompt_tokens``."""
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=16, max_model_len=32))
    first = make_seq("first", num_prompt_tokens=6, max_tokens=8)
    sched.add_request(first)
    while sched.has_unfinished_requests():
        step(sched)  # its 14 tokens' first 3 blocks are in the prefix cache now
    again = make_seq("again", prompt=first.prompt_token_ids, max_tokens=8)
    again.resume(first.output_token_ids[:6])  # 12 tokens: a hit of 8 or more would run past the 6-token prompt
    sched.add_request(again)
    output, _ = step(sched)
    assert chunks(output) == [("again", 8, 4, True)]  # 2 blocks hit: 8 tokens, 2 of them resumed ones
    assert again.num_cached_tokens == 6


def test_more_important_waiting_request_preempts_the_least_important_running_one(make_seq, step) -> None:
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=4, max_model_len=16))
    low = make_seq("low", num_prompt_tokens=12, max_tokens=4, priority=2)
    sched.add_request(low)
    step(sched)  # low holds 3 of 4 blocks
    sched.add_request(make_seq("same", num_prompt_tokens=8, priority=2, arrival=1.0))
    output, _ = step(sched)  # low's decode takes the 4th block; "same" does not outrank it
    assert chunks(output) == [("low", 12, 1, True)] and output.preempted_ids == []
    sched.add_request(make_seq("high", num_prompt_tokens=8, priority=0, arrival=2.0))
    output, _ = step(sched)
    # low was scheduled first in this step, then preempted for "high": its entry and tokens are taken back.
    assert chunks(output) == [("high", 0, 8, True)] and output.preempted_ids == ["low"]
    assert output.num_batched_tokens == 8
    assert low.status == RequestStatus.PREEMPTED and sched.num_waiting == 2


def test_prefix_hit_shares_blocks_and_counts_as_computed(make_seq, step) -> None:
    sched = Scheduler(SchedulerConfig(num_blocks=32, max_num_batched_tokens=256, max_model_len=256))
    prefix = list(range(48))
    a = make_seq("a", prompt=prefix + [1, 2], max_tokens=5)
    b = make_seq("b", prompt=prefix + [3, 4, 5], max_tokens=5)
    sched.add_request(a)
    first, _ = step(sched)
    sched.add_request(b)
    output, _ = step(sched)
    assert chunks(output) == [("a", 50, 1, True), ("b", 48, 3, True)]
    assert b.num_cached_tokens == 48 and b.num_computed_tokens == 51
    table_a, table_b = output.scheduled[0].block_table, output.scheduled[1].block_table
    assert table_b[:3] == table_a[:3] == first.scheduled[0].block_table[:3]
    assert table_b[3] != table_a[3]
    assert [sched.kv_cache.pool.blocks[i].ref_count for i in table_b[:3]] == [2, 2, 2]
    assert sched.kv_cache.num_prefix_hit_tokens == 48
    assert sched.kv_cache.num_prefix_query_tokens == 50 + 51


def test_abort_frees_blocks_at_once_wherever_the_sequence_is(make_seq, step) -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, block_size=4, num_blocks=8, max_model_len=32))
    running, waiting = make_seq("run", max_tokens=8), make_seq("wait", arrival=1.0)
    sched.add_request(running)
    sched.add_request(waiting)
    step(sched)
    assert sched.kv_cache.num_free_blocks < 8
    assert sched.abort_request("run") is running
    assert running.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv_cache.num_free_blocks == 8 and sched.num_running == 0 and sched.get("run") is None
    assert sched.abort_request("wait") is waiting and sched.num_waiting == 0
    assert sched.abort_request("run") is None and sched.abort_request("nope") is None
    assert not sched.has_unfinished_requests()
    assert sched.schedule().is_empty


def test_abort_during_a_step_is_skipped_by_the_update(make_seq) -> None:
    sched = Scheduler(SchedulerConfig())
    a, b = make_seq("a"), make_seq("b", arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    output = sched.schedule()
    sched.abort_request("a")
    got = sched.update_from_output(output, {"a": 1, "b": 2})
    assert got == [b] and a.num_output_tokens == 0 and b.output_token_ids == [2]


def test_finish_request_frees_and_can_relabel_a_length_finish(make_seq, step) -> None:
    sched = Scheduler(SchedulerConfig())
    a, b = make_seq("a", max_tokens=5), make_seq("b", max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    _, got = step(sched)
    assert b.status == RequestStatus.FINISHED_LENGTH and got == [a, b]
    # The engine sees b's only token is EOS: the finish reason becomes "stop".
    assert sched.finish_request("b", RequestStatus.FINISHED_STOPPED) is b
    assert RequestStatus.finish_reason(b.status) == "stop"
    assert sched.finish_request("a", RequestStatus.FINISHED_STOPPED) is a
    assert sched.kv_cache.num_free_blocks == sched.config.num_blocks
    assert sched.finish_request("a", RequestStatus.FINISHED_ERROR) is None
    with pytest.raises(ValueError):
        sched.finish_request("x", RequestStatus.RUNNING)


def test_max_model_len_ends_a_sequence_with_length(make_seq, step) -> None:
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=4, max_model_len=16))
    seq = make_seq("a", num_prompt_tokens=14, max_tokens=10)
    sched.add_request(seq)
    while sched.has_unfinished_requests():
        step(sched)
    assert seq.num_output_tokens == 2 and seq.status == RequestStatus.FINISHED_LENGTH


def test_update_rejects_missing_tokens_and_double_application(make_seq) -> None:
    sched = Scheduler(SchedulerConfig())
    sched.add_request(make_seq("a"))
    output = sched.schedule()
    with pytest.raises(KeyError):
        sched.update_from_output(output, {})
    sched = Scheduler(SchedulerConfig())
    sched.add_request(make_seq("a"))
    output = sched.schedule()
    sched.update_from_output(output, {"a": 1})
    with pytest.raises(RuntimeError):
        sched.update_from_output(output, {"a": 1})


def test_add_request_rejects_duplicates_and_prompts_without_room(make_seq) -> None:
    sched = Scheduler(SchedulerConfig(max_model_len=16, block_size=4, num_blocks=4))
    sched.add_request(make_seq("a"))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_seq("a"))
    with pytest.raises(ValueError, match="no room"):
        sched.add_request(make_seq("long", num_prompt_tokens=16))


def test_config_that_cannot_hold_one_full_sequence_fails_with_a_fix() -> None:
    with pytest.raises(ValueError, match="num_blocks >= 128"):
        SchedulerConfig(num_blocks=64, block_size=16, max_model_len=2048)
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=0)


def test_admission_control_counts_queued_and_running_demand(make_seq, step) -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, block_size=4, num_blocks=8, max_model_len=32))
    sched.add_request(make_seq("a", num_prompt_tokens=8))
    assert sched.num_free_slots == 3
    assert sched.can_admit(24) and not sched.can_admit(25)  # 6 + a's 2 blocks vs 8 free
    step(sched)  # a now holds 2 blocks and has 9 tokens: needs 1 more
    assert sched.can_admit(20) and not sched.can_admit(21)  # 5 + 1 headroom vs 6 free


def test_a_more_important_request_takes_a_full_seat_from_the_least_important():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, block_size=4, num_blocks=64,
                                      max_model_len=64))
    low_a = Sequence("low-a", [1] * 8, max_tokens=20, priority=2, arrival=0.0)
    low_b = Sequence("low-b", [2] * 8, max_tokens=20, priority=2, arrival=1.0)
    for seq in (low_a, low_b):
        sched.add_request(seq)
    sched.update_from_output(out := sched.schedule(), {s.seq.seq_id: 5 for s in out.scheduled if s.needs_sample})
    high = Sequence("high", [3] * 8, max_tokens=20, priority=1, arrival=2.0)
    sched.add_request(high)
    out = sched.schedule()
    ids = {s.seq.seq_id for s in out.scheduled}
    assert "high" in ids and "low-b" not in ids  # the later of the two least important gave up its seat
    assert low_b.status == RequestStatus.PREEMPTED and low_b.num_preemptions == 1
    same = Sequence("same", [4] * 8, max_tokens=20, priority=2, arrival=3.0)
    sched.add_request(same)
    sched.update_from_output(out, {s.seq.seq_id: 5 for s in out.scheduled if s.needs_sample})
    assert "same" not in {s.seq.seq_id for s in sched.schedule().scheduled}  # equal priority waits its turn


def test_a_burst_sharing_a_prefix_computes_it_once():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, block_size=16, num_blocks=64,
                                      max_model_len=256))
    prefix = list(range(100, 148))  # three full blocks
    first = Sequence("first", prefix + [1, 2, 3], max_tokens=4, arrival=0.0)
    second = Sequence("second", prefix + [4, 5, 6], max_tokens=4, arrival=1.0)
    other = Sequence("other", list(range(300, 351)), max_tokens=4, arrival=2.0)
    for seq in (first, second, other):
        sched.add_request(seq)
    out = sched.schedule()
    # Strict order: `other` waits behind `second`, which waits one step for `first` to fill the cache.
    assert [s.seq.seq_id for s in out.scheduled] == ["first"]
    sched.update_from_output(out, {"first": 7})
    out = sched.schedule()
    by_id = {s.seq.seq_id: s for s in out.scheduled}
    assert second.num_cached_tokens == 48 and by_id["second"].num_new_tokens == 3
    assert "other" in by_id


def test_a_more_important_prefill_runs_without_less_important_decodes():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_blocks=64,
                                      max_model_len=64))
    batch = [Sequence(f"batch-{i}", [10 + i] * 6, max_tokens=10, priority=3, arrival=float(i)) for i in range(3)]
    for seq in batch:
        sched.add_request(seq)
    out = sched.schedule()
    sched.update_from_output(out, {s.seq.seq_id: 5 for s in out.scheduled if s.needs_sample})
    pro = Sequence("pro", [99] * 6, max_tokens=10, priority=1, arrival=10.0)
    sched.add_request(pro)
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == ["pro"]  # batch decodes sit this step out
    sched.update_from_output(out, {"pro": 7})
    out = sched.schedule()
    assert {s.seq.seq_id for s in out.scheduled} == {"pro", "batch-0", "batch-1", "batch-2"}
    sched.update_from_output(out, {s.seq.seq_id: 5 for s in out.scheduled if s.needs_sample})
    assert all(seq.num_output_tokens == 2 for seq in batch) and pro.num_output_tokens == 2


def test_background_limit_lets_batch_sequences_take_turns_and_interactive_ones_run_every_step(make_seq, step):
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_blocks=64,
                                      max_model_len=64, background_priority=3))
    batch = [make_seq(f"batch-{i}", num_prompt_tokens=6, max_tokens=12, priority=3, arrival=float(i))
             for i in range(4)]
    pro = make_seq("pro", num_prompt_tokens=6, max_tokens=12, priority=1, arrival=9.0)
    for seq in (*batch, pro):
        sched.add_request(seq)
    step(sched)  # everyone prefilled: no limit yet
    assert all(seq.num_output_tokens == 1 for seq in (*batch, pro))

    sched.set_background_limit(2)
    runs: dict[str, int] = {seq.seq_id: 0 for seq in batch}
    for _ in range(4):
        out, _ = step(sched)
        ids = {s.seq.seq_id for s in out.scheduled}
        assert "pro" in ids and len(ids - {"pro"}) == 2  # two batch sequences a step, pro every step
        assert not out.is_background_only
        for seq_id in ids - {"pro"}:
            runs[seq_id] += 1
    assert set(runs.values()) == {2}  # turns, oldest-served first: each batch sequence ran twice in 4 steps
    assert sched.num_running == 5  # the others kept their seats (and blocks)

    late = make_seq("batch-late", num_prompt_tokens=6, max_tokens=4, priority=3, arrival=20.0)
    sched.add_request(late)
    out, _ = step(sched)
    assert "batch-late" not in {s.seq.seq_id for s in out.scheduled}  # no background seat left to admit it

    sched.set_background_limit(None)
    out, _ = step(sched)
    assert {s.seq.seq_id for s in out.scheduled} == {"pro", "batch-late", *runs}  # limit lifted: all run


def test_background_limit_must_leave_at_least_one_seat_and_needs_a_background_priority():
    sched = Scheduler(SchedulerConfig(num_blocks=256, background_priority=3))
    with pytest.raises(ValueError, match="max_seqs"):
        sched.set_background_limit(0)
    with pytest.raises(ValueError, match="background_priority"):
        Scheduler(SchedulerConfig(num_blocks=256)).set_background_limit(2)


def test_a_step_of_background_sequences_only_says_so(make_seq):
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64, background_priority=3))
    sched.add_request(make_seq("batch", priority=3))
    assert sched.schedule().is_background_only
    sched.add_request(make_seq("free", priority=2))
    assert not sched.schedule().is_background_only


def test_a_tenant_holding_every_seat_gives_one_to_another_tenant_of_its_priority():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=64,
                                      max_model_len=64))
    heavy = [Sequence(f"h{i}", [1 + i] * 6, max_tokens=30, priority=2, arrival=float(i), tenant="heavy")
             for i in range(4)]
    for seq in heavy:
        sched.add_request(seq)
    sched.update_from_output(out := sched.schedule(), {s.seq.seq_id: 5 for s in out.scheduled if s.needs_sample})
    light = Sequence("l0", [9] * 6, max_tokens=30, priority=2, arrival=10.0, tenant="light")
    sched.add_request(light)
    out = sched.schedule()
    assert "l0" in {s.seq.seq_id for s in out.scheduled}  # 4 against 0: heavy's latest gives up its seat
    assert heavy[3].status == RequestStatus.PREEMPTED
    sched.update_from_output(out, {s.seq.seq_id: 5 for s in out.scheduled if s.needs_sample})
    # 3 against 1: one apart after a second light request would be 2 against 2; a third waits (3 vs 1 -> 2 vs 2
    # is even, then 2 vs 2 does not yield).
    for i in (1, 2):
        sched.add_request(Sequence(f"l{i}", [9] * 6, max_tokens=30, priority=2, arrival=10.0 + i, tenant="light"))
    running = {s.seq.seq_id for s in sched.schedule().scheduled}
    assert {"l0", "l1"} <= running and "l2" not in running
    assert sum(1 for s in heavy if s.seq_id in running) == 2
