"""Rate limits kept in this gateway's memory, for while Postgres (where the shared windows live) is away.

Each gateway enforces its fair share of every key's limits (``share`` = 1 / the number of gateways), over a
sliding 60-second window, so the gateways together stay within the limits without talking to each other. Keys
are forgotten once their window is empty (``forget_idle``: the gateway's admission upkeep, every minute).
"""

from __future__ import annotations

import math
import time
from collections import deque

WINDOW_S = 60.0


class LocalLimiter:
    """Per key: the (time, tokens) of each request admitted here in the last ``WINDOW_S`` seconds."""

    def __init__(self, share: float = 1.0) -> None:
        self._share = share
        self._windows: dict[str, deque[list[float]]] = {}  # entries [admitted at, tokens]; settle() edits tokens

    def __len__(self) -> int:
        """Keys with a window here."""
        return len(self._windows)

    def admit(self, key_id: str, rpm: int, tpm: int, tokens: int, now: float | None = None) -> float | None:
        """Count the request and its ``tokens`` if this gateway's share of ``rpm`` and ``tpm`` allows; else
        return the seconds until it would (nothing counted)."""
        now = time.monotonic() if now is None else now
        window = self._windows.setdefault(key_id, deque())
        while window and window[0][0] <= now - WINDOW_S:
            window.popleft()
        max_requests = max(1, math.floor(rpm * self._share))
        max_tokens = max(1, math.floor(tpm * self._share))
        used_tokens = sum(entry[1] for entry in window)
        if len(window) + 1 > max_requests or used_tokens + tokens > max_tokens:
            return max(1.0, window[0][0] + WINDOW_S - now) if window else WINDOW_S
        window.append([now, tokens])
        return None

    def settle(self, key_id: str, reserved: int, used: int) -> None:
        """Replace the newest reservation of ``reserved`` tokens by what was ``used``."""
        for entry in reversed(self._windows.get(key_id, ())):
            if entry[1] == reserved:
                entry[1] = used
                return

    def forget_idle(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for key_id in [k for k, w in self._windows.items() if not w or w[-1][0] <= now - WINDOW_S]:
            del self._windows[key_id]
