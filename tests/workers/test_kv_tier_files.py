"""A KV tier's files: a block is served only whole and only as itself; a tier keeps to its size, evicts the least
valuable blocks first and one tenant's at most its share; a full or vanished filesystem refuses a write, never
breaks a read; a writer killed mid-write leaves nothing another worker can read half-written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from switchyard.workers.kv_tiers import CorruptBlock, FileTier, TierFull, decode_block, encode_block
from switchyard.workers.kv_tiers.file_tier import scope_dir

TOKENS = tuple(range(16))
PAYLOAD = bytes(range(256)) * 16  # 4 KiB


def test_a_block_round_trips_and_any_damage_is_caught():
    data = b"".join(encode_block(42, TOKENS, PAYLOAD))
    assert bytes(decode_block(data, 42, TOKENS, len(PAYLOAD))) == PAYLOAD

    for position in (3, 30, 60, len(data) // 2, len(data) - 1):  # magic, header, tokens, payload, last byte
        flipped = bytearray(data)
        flipped[position] ^= 0x40
        with pytest.raises(CorruptBlock):
            decode_block(flipped, 42, TOKENS, len(PAYLOAD))
    for length in (0, 10, 50, len(data) - 1):
        with pytest.raises(CorruptBlock):
            decode_block(data[:length], 42, TOKENS, len(PAYLOAD))
    with pytest.raises(CorruptBlock):  # a whole, valid file of another block (or renamed) is not this block
        decode_block(data, 43, TOKENS, len(PAYLOAD))
    with pytest.raises(CorruptBlock):
        decode_block(data, 42, (1,) + TOKENS[1:], len(PAYLOAD))
    with pytest.raises(CorruptBlock):  # another layout's payload size
        decode_block(data, 42, TOKENS, len(PAYLOAD) * 2)


def _block(n: int) -> bytes:
    return b"".join(encode_block(n, TOKENS, PAYLOAD))


SIZE = len(_block(0))


def test_a_tier_keeps_to_its_capacity_and_evicts_the_least_reused_first(tmp_path):
    tier = FileTier("host", tmp_path, capacity_bytes=10 * SIZE, scope_share=1.0, reuse_credit_s=3600)
    scope = scope_dir("tenant:a")
    for n in range(10):
        assert tier.put(scope, n, _block(n))
    assert tier.get(scope, 0) is not None  # block 0 is the oldest, but it was reused
    for n in range(10, 15):
        tier.put(scope, n, _block(n))
    assert tier.used_bytes <= 10 * SIZE
    assert tier.num_blocks == len(list((tmp_path / scope).glob("*.kv")))
    assert tier.contains(scope, 0), "a reused block outlives newer blocks nobody read"
    assert not tier.contains(scope, 1)
    assert tier.contains(scope, 14)
    assert tier.counters.evictions >= 5
    assert not tier.put(scope, 14, _block(14)), "a block already held is not written twice"


def test_one_tenant_cannot_flush_another_tenants_blocks(tmp_path):
    tier = FileTier("host", tmp_path, capacity_bytes=20 * SIZE, scope_share=0.5)
    victim, burst = scope_dir("tenant:victim"), scope_dir("tenant:burst")
    for n in range(8):
        tier.put(victim, n, _block(n))
    for n in range(100, 200):  # ten times the tier, from one tenant
        tier.put(burst, n, _block(n))
    assert all(tier.contains(victim, n) for n in range(8)), "the burst evicted its own blocks, not the victim's"
    assert tier.used_bytes <= 20 * SIZE


def test_workers_sharing_a_directory_see_each_others_blocks(tmp_path):
    first = FileTier("host", tmp_path, capacity_bytes=100 * SIZE)
    second = FileTier("host", tmp_path, capacity_bytes=100 * SIZE)
    scope = scope_dir("shared")
    first.put(scope, 7, _block(7))
    assert second.contains(scope, 7)
    assert bytes(second.get(scope, 7) or b"") == _block(7)
    assert not second.put(scope, 7, _block(7)), "the second worker does not write what the first has"
    assert second.get(scope_dir("tenant:other"), 7) is None, "another scope's directory never serves it"


def test_demotion_moves_what_the_host_tier_evicts_to_the_disk_tier(tmp_path):
    disk = FileTier("disk", tmp_path / "disk", capacity_bytes=100 * SIZE)
    host = FileTier("host", tmp_path / "host", capacity_bytes=4 * SIZE, scope_share=1.0,
                    demote=lambda h, scope, data: disk.put(scope, h, data))
    scope = scope_dir("tenant:a")
    for n in range(10):
        host.put(scope, n, _block(n))
    assert host.num_blocks <= 4
    assert all(host.contains(scope, n) or disk.contains(scope, n) for n in range(10)), "nothing was lost, only moved"
    assert bytes(disk.get(scope, 0) or b"") == _block(0)


def test_a_filesystem_that_refuses_writes_raises_tier_full_and_reads_go_on(tmp_path):
    tier = FileTier("disk", tmp_path / "tier", capacity_bytes=100 * SIZE)
    scope = scope_dir("tenant:a")
    tier.put(scope, 1, _block(1))
    # The tier's directory is gone and a file stands in its place: every write now fails as on a dead disk.
    for path in (tmp_path / "tier").rglob("*.kv"):
        path.unlink()
    (tmp_path / "tier" / scope).rmdir()
    (tmp_path / "tier").rmdir()
    (tmp_path / "tier").write_text("not a directory")
    with pytest.raises(TierFull):
        tier.put(scope, 2, _block(2))
    assert tier.counters.write_errors == 1
    assert tier.get(scope, 1) is None  # a miss, not an error


def test_a_file_size_limit_refuses_the_write_without_leaving_a_partial_file(tmp_path):
    # A real refusal by the kernel: RLIMIT_FSIZE makes the write fail (EFBIG) as a full disk fails it (ENOSPC).
    script = textwrap.dedent(f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
        from switchyard.workers.kv_tiers import FileTier, TierFull, encode_block
        tier = FileTier("disk", __import__("pathlib").Path({str(tmp_path)!r}), capacity_bytes=10**9)
        try:
            tier.put("s", 1, encode_block(1, tuple(range(16)), bytes(4096)))
        except TierFull:
            sys.exit(3)
        sys.exit(0)
    """)
    done = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert done.returncode == 3
    assert list(tmp_path.rglob("*")) == [tmp_path / "s"], "no block and no temporary file is left"


