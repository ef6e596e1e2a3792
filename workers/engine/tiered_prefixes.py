"""Our engine's side of the KV tiers (workers/kv_tiers/): what it writes below the pool and what it loads back.

    add_request ─▶ admit(): the prefix's blocks past the pool's own are in a tier? ─yes─▶ the loader reads them,
                   or on another node (kv_source) and cheaper to fetch   ─yes─▶ (fetches them), the request waits
                   than to compute (remote.TransferCost)?
    step():  take_ready() ─▶ import the loaded blocks into the pool (cached, free) ─▶ the scheduler admits the
             request, whose prefix lookup now hits them (counted in cached_tokens)
             ... schedule → run → update ...
             store_new() ─▶ the blocks the step registered in the prefix cache, copied off the device and handed
                            to the writer thread
             hold_handovers() ─▶ a prefill's hand-over waits until its blocks are written (the decode worker
                            reads them from the tier): released by a later step's release_handovers()

Everything on the step thread is a memory copy; reads, checks and writes are the tiers' threads'. On CUDA the copies
between the device and pinned host memory run on the runner's copy stream (``ModelRunner.blocks_to_host``,
``blocks_to_device``): a step's new blocks leave while the next step computes, and a loaded prefix is on its way to
the device as soon as the loader has gathered it, the compute stream waiting only for its event.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import defaultdict

import torch

from switchyard.scheduler import Sequence
from switchyard.scheduler.kv_cache_manager import KVCacheManager
from switchyard.shared.messages import HANDOVER, KVSource, TokenDelta
from switchyard.workers.executor.model_runner import ModelRunner
from switchyard.workers.kv_tiers import BlockLayout, KVTiers, KVTierStats, TierSettings
from switchyard.workers.kv_tiers.offload import RemoteSource
from switchyard.workers.kv_tiers.remote import KVPeers

log = logging.getLogger("switchyard.engine")

Chain = list[tuple[int, tuple[int, ...]]]


def model_fingerprint(model) -> str:
    """Names the weights a KV block was computed with: the model's name and a digest of its config and of a sample
    of its weights, so a tier is never shared between two checkpoints of one shape (a fine-tune, a new revision)."""
    digest = hashlib.blake2b(model.config.to_json_string(use_diff=False).encode(), digest_size=8)
    for tensor in (model.get_input_embeddings().weight, model.model.norm.weight, model.get_output_embeddings().weight):
        digest.update(tensor.detach().reshape(-1)[:4096].float().cpu().numpy().tobytes())
    name = getattr(model.config, "_name_or_path", "") or model.config.model_type
    return f"{str(name).rstrip('/').rsplit('/', 1)[-1]}@{digest.hexdigest()}"


class TieredPrefixes:
    """Loads prefixes from the tiers into the pool, and writes newly cached blocks to them."""

    def __init__(self, settings: TierSettings, model, runner: ModelRunner, kv_cache: KVCacheManager,
                 record_events: bool = False) -> None:
        dtype = str(runner.kv_dtype).removeprefix("torch.")
        self.layout = BlockLayout(model_fingerprint(model), dtype, runner.block_shape)
        on_cuda = runner.device.type == "cuda"
        self.tiers = KVTiers(settings, self.layout, record_events, pin_memory=on_cuda,
                             to_device=runner.blocks_to_device if on_cuda else None)
        self._runner = runner
        self._kv = kv_cache
        self._loading: dict[str, tuple[Chain, int]] = {}  # request id -> its chain, and where the load starts
        self.num_loaded_blocks = 0  # imported into the pool from a tier, since start
        self._handovers: list[tuple[TokenDelta, threading.Event]] = []  # each waiting for its blocks' writes

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    def connect(self, peers: KVPeers) -> None:
        """Fetch blocks from other nodes through ``peers`` (requests that name a ``kv_source``)."""
        self.tiers.peers = peers

    def read_block(self, layout: str, scope: str, block_hash: int) -> bytes | bytearray | None:
        """A block file this node holds, for another node that asked for it; any thread."""
        return self.tiers.read_block(layout, scope, block_hash)

    def admit(self, request_id: str, seq: Sequence, source: KVSource | None = None) -> bool:
        """Whether ``seq``'s prefix continues past what the pool holds in this node's tiers, or on ``source``'s
        node, when fetching it from there is cheaper than computing it: then its load starts, and the request
        waits for ``take_ready``."""
        chain = self._kv.chain(seq)
        start = self._kv.num_cached_prefix_blocks(chain)
        if start == len(chain):
            return False
        remote = None
        peers = self.tiers.peers
        if source is not None and peers is not None and source.node != peers.node and source.blocks > start:
            upto = min(source.blocks, len(chain)) - start
            if self.tiers.cost.worth(upto, self.layout.block_size, self.layout.block_bytes):
                remote = RemoteSource(source.node, upto)
        if remote is None and not self.tiers.holds(seq.cache_salt, chain[start][0]):
            return False
        self._loading[request_id] = (chain, start)
        self.tiers.start_load(request_id, seq.cache_salt, chain[start:], remote)
        return True

    def note_step(self, num_tokens: int, seconds: float) -> None:
        """A step's tokens and time: the prefill speed remote fetches are weighed against."""
        self.tiers.cost.note_step(num_tokens, seconds)

    def abort(self, request_id: str) -> None:
        self._loading.pop(request_id, None)

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a load to finish (a step with nothing else to run)."""
        self.tiers.load_ready.wait(timeout)

    def take_ready(self) -> list[tuple[str, int]]:
        """The requests whose loads finished, their blocks imported into the pool, each with the bytes of the
        blocks it imported (0: none were, and its prompt is computed)."""
        ready = []
        for loaded in self.tiers.take_loaded():
            entry = self._loading.pop(loaded.key, None)
            if entry is None:
                continue  # aborted while it loaded
            chain, start = entry
            now = self._kv.num_cached_prefix_blocks(chain)
            if now < start or not loaded.blocks:
                ready.append((loaded.key, 0))  # its head evicted meanwhile (the load is unreachable), or nothing
                continue  # found: computed instead
            skip = now - start  # blocks another request computed meanwhile
            ids = self._kv.import_blocks(chain[: start + len(loaded.blocks)], now)
            if ids and loaded.kv is not None:
                kv = loaded.kv[skip : skip + len(ids)]
                self._runner.write_blocks(ids, kv.view(self._runner.kv_dtype).view(len(ids), *self.layout.shape),
                                          loaded.ready)
                self.num_loaded_blocks += len(ids)
            ready.append((loaded.key, len(ids) * self.layout.block_bytes if loaded.kv is not None else 0))
        return ready

    def store_new(self) -> None:
        """Hand the blocks registered since the last call to the writer: copied now, in stream order, so the
        copy is theirs whatever the pool does with the blocks next."""
        by_salt: dict[str, list] = defaultdict(list)
        for block in self._kv.take_newly_cached():
            by_salt[block.cache_salt].append(block)
        for salt, blocks in by_salt.items():
            host, done = self._runner.blocks_to_host([b.block_id for b in blocks])
            self.tiers.store(salt, [(b.block_hash, b.token_ids) for b in blocks], _payloads(host, done))

    def hold_handovers(self, deltas: list[TokenDelta]) -> list[TokenDelta]:
        """``deltas`` less the prefill hand-overs among them (``HANDOVER``), held until the writer has written this
        step's blocks: the decode worker that goes on reads them from this node's tier."""
        if not any(d.finish_reason == HANDOVER for d in deltas):
            return deltas
        written = self.tiers.written()
        self._handovers += [(d, written) for d in deltas if d.finish_reason == HANDOVER]
        return [d for d in deltas if d.finish_reason != HANDOVER]

    def release_handovers(self) -> list[TokenDelta]:
        """The held hand-overs whose blocks are written now."""
        ready: list[TokenDelta] = []
        waiting: list[tuple[TokenDelta, threading.Event]] = []
        for delta, written in self._handovers:
            if written.is_set():
                ready.append(delta)
            else:
                waiting.append((delta, written))
        self._handovers = waiting
        return ready

    @property
    def num_handovers(self) -> int:
        return len(self._handovers)

    def wait_for_writes(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the oldest held hand-over's blocks to be written (a step with nothing else)."""
        if self._handovers:
            self._handovers[0][1].wait(timeout)

    def stats(self) -> list[KVTierStats]:
        return self.tiers.stats()

    def close(self) -> None:
        self.tiers.close()


def _payloads(host: torch.Tensor, done: torch.cuda.Event | None):
    def payloads() -> list[memoryview]:
        if done is not None:
            done.synchronize()  # on the writer thread: the device copy must have landed
        flat = host.view(torch.uint8).reshape(host.shape[0], -1).numpy()
        return [memoryview(row) for row in flat]
    return payloads
