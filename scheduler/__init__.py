"""Every scheduling policy, pure Python (no torch, NATS or asyncio), tested without a model.

The engine's (``workers/engine/`` drives them and runs the model):

    scheduler.py        continuous batching: who runs this step, by how many tokens, whom to preempt
    config.py, output.py  its settings, and the plan of one step
    request.py, request_queue.py  sequences and the waiting queue
    kv_cache_manager.py, block_pool.py  KV blocks, prefix caching

The worker intake's (``workers/service/`` asks them what to pull from JetStream):

    tier_share.py       which tier next: weighted fair share, batch on idle capacity
    tenant_share.py     which tenant of a tier next: token-weighted fair share
    background.py       how much batch work may run while interactive work is about

And two both follow: ``seats.py``, who may take a running request's seat when every seat is taken, and
``pausing.py``, whose long generation may be paused (its KV kept) for a waiting tenant far below its share.
"""

from switchyard.scheduler.block_pool import Block, BlockPool
from switchyard.scheduler.config import SchedulerConfig
from switchyard.scheduler.kv_cache_manager import KVCacheManager, hash_block
from switchyard.scheduler.output import ScheduledSeq, SchedulerOutput
from switchyard.scheduler.request import RequestStatus, Sequence, finish_reason
from switchyard.scheduler.request_queue import WaitingQueue
from switchyard.scheduler.scheduler import Scheduler
from switchyard.scheduler.seats import TenantSeats

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
    "TenantSeats",
    "WaitingQueue",
    "finish_reason",
    "hash_block",
]
