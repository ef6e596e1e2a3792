"""What an engine's KV cache gained and lost since the worker last asked: the content of its KV events
(``KVChanges``, published by the worker: shared/kv_events.py), and the message-prefix segments of the chat requests
it took, each key handed out once per ``REANNOUNCE_S`` (``PrefixSegmentLog``: a conversation sends its history
every turn, so a bounded set remembers the keys already handed out; a router that missed one, or forgot it as idle,
learns it from the next request that carries it once that much time has passed). Ours collects them from its pool
and tiers (workers/engine/kv_change_log.py), the vLLM engine from vLLM's own KV events
(workers/vllm_engine/kv_events.py).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from switchyard.shared.kv_events import PrefixSegment

_KEYS_REMEMBERED = 65_536
# Under the routers' idle time (gateway/kv_index.py, PREFIX_IDLE_S: 900 s): a key in use is announced again before
# any router forgets it, and one a router forgot is announced at its next use.
REANNOUNCE_S = 600.0


class KVChanges(msgspec.Struct):
    """Block hashes (the scheduler's ints) stored and removed per tier (``pool``, ``host``, ``disk``) and the
    message-prefix segments of requests added, since the last ``take``."""

    block_size: int
    stored: dict[str, list[int]] = msgspec.field(default_factory=dict)
    removed: dict[str, list[int]] = msgspec.field(default_factory=dict)
    prefixes: list[PrefixSegment] = msgspec.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (any(self.stored.values()) or any(self.removed.values()) or self.prefixes)


class PrefixSegmentLog:
    """The message-prefix segments of requests added since the last ``take``, each key once per REANNOUNCE_S (see the
    module docstring); both engines' KV changes carry them."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._segments: list[PrefixSegment] = []
        self._handed_out: OrderedDict[bytes, float] = OrderedDict()  # key -> when last handed out; LRU first
        self._clock = clock

    def add(self, segments: list[PrefixSegment]) -> None:
        now = self._clock()
        for segment in segments:
            handed_out = self._handed_out.get(segment.key)
            if handed_out is not None:
                self._handed_out.move_to_end(segment.key)
                if now - handed_out < REANNOUNCE_S:
                    continue
            self._handed_out[segment.key] = now
            self._segments.append(segment)
        while len(self._handed_out) > _KEYS_REMEMBERED:
            self._handed_out.popitem(last=False)

    def take(self) -> list[PrefixSegment]:
        segments, self._segments = self._segments, []
        return segments
