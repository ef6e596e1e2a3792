"""How the worker's threads share its cores, so that serving comes first.

Threads at a lower CPU priority than the serving threads (the event loop, the step thread): work whose cost a
tenant chooses (compiling a grammar, preparing a tenant's expensive prompts) takes what serving leaves, rather than
an equal share of the cores.

And a bounded spin for the step's OpenMP threads (torch's and our kernels', one libgomp): after each parallel region
libgomp keeps them spinning for up to 300,000 rounds (milliseconds) before they sleep. With every core serving and
one tenant's grammar compiling beside them, a step's barrier then waits for a thread the kernel has set aside for
that compile, and another tenant's prefill step takes many times its usual CPU and wall time
(tests/e2e/test_hostile_work.py). Ten thousand rounds keep the decode step as fast on an idle machine
(bench/RESULTS.md) and end that wait.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading

log = logging.getLogger("switchyard.worker")

BACKGROUND_NICE = 10  # the nice value of such a thread (the worker's own is 0 unless started otherwise)
OPENMP_ENV = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")  # an operator's own setting of the spin, which is kept


def lower_priority() -> None:
    """Run the calling thread at ``BACKGROUND_NICE`` (a ThreadPoolExecutor's initializer). Linux sets a thread's
    nice value by its thread id; elsewhere nothing changes."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


def bound_openmp_spin(spin_count: int | None) -> None:
    """Have libgomp spin at most ``spin_count`` rounds before an idle thread sleeps (None: libgomp's own default).
    Must run before torch is imported (libgomp reads its environment once, when it loads); an operator's own
    ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` is kept."""
    if spin_count is None or any(name in os.environ for name in OPENMP_ENV):
        return
    if "torch" in sys.modules:
        log.warning("torch was imported before the OpenMP spin could be bounded; libgomp keeps its default")
        return
    os.environ["GOMP_SPINCOUNT"] = str(spin_count)
