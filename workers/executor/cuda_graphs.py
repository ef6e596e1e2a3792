"""Decode steps replayed from CUDA graphs: one launch per step instead of ~15 per layer.

At start, ``DecodeGraphs.capture`` records the whole decode forward (embedding → layers → LM head) once per batch
size of a ladder (1, 2, 4, 8, 16, 24, ...). A decode-only step is padded to the next captured size and replayed;
steps with prefill chunks run eagerly.

A graph replays fixed addresses, so every per-step input lives in one device buffer that the graphs read:

    ids | positions | slots | seq_lens | split_size | block tables [max_batch, max_blocks]

The host writes the step into a pinned twin of that buffer and copies it over without blocking. The pinned buffer
is rewritten only when the next step is staged, after the engine has waited for this step's sampled tokens, so the
copy has long finished by then. Padding rows write their K/V into a spare block past the pool and have no context,
so attention gives them zeros and they touch no sequence's cache.

A graph replays raw addresses, so every tensor its kernels touch must live as long as it does: the buffers above,
the logits it writes, and the decode kernels' scratch (kept per size in ``_metadata``; freed after capture, the
next capture's ``empty_cache`` would hand that memory back and a replay would write into whatever took it). The
graphs hold their runner weakly: the runner owns them, and a cycle would keep its KV cache alive until the
garbage collector happened to run.

On CPU (Triton interpreted, for CI and ``bench/gpu.py --dry-run``) each "graph" is ``EagerReplay``: the same
buffers and staging, with the forward run again at each replay, so everything but the capture itself is tested.
"""

from __future__ import annotations

import bisect
import logging
import time
import weakref
from dataclasses import dataclass

import torch

from switchyard.workers.executor.attention.triton_paged import (
    TritonAttention,
    TritonMetadata,
    num_decode_splits,
    split_size,
)
from switchyard.workers.executor.transfers import to_device

log = logging.getLogger("switchyard.cuda_graphs")