def test_a_writer_killed_mid_write_leaves_no_readable_half_block(tmp_path):
    # A worker writing big blocks as fast as it can, killed outright at some point in the middle.
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from switchyard.workers.kv_tiers import FileTier, encode_block
        tier = FileTier("disk", Path({str(tmp_path)!r}), capacity_bytes=10**10)
        payload = bytes(8 * 2**20)
        for n in range(10**6):
            tier.put("s", n, encode_block(n, tuple(range(16)), payload))
            if n == 2:
                print("writing", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "writing\n"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    reader = FileTier("disk", tmp_path, capacity_bytes=10**10)
    blocks = sorted(int(p.stem, 16) for p in (tmp_path / "s").glob("*.kv"))
    assert len(blocks) >= 3
    for n in blocks:  # every block a reader can find is whole
        data = reader.get("s", n)
        assert data is not None
        assert len(decode_block(data, n, tuple(range(16)), 8 * 2**20)) == 8 * 2**20


@pytest.mark.parametrize("wait", [False, True])
def test_a_writer_too_far_behind_drops_blocks_unless_the_tiers_are_how_the_kv_leaves(tmp_path, monkeypatch, wait):
    """A whole-request worker's step never waits for its tier writer: what the writer cannot keep up with is
    dropped (only not kept). A prefill worker's blocks are its handovers: its step waits for the writer instead,
    and every block is written."""
    import threading

    from switchyard.workers.kv_tiers import offload

    layout = offload.BlockLayout("m", "float32", (1, 2, 2, 1, 2))  # 32-byte payloads
    monkeypatch.setattr(offload, "_MAX_PENDING_BYTES", 2 * layout.payload_bytes)
    tiers = offload.KVTiers(offload.TierSettings(host_dir=tmp_path, host_bytes=2**20, wait_when_behind=wait), layout)
    release = threading.Event()

    def payloads(n: int):
        def make():
            release.wait(10)  # the writer is held here: the queue behind it fills
            return [memoryview(bytes([n]) * layout.payload_bytes)]
        return make

    def store_all() -> None:
        for n in range(6):
            tiers.store("t", [(n, (n, n))], payloads(n))

    step = threading.Thread(target=store_all)
    step.start()
    step.join(0.5)
    assert step.is_alive() == wait  # a waiting step is held by the writer; a dropping one has gone on
    release.set()
    step.join(10)
    assert tiers.flush()
    (host,) = tiers.stats()
    assert (host.stores, host.dropped) == ((6, 0) if wait else (2, 4))
    tiers.close()
