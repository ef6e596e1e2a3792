"""The engine's settings, and what they come to for its scheduler.

    WorkerConfig (shared/config.py) ──from_settings──▶ EngineConfig ──scheduler_config──▶ SchedulerConfig
      every EngineSettings field, by name        + what the model and the device decide:
      (the KV cache given in GiB, taken in bytes)  the context, the number of KV blocks

Settings travel whole: a field goes from one to the next by its name, so a new setting is declared where it is
set and where it is used, and nothing in between copies it by hand.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from switchyard.scheduler import SchedulerConfig
from switchyard.shared.config import EngineSettings
from switchyard.workers.kv_tiers import TierSettings


def _available_memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") / 2**30


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512  # per-step token budget shared by prefill chunks and decodes
    block_size: int = 16
    kv_cache_bytes: int | None = None  # CPU: this many bytes; None: 2 GiB on CPU, 80% of free memory on GPU
    gpu_memory_fraction: float = 0.8
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's own context
    # A step of background (batch) sequences only runs this many layers per step() call, so an interactive request
    # added between two calls drops it instead of waiting for it to finish (see Engine.step).
    background_layers_per_call: int = 1
    # CUDA with triton attention: replay decode steps from CUDA graphs captured at start (off: every step eager).
    cuda_graphs: bool = True
    attention_backend: str | None = None  # None: the best for the device (executor.attention.make_attention)
    prepare_threads: int = 2  # threads that call prepare() at once: each gets a tokenizer of its own
    grammar_lexer_fuel: int = 1_000_000  # a grammar's compile budget (guided.Grammars)
    max_grammar_bytes: int = 1_048_576
    kv_offload_gib: float | None = None  # the host tier (workers/kv_tiers/); None: auto (see tier_settings)
    kv_offload_host_dir: Path | None = None
    kv_offload_dir: Path | None = None  # the disk tier; None: none
    kv_offload_disk_gib: float = 16.0
    kv_offload_tenant_share: float = 0.5
    # Record what the KV cache gains and loses, and which blocks chat prompts' message prefixes come to, for the
    # worker's KV events (Engine.take_kv_changes); the worker turns it on.
    kv_events: bool = False
    # The tiers are how this engine's KV leaves (a prefill worker): a step waits for a writer too far behind rather
    # than drop its blocks (TierSettings.wait_when_behind); the worker turns it on.
    kv_offload_wait_when_behind: bool = False
    # "ngram": prompt lookup (speculation.py); "draft": a draft model (draft_model.py, given to the Engine); None: off
    speculative: str | None = None
    num_speculative_tokens: int = 4
    speculative_model: str | None = None  # the draft model's name: the worker loads it (workers/service/engines.py)
    speculative_quantization: str | None = None  # the draft model's weights, as ``quantization`` (None: as loaded)
    # Speculate only in batches where it was measured to give more tokens a second (speculation_gate.py). Off by
    # default: in bench/speculation.py's runs it also chose no drafts at one stream, where they win, and gave 0.90-1.05x
    # of drafts in every step (bench/RESULTS.md); off, every step of a speculating engine gets drafts.
    speculation_measured: bool = False
    # "int8": weight-only int8 projections; "w8a8": int8 activations too (executor/linear.py); None: as loaded
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # "int8": K/V rows as int8 and a scale each (executor/attention/cpu_paged.py)
    # CPU: each step's thread count chosen by measuring steps while serving (executor/thread_tuner.py); off: the
    # threads torch was given, always.
    tune_threads: bool = False

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> EngineConfig:
        """The engine's settings as a worker was given them: every field of ``EngineSettings``, by name."""
        given = settings.model_dump(include=set(EngineSettings.model_fields))
        gib = given.pop("kv_cache_gib")
        return cls(**given, kv_cache_bytes=None if gib is None else int(gib * 2**30))

    def kv_budget(self, device: torch.device) -> int:
        """The KV cache's bytes: as set, else ``gpu_memory_fraction`` of the free memory on a GPU, 2 GiB on a CPU
        (whose memory the model, the OS and the other processes share)."""
        if self.kv_cache_bytes:
            return self.kv_cache_bytes
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            return int(free * self.gpu_memory_fraction)
        return 2 * 2**30

    def tier_settings(self, device: torch.device) -> TierSettings:
        """The KV tiers below the pool: the host tier as set, else a tenth of the available memory on a GPU worker
        (its pool is on the device, so host memory is a second, larger tier) and none on a CPU one (whose pool is
        host memory already); the disk tier where a directory is given."""
        host_gib = self.kv_offload_gib
        if host_gib is None:
            host_gib = _available_memory_gib() / 10 if device.type == "cuda" else 0.0
        host_dir = self.kv_offload_host_dir or Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir(),
                                                    "switchyard-kv")
        return TierSettings(host_dir=host_dir, host_bytes=int(host_gib * 2**30), disk_dir=self.kv_offload_dir,
                            disk_bytes=int(self.kv_offload_disk_gib * 2**30) if self.kv_offload_dir else 0,
                            scope_share=self.kv_offload_tenant_share,
                            wait_when_behind=self.kv_offload_wait_when_behind)

    def scheduler_config(self, num_blocks: int, max_model_len: int, background_priority: int | None,
                         ) -> SchedulerConfig:
        """The scheduler's settings: every field the scheduler shares with this config, by name, with what the
        model and the device decided (``num_blocks``, ``max_model_len``) and the priority from which requests
        are background (batch) work. The token budget is at least one token per sequence, so a full batch of
        decodes always fits a step."""
        shared = {f.name for f in fields(SchedulerConfig)} & {f.name for f in fields(self)}
        given = {name: getattr(self, name) for name in shared}
        given["max_num_batched_tokens"] = max(self.max_num_batched_tokens, self.max_num_seqs)
        given.update(num_blocks=num_blocks, max_model_len=max_model_len, background_priority=background_priority)
        return SchedulerConfig(**given)

