"""Threads of the worker that run at a lower CPU priority than its serving threads (the event loop, the step
thread): work whose cost a tenant chooses (compiling a grammar, preparing a tenant's expensive prompts) takes what
serving leaves, rather than an equal share of the cores."""

from __future__ import annotations

import contextlib
import os
import threading

BACKGROUND_NICE = 10  # the nice value of such a thread (the worker's own is 0 unless started otherwise)


def lower_priority() -> None:
    """Run the calling thread at ``BACKGROUND_NICE`` (a ThreadPoolExecutor's initializer). Linux sets a thread's
    nice value by its thread id; elsewhere nothing changes."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
