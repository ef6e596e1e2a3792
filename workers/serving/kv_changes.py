"""What an engine's KV cache gained and lost since the worker last asked: the content of its KV events
(``KVChanges``, published by the worker: shared/kv_events.py), and the message-prefix segments of the chat requests
it took, each key handed out once (``PrefixSegmentLog``: a conversation sends its history every turn, so a bounded
set remembers the keys already handed out, and a router that missed one learns it from the next request that
carries it). Ours collects them from its pool and tiers (workers/engine/kv_change_log.py), the vLLM engine from
vLLM's own KV events (workers/vllm_engine/kv_events.py).
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from switchyard.shared.kv_events import PrefixSegment

_KEYS_REMEMBERED = 65_536


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
    """The message-prefix segments of requests added since the last ``take``, each key handed out once (see the
    module docstring); both engines' KV changes carry them."""

    def __init__(self) -> None:
        self._segments: list[PrefixSegment] = []
        self._handed_out: OrderedDict[bytes, None] = OrderedDict()

    def add(self, segments: list[PrefixSegment]) -> None:
        for segment in segments:
            if segment.key in self._handed_out:
                self._handed_out.move_to_end(segment.key)
                continue
            self._handed_out[segment.key] = None
            self._segments.append(segment)
        while len(self._handed_out) > _KEYS_REMEMBERED:
            self._handed_out.popitem(last=False)

    def take(self) -> list[PrefixSegment]:
        segments, self._segments = self._segments, []
        return segments
