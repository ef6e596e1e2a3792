"""Freed heap memory handed back to the system once a minute, in the long-running asyncio processes (the gateway
and the jobs).

glibc's malloc keeps what a process frees for its own reuse and returns it to the system only from the top of its
heap, and only past a threshold that rises with the largest block freed. A freed chunk below a live one stays
resident however long it is unused. The jobs process (billing writer, batch runner, housekeeping: bursts of
records and batch files) was measured holding a growing share of such memory: in a two-hour soak its heap grew
about 6 MiB an hour while what it had in use stayed level (``malloc_info``: 1.8 MiB free at minute 5, 6.3 MiB
at minute 22, 0.1 MiB more in use), and one ``malloc_trim(0)`` took its heap's resident size from 48.0 MiB back
to its starting 42.5 MiB. ``malloc_trim`` returns every whole free page, wherever it is in the heap, so calling
it on a timer bounds that memory to what the process frees in a minute.

A call walks the heap's free lists (1-5 ms for a heap of tens of MiB) under the arena's lock, which is why
it runs on a timer and not after each request, and why the workers, whose step thread allocates without pause,
are left out (their memory grows 0.1-0.3% an hour). Elsewhere than glibc (musl, macOS) there is nothing to call
and the timer does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
from collections.abc import AsyncIterator, Callable

TRIM_EVERY_S = 60.0


def _find_malloc_trim() -> Callable[[int], int] | None:
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    try:
        trim = ctypes.CDLL(path).malloc_trim
    except (OSError, AttributeError):  # no C library by that name, or one without malloc_trim (musl, macOS)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_malloc_trim = _find_malloc_trim()


def can_trim() -> bool:
    """Whether this process's C library has ``malloc_trim`` (glibc)."""
    return _malloc_trim is not None


def trim_heap() -> bool:
    """Hand every whole free page of the heap back to the system; True when some was (False where there is
    nothing to call)."""
    return _malloc_trim is not None and _malloc_trim(0) == 1


@contextlib.asynccontextmanager
async def trimming_heap(every_s: float = TRIM_EVERY_S) -> AsyncIterator[None]:
    """For as long as the block runs, ``trim_heap()`` every ``every_s`` seconds on the running loop (a companion
    of the gateway's app, gateway/app.py, and the body of ``switchyard jobs``)."""
    if not can_trim():
        yield
        return

    async def trim_forever() -> None:
        while True:
            await asyncio.sleep(every_s)
            trim_heap()

    task = asyncio.create_task(trim_forever(), name="heap-trim")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
