"""Worker process entry: resolve and load the model, build the engine, serve until SIGTERM/SIGINT.

On a signal the worker stops pulling new requests, finishes the ones it runs, deregisters and exits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from switchyard.scheduler.background import BackgroundPolicy
from switchyard.shared.config import SwitchyardConfig
from switchyard.shared.tracing import setup_tracing
from switchyard.workers import model_store
from switchyard.workers.engine.engine import Engine, EngineConfig
from switchyard.workers.service.metrics import WorkerMetrics
from switchyard.workers.service.status_server import StatusServer, WorkerStatus
from switchyard.workers.service.worker import Worker

log = logging.getLogger("switchyard.worker")


def build_engine(config: SwitchyardConfig):
    if config.worker.torch_threads:
        torch.set_num_threads(config.worker.torch_threads)
    t0 = time.monotonic()
    path = model_store.resolve(config.worker.model, config.model_cache_dir)
    model, tokenizer = model_store.load(path, config.worker.dtype, config.worker.device)
    log.info("loaded %s from %s in %.2f s", config.worker.model, path, time.monotonic() - t0)
    w = config.worker
    return Engine(model, tokenizer, EngineConfig(
        max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=w.max_num_batched_tokens,
        block_size=w.block_size,
        kv_cache_bytes=None if w.kv_cache_gib is None else int(w.kv_cache_gib * 2**30),
        gpu_memory_fraction=w.gpu_memory_fraction,
        enable_prefix_caching=w.enable_prefix_caching,
        cuda_graphs=w.cuda_graphs,
    ))


def _load_and_warm(config: SwitchyardConfig) -> Engine:
    engine = build_engine(config)
    engine.runner.warmup()  # lazy kernel and allocator set-up before the first request, not in it
    return engine


async def _serve(engine, config: SwitchyardConfig, step_thread: ThreadPoolExecutor) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    w = config.worker
    batch_seqs = w.batch_seqs_when_busy
    if batch_seqs is None:
        batch_seqs = 2 if engine.runner.device.type == "cpu" else 0
    background = BackgroundPolicy(seats_when_busy=batch_seqs or None, busy_window_s=w.interactive_busy_s)
    metrics = WorkerMetrics(w.served_name)
    status = WorkerStatus(w.drain_timeout_s)
    status.request_drain = lambda: loop.call_soon_threadsafe(stop.set)
    server = StatusServer(metrics.registry, status, w.metrics_host, w.metrics_port)
    host = socket.gethostname() if w.metrics_host in ("0.0.0.0", "::", "") else w.metrics_host
    metrics_url = f"http://{host}:{server.port}/metrics"
    log.info("metrics, health and readiness on http://%s:%d", host, server.port)
    worker = Worker(engine, w.served_name, config.nats_url, background, step_thread,
                    heartbeat_s=w.heartbeat_s, drain_timeout_s=w.drain_timeout_s, nats_replicas=config.nats_replicas,
                    nats_tls_ca=config.nats_tls_ca, metrics=metrics, metrics_url=metrics_url, aliases=w.aliases)
    ready = asyncio.Event()
    reporting = asyncio.create_task(_report_status(status, ready, stop))
    try:
        await worker.run(stop, ready)
    finally:
        reporting.cancel()
        status.drained.set()
        server.stop()


async def _report_status(status: WorkerStatus, ready: asyncio.Event, stop: asyncio.Event) -> None:
    """Mirror the worker's progress into what its HTTP port reports: ready once it pulls, draining once stopped."""
    await ready.wait()
    status.ready.set()
    await stop.wait()
    status.draining.set()


def serve_worker(config: SwitchyardConfig) -> int:
    setup_tracing("switchyard-worker", config.traces_exporter, config.traces_file)
    # Every torch call of the process on one OS thread, loading included: OpenMP gives each calling thread a pool of
    # its own, and once two pools exist every matmul on 2 cores ran about 1.5x slower (bench/serve.py).
    step_thread = ThreadPoolExecutor(1, thread_name_prefix="switchyard-step")
    try:
        engine = step_thread.submit(_load_and_warm, config).result()
        asyncio.run(_serve(engine, config, step_thread))
    finally:
        step_thread.shutdown()
    return 0
