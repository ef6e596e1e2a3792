"""Which KV blocks each message prefix of a chat request comes to: published with the worker's KV events, so a
gateway that only hashes messages (shared/kv_events.py) can look a request's blocks up in its fleet index.

    text      <|im_start|>system\nYou are ...<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>...
    content                       └─ message 0 ─┘ c0                     └ 1 ┘ c1
    tokens    t t t t t t t t t t t t t t t t t t t t t t t t t ...     prefix k ends with the tokens ending by c_k
    blocks    [   b0   ][   b1   ][   b2   ] ...                        and comes to its full blocks b0 .. b(n_k - 1)

A boundary is the end of a message's content in the rendered text: what follows it (the template's closing tokens)
depends only on that message, in the templates chat models ship, so prefix k's blocks are the same in every
conversation that starts with these k + 1 messages. A template for which this does not hold only costs wasted
offers: the worker loads nothing it cannot verify by hash and tokens.
"""

from __future__ import annotations

import bisect

from switchyard.scheduler.kv_cache_manager import hash_chain
from switchyard.shared.kv_events import PrefixSegment, pack_hashes, request_prefix_keys
from switchyard.shared.messages import GenerateRequest


def prefix_segments(req: GenerateRequest, rendered: list[dict], text: str, token_ids: list[int],
                    offsets: list[tuple[int, int]], salt: str, block_size: int) -> list[PrefixSegment]:
    """The segments of ``req``'s message prefixes: ``rendered`` are its messages as given to the chat template
    (one per message, in order), ``text`` the template's output, ``token_ids`` and ``offsets`` its tokens and their
    character spans in it; ``salt`` the request's cache salt (``request_prefix_keys`` includes it too). Stops at the
    first message whose content cannot be found in order."""
    assert req.messages is not None
    keys = request_prefix_keys(req)
    ends: list[int] = []
    furthest = 0
    for _, end in offsets:  # special tokens may carry empty spans: keep the ends non-decreasing
        furthest = max(furthest, end)
        ends.append(furthest)
    max_blocks = (len(token_ids) - 1) // block_size  # as a prefix lookup: at least one token left to compute
    chain = hash_chain(token_ids, block_size, salt, max_blocks)
    segments: list[PrefixSegment] = []
    position, parent, num_blocks = 0, None, 0
    for key, message in zip(keys, rendered):
        content = message.get("content") or ""
        found = text.find(content, position) if content else position
        if found < 0:
            break
        position = found + len(content)
        boundary_tokens = bisect.bisect_right(ends, position)
        upto = min(boundary_tokens // block_size, max_blocks)
        segments.append(PrefixSegment(key, parent, pack_hashes(chain[num_blocks:upto])))
        parent, num_blocks = key, upto
    return segments