def batch_ladder(max_batch: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, then every multiple of 8, up to and including ``max_batch``."""
    sizes = [s for s in (1, 2, 4, *range(8, max_batch + 1, 8)) if s <= max_batch]
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


@dataclass(slots=True)
class GraphPass:
    """A decode step staged for replay (``DecodeGraphs.stage``)."""

    num_rows: int
    size: int  # the captured batch size it was padded to
    logit_rows: list[int]


class EagerReplay:
    """A CPU stand-in for ``torch.cuda.CUDAGraph`` over a ``DecodeGraphs`` size: ``replay()`` runs the forward
    again on the graphs' buffers and writes the logits where a captured graph would."""

    def __init__(self, graphs: DecodeGraphs, size: int) -> None:
        self._graphs = weakref.ref(graphs)
        self._size = size

    def replay(self) -> None:
        graphs = self._graphs()
        assert graphs is not None  # the graphs hold this replay: it cannot outlive them
        graphs.logits[self._size].copy_(graphs.forward(self._size))


class DecodeGraphs:
    """Captured decode forwards of one ``ModelRunner`` (see the module docstring)."""

    def __init__(self, runner, max_batch: int, max_context: int, spare_block: int):
        if not isinstance(runner.attention, TritonAttention):
            raise ValueError("CUDA graphs need the triton attention backend")
        self._runner = weakref.ref(runner)
        self.attention: TritonAttention = runner.attention
        self.is_emulated = runner.device.type != "cuda"
        self.block_size = runner.block_size
        self.max_context = max_context
        self.max_blocks = -(-max_context // self.block_size)
        self.sizes = batch_ladder(max_batch)
        n = self.sizes[-1]
        self.spare_slot = spare_block * self.block_size
        total = 4 * n + 1 + n * self.max_blocks
        self.host = torch.zeros(total, dtype=torch.long, pin_memory=not self.is_emulated)
        self._host = self.host.numpy()
        self.device_buffer = torch.zeros(total, dtype=torch.long, device=runner.device)
        buf = self.device_buffer
        self.ids, self.positions, self.slots, self.seq_lens = (buf[i * n:(i + 1) * n] for i in range(4))
        self.split = buf[4 * n:4 * n + 1]
        self.tables = buf[4 * n + 1:].view(n, self.max_blocks)
        self.num_splits: dict[int, int] = {}
        self._metadata: dict[int, TritonMetadata] = {}  # per size: what its graph reads, its scratch included
        self.graphs: dict[int, torch.cuda.CUDAGraph | EagerReplay] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def _make_metadata(self, size: int) -> TritonMetadata:
        attention = self.attention
        splits = self.num_splits[size] = num_decode_splits(size, attention.num_kv_heads, self.max_context,
                                                           attention.num_sms)
        decode = attention.decode_batch(size, self.tables[:size], self.seq_lens[:size], self.split, splits)
        self._metadata[size] = TritonMetadata(self.positions[:size], self.slots[:size], 0, None, decode)
        return self._metadata[size]

    def forward(self, size: int) -> torch.Tensor:
        """The decode forward of ``size`` rows over the buffers: what a graph of that size records."""
        runner = self._runner()
        assert runner is not None  # the runner holds these graphs: they cannot outlive it
        return runner.forward_logits(self.ids[:size], self._metadata[size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per ladder size, largest first so the smaller ones reuse its memory."""
        self._pad_all_rows()
        self._host[4 * self.sizes[-1]] = self.block_size
        self.device_buffer.copy_(self.host)
        if self.is_emulated:
            for size in self.sizes:
                self._make_metadata(size)
                self.logits[size] = self.forward(size)
                self.graphs[size] = EagerReplay(self, size)
            return
        torch.cuda.synchronize()
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._make_metadata(size)
            self.forward(size)  # compiles the kernels outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self.forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = free_before - torch.cuda.mem_get_info()[0]
        log.info("CUDA graphs: captured decode batch sizes %s in %.1f s, %.0f MiB", self.sizes,
                 self.capture_seconds, self.capture_bytes / 2**20)

    def _pad_all_rows(self) -> None:
        """Make every row of the host buffer a padding row: token 0 at position 0, no context, its K/V written to
        the spare block (block tables keep stale ids: rows with no context read none)."""
        n = self.sizes[-1]
        self._host[:4 * n] = 0
        self._host[2 * n:3 * n] = self.spare_slot

    def fits(self, chunks) -> bool:
        """Whether a step of these chunks replays a graph: decodes only, no more rows than the largest size."""
        return len(chunks) <= self.sizes[-1] and all(
            len(c.token_ids) == 1 and c.start_pos < self.max_context for c in chunks)

    def stage(self, chunks) -> GraphPass:
        """Write the step's inputs into the graphs' buffer (host side, then one non-blocking copy)."""
        rows = len(chunks)
        size = self.sizes[bisect.bisect_left(self.sizes, rows)]
        n, bs, host = self.sizes[-1], self.block_size, self._host
        self._pad_all_rows()
        tables = 4 * n + 1
        max_context = 1
        for i, c in enumerate(chunks):
            pos = c.start_pos
            host[i] = c.token_ids[0]
            host[n + i] = pos
            host[2 * n + i] = c.block_table[pos // bs] * bs + pos % bs
            host[3 * n + i] = pos + 1
            num_blocks = pos // bs + 1
            host[tables + i * self.max_blocks:tables + i * self.max_blocks + num_blocks] = c.block_table[:num_blocks]
            max_context = max(max_context, pos + 1)
        host[4 * n] = split_size(max_context, self.num_splits[size], bs)
        used = tables + rows * self.max_blocks
        self.device_buffer[:used].copy_(self.host[:used], non_blocking=not self.is_emulated)
        return GraphPass(rows, size, [i for i, c in enumerate(chunks) if c.needs_logits])

    def replay(self, staged: GraphPass) -> torch.Tensor:
        """Run the staged step; float32 logits of its ``logit_rows``."""
        self.graphs[staged.size].replay()
        logits = self.logits[staged.size]
        if len(staged.logit_rows) == staged.num_rows:
            return logits[:staged.num_rows]
        return logits.index_select(0, to_device(staged.logit_rows, torch.long, logits.device))
