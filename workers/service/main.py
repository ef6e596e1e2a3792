"""Worker process entry: resolve and load the model, build the engine, serve until SIGTERM/SIGINT.

On a signal the worker stops pulling new requests, finishes the ones it runs, deregisters and exits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from switchyard.shared.config import SwitchyardConfig
from switchyard.shared.gc_pauses import GcPauses, freeze_startup_objects
from switchyard.shared.tracing import setup_tracing
from switchyard.workers import model_store
from switchyard.workers.service.engines import engine_builder
from switchyard.workers.service.metrics import WorkerMetrics
from switchyard.workers.service.status_server import StatusServer, WorkerStatus
from switchyard.workers.service.worker import Worker
from switchyard.workers.serving.interface import ServingEngine

log = logging.getLogger("switchyard.worker")


def with_model_engine(config: SwitchyardConfig) -> SwitchyardConfig:
    """``config`` with the engine that serves its model: a registry embedding model's own in place of the default
    (model_store.engine_for), so the start log and the heartbeat name the engine that runs."""
    engine = model_store.engine_for(config.worker.model, config.worker.engine)
    return config.model_copy(update={"worker": config.worker.model_copy(update={"engine": engine})})


def build_engine(config: SwitchyardConfig) -> ServingEngine[Any]:
    """The engine ``worker.engine`` names (workers/service/engines.py), loaded and warmed up: kernels and allocator
    before the first request, not in it."""
    if config.worker.torch_threads:
        torch.set_num_threads(config.worker.torch_threads)
    return engine_builder(config.worker.engine)(config)


async def _serve(engine: ServingEngine[Any], config: SwitchyardConfig, step_thread: ThreadPoolExecutor) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    w = config.worker
    metrics = WorkerMetrics(w.served_name)
    status = WorkerStatus(w.drain_timeout_s)
    status.request_drain = lambda: loop.call_soon_threadsafe(stop.set)
    server = StatusServer(metrics.registry, status, w.metrics_host, w.metrics_port, w.status_token)
    host = socket.gethostname() if w.metrics_host in ("0.0.0.0", "::", "") else w.metrics_host
    metrics_url = f"http://{host}:{server.port}/metrics"
    log.info("metrics, health and readiness on http://%s:%d", host, server.port)
    worker = Worker(engine, config, step_thread, metrics=metrics, metrics_url=metrics_url)
    ready = asyncio.Event()
    reporting = asyncio.create_task(_report_status(status, ready, stop))
    pauses = GcPauses(metrics.gc_pauses)
    pauses.start()
    # The engine (a model's modules included) lives as long as the worker: full collections need not walk it.
    freeze_startup_objects()
    try:
        await worker.run(stop, ready)
    finally:
        pauses.stop()
        reporting.cancel()
        status.drained.set()
        server.stop()


async def _report_status(status: WorkerStatus, ready: asyncio.Event, stop: asyncio.Event) -> None:
    """Mirror the worker's progress into what its HTTP port reports: ready once it pulls, draining once stopped."""
    await ready.wait()
    status.ready.set()
    await stop.wait()
    status.draining.set()


# How long a thread holding the GIL runs before one waiting for it gets a turn (Python's default: 5 ms). A prepare
# thread rendering a long chat template holds it in such slices; the event loop and the step thread hand a request
# on several times, and each hand-off could wait a whole slice (a tenant's first token then waits on another
# tenant's huge prompts). The other threads mostly run outside the GIL (torch, tokenizers, llguidance), so
# shorter slices cost little.
GIL_SWITCH_INTERVAL_S = 0.001


def serve_worker(config: SwitchyardConfig) -> int:
    setup_tracing("switchyard-worker", config.traces_exporter, config.traces_file)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    # Every torch call of the process on one OS thread, loading included: OpenMP gives each calling thread a pool of
    # its own, and two pools contend for the same cores, slowing every matmul down (bench/serve.py).
    config = with_model_engine(config)
    step_thread = ThreadPoolExecutor(1, thread_name_prefix="switchyard-step")
    try:
        engine = step_thread.submit(build_engine, config).result()
        asyncio.run(_serve(engine, config, step_thread))
    finally:
        step_thread.shutdown()
    return 0
