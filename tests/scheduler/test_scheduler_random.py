"""Randomized runs against a fake paged KV cache: a small pool forces preemption, prompts share prefixes,
requests are aborted and stopped at random. Every step checks that each sequence reads exactly its own
tokens' KV through its block table, so a wrong prefix hit, a shared block written twice, or a block reused
while referenced fails at once; at the end every block must be free again."""

from __future__ import annotations

import random

import pytest

from switchyard.scheduler import RequestStatus, Scheduler, SchedulerConfig, Sequence
from switchyard.scheduler.pausing import MAX_PAUSES, PauseRule


class FakeKVCache:
    """Which token each (block, slot) holds: what a model would read back as KV."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}

    def read_and_write(self, sched: Scheduler, output) -> None:
        bs = self.block_size
        for e in output.scheduled:  # reads first: a step's writes are never visible to its own reads
            assert len(e.block_table) * bs >= e.start_pos + e.num_new_tokens
            for pos in range(e.start_pos):
                assert self.slots.get((e.block_table[pos // bs], pos % bs)) == e.seq.token_ids[pos], (
                    f"{e.seq.seq_id} reads wrong KV at position {pos}"
                )
        for e in output.scheduled:
            for pos in range(e.start_pos, e.start_pos + e.num_new_tokens):
                block_id = e.block_table[pos // bs]
                # A block being written must be private to its sequence, never a shared prefix block.
                assert sched.kv_cache.pool.blocks[block_id].ref_count == 1
                self.slots[(block_id, pos % bs)] = e.seq.token_ids[pos]


def toy_model(seq: Sequence, vocab: int) -> int:
    return (seq.token_ids[-1] * 31 + seq.num_tokens) % vocab


def make_requests(rng: random.Random, num: int, max_model_len: int, vocab: int) -> list[Sequence]:
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randrange(4, 24))] for _ in range(3)]
    seqs = []
    for i in range(num):
        prompt = (rng.choice(prefixes) if rng.random() < 0.6 else []) + [
            rng.randrange(vocab) for _ in range(rng.randrange(1, 20))
        ]
        prompt = prompt[: max_model_len - 1]
        seqs.append(
            Sequence(f"s{i}", prompt, max_tokens=rng.randrange(1, 30), priority=rng.randrange(3), arrival=float(i))
        )
    return seqs


@pytest.mark.parametrize("seed", range(30))
def test_random_workload_finishes_and_returns_every_block(seed: int) -> None:
    rng = random.Random(seed)
    config = SchedulerConfig(
        max_num_seqs=rng.choice([2, 4, 8]),
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        block_size=4,
        num_blocks=rng.choice([12, 16, 24]),
        enable_prefix_caching=rng.random() < 0.8,
        max_model_len=48,
        long_prefill_token_threshold=rng.choice([0, 0, 6]),
    )
    sched = Scheduler(config)
    fake_kv = FakeKVCache(config.block_size)
    # A 3-token vocabulary makes equal blocks behind different prefixes common: only the hash chain
    # tells them apart.
    vocab = rng.choice([3, 1000])
    pending = make_requests(rng, 40, config.max_model_len, vocab)
    # Tenants and pausing from an rng of their own (the workloads above stay what they were): in two runs of three,
    # every priority pauses after 1 to 6 tokens, so paused sequences keep KV while others are preempted around them.
    tenant_rng = random.Random(seed + 10_000)
    for seq in pending:
        seq.tenant = f"t{tenant_rng.randrange(4)}"
    if seed % 3:
        sched.set_pause_rules({p: PauseRule(tenant_rng.randrange(1, 7)) for p in range(3)})
    everything = list(pending)
    aborted: set[str] = set()
    stopped: set[str] = set()
    num_preemptions = 0

    for _ in range(5000):
        # Arrivals trickle in, as many as the worker's admission control allows.
        while pending and sched.num_free_slots and rng.random() < 0.7:
            sched.add_request(pending.pop(0))
        # With pausing, the worker also pulls one beyond the seats now and then (a tenant far behind its share).
        if seed % 3 and pending and not sched.num_free_slots and tenant_rng.random() < 0.1:
            sched.add_request(pending.pop(0))
        if not pending and not sched.has_unfinished_requests():
            break
        if rng.random() < 0.03:  # a client disconnects
            live = [s for s in everything if not s.is_finished and sched.get(s.seq_id)]
            if live:
                victim = rng.choice(live)
                assert sched.abort_request(victim.seq_id) is victim
                aborted.add(victim.seq_id)

        output = sched.schedule()
        num_preemptions += len(output.preempted_ids)
        assert output.num_batched_tokens <= config.max_num_batched_tokens
        assert len(output.scheduled) <= config.max_num_seqs
        assert len({e.seq.seq_id for e in output.scheduled}) == len(output.scheduled)
        for e in output.scheduled:
            assert 0 < e.num_new_tokens and e.start_pos + e.num_new_tokens <= e.seq.num_tokens
            assert e.needs_sample == (e.start_pos + e.num_new_tokens == e.seq.num_tokens)
            if config.long_prefill_token_threshold:
                assert e.num_new_tokens <= config.long_prefill_token_threshold
        fake_kv.read_and_write(sched, output)

        sampled = {e.seq.seq_id: toy_model(e.seq, vocab) for e in output.scheduled if e.needs_sample}
        for seq in sched.update_from_output(output, sampled):
            if not seq.is_finished and rng.random() < 0.02:  # the engine saw a stop string
                sched.finish_request(seq.seq_id, RequestStatus.FINISHED_STOPPED)
                stopped.add(seq.seq_id)
            elif not seq.is_finished:
                assert seq.num_uncomputed_tokens == 1  # a decoding sequence: only its new token lacks KV
        check_block_accounting(sched, everything)
    else:
        pytest.fail("workload did not finish in 5000 steps")

    pool = sched.kv_cache.pool
    assert sched.kv_cache.num_free_blocks == config.num_blocks
    assert all(block.ref_count == 0 for block in pool.blocks)
    assert (sched.num_running, sched.num_waiting) == (0, 0)
    for seq in everything:
        assert seq.is_finished
        if seq.seq_id in aborted:
            assert seq.status == RequestStatus.FINISHED_ABORTED
        elif seq.seq_id in stopped:
            assert seq.status == RequestStatus.FINISHED_STOPPED
        else:
            expected = min(seq.max_tokens, config.max_model_len - seq.num_prompt_tokens)
            assert seq.status == RequestStatus.FINISHED_LENGTH
            assert seq.num_output_tokens == expected, seq.seq_id
        # Outputs are what an uninterrupted decode gives, however often the sequence was preempted.
        replay = Sequence("replay", seq.prompt_token_ids, max_tokens=1)
        for token in seq.output_token_ids:
            assert token == toy_model(replay, vocab)
            replay.append_token(token)
    assert all(seq.num_pauses <= MAX_PAUSES for seq in everything)
    if seed == 0:  # the workload is not vacuous: it really preempts and really hits the prefix cache
        assert num_preemptions > 0 and sched.kv_cache.num_prefix_hit_tokens > 0
    if seed == 1:  # and pauses
        assert sched.num_pauses > 0


def check_block_accounting(sched: Scheduler, seqs: list[Sequence]) -> None:
    """Each block's ref_count equals the number of live block tables holding it."""
    refs = [0] * sched.kv_cache.num_blocks
    for seq in seqs:
        for block_id in sched.kv_cache.get_block_table(seq.seq_id):
            assert not seq.is_finished and seq.status in (RequestStatus.RUNNING, RequestStatus.PAUSED)  # KV kept
            refs[block_id] += 1
    assert refs == [block.ref_count for block in sched.kv_cache.pool.blocks]
    assert sched.kv_cache.num_free_blocks == refs.count(0)
