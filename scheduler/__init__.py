"""Pure-Python scheduling core: sequences, KV block accounting with prefix caching, continuous batching.

No torch, NATS or asyncio here; the engine in ``workers/`` drives it and runs the model.
"""

from switchyard.scheduler.block_pool import Block, BlockPool
from switchyard.scheduler.kv_cache_manager import KVCacheManager, hash_block
from switchyard.scheduler.request import RequestStatus, Sequence, finish_reason
from switchyard.scheduler.request_queue import WaitingQueue
from switchyard.scheduler.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput

__all__ = [
    "Block",
    "BlockPool",
    "KVCacheManager",
    "RequestStatus",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "Sequence",
    "WaitingQueue",
    "finish_reason",
    "hash_block",
]
