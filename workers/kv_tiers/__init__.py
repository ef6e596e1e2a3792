"""KV cache tiers below an engine's block pool: host memory and disk, shared by the workers of one host.

    engine pool ──(a block registered: written through, off the step)──▶ host tier ──(evicted)──▶ disk tier
         ▲                                                                  │                        │
         └──────────(a new request's prefix: loaded, verified, imported)───┴────────────────────────┘

Blocks are addressed by the prefix cache's salted hash chain (scheduler/kv_cache_manager.hash_block), so a tier is
shared by content: any worker of the same model and layout finds what another computed, and never another
tenant's blocks.
"""

from switchyard.workers.kv_tiers.block_file import BlockLayout, CorruptBlock, decode_block, encode_block
from switchyard.workers.kv_tiers.file_tier import FileTier, TierFull
from switchyard.workers.kv_tiers.offload import KVTiers, KVTierStats, LoadedPrefix, TierSettings

__all__ = ["BlockLayout", "CorruptBlock", "FileTier", "KVTierStats", "KVTiers", "LoadedPrefix", "TierFull",
           "TierSettings", "decode_block", "encode_block"]
