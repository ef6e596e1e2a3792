"""The step loop (workers/service/step_loop.py) sends a request's first message before the step that starts it
runs: a gateway waiting on an offer (a prefill worker's, the one holding a prefix) learns at once that it was
taken, not a step later, when it might already have given the request to another worker. The engine here is a
stub whose step waits for the test; the rest of the loop is the worker's own."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from switchyard.shared.messages import GenerateRequest, SamplingParams, TokenDelta, Usage
from switchyard.workers.service.held import HeldRequests, Tracked
from switchyard.workers.service.metrics import WorkerMetrics
from switchyard.workers.service.step_loop import StepLoop


class HeldStepEngine:
    """Takes any request; its step waits until ``release`` is set, then ends every request it holds."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.requests: list[str] = []

    def add_request(self, request, prepared) -> int:
        self.requests.append(request.request_id)
        return 7  # prompt tokens

    def abort_request(self, request_id, error=None) -> None:
        self.requests.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self, background_limit=None) -> list[TokenDelta]:
        assert self.release.wait(30), "the test never let the step finish"
        done, self.requests = self.requests, []
        return [TokenDelta(rid, text="x", num_tokens=1, finish_reason="length", usage=Usage(7, 1), is_last=True)
                for rid in done]

    def capacity(self):
        return None

    def stats(self):
        return None

    def take_safety_events(self) -> list:
        return []

    def take_kv_changes(self):
        return None


class RecordingPublisher:
    """The loop's publisher: records what goes out, and when a first message does."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []  # (kind, request id)
        self.first_message = asyncio.Event()

    async def started(self, tracked, step=None) -> None:
        self.sent.append(("started", tracked.request.request_id))
        self.first_message.set()

    async def relay(self, tracked, delta, step=None) -> None:
        self.sent.append(("delta", delta.request_id))

    async def error(self, request, error, step=None) -> None:
        self.sent.append(("error", request.request_id))

    async def send(self, step) -> None:
        pass

    async def finished(self, tracked, finish_reason, now) -> None:
        self.sent.append(("finished", tracked.request.request_id))

    worker_id = "w1"


class Queues:
    def charge(self, *args, **kwargs) -> None:
        pass

    def finished(self, *args) -> None:
        pass

    def has_pending(self) -> bool:
        return False


class StubIntake:
    def __init__(self) -> None:
        self.queues, self.idle, self.acked = Queues(), asyncio.Event(), []

    async def ack(self, msg) -> None:
        self.acked.append(msg)


class StubCapacity:
    def __init__(self) -> None:
        self.changed = asyncio.Event()

    def update(self, engine, moved=True) -> None:
        pass

    def background_limit(self):
        return None

    def take_pause_rules(self):
        return None


async def test_a_requests_first_message_goes_out_before_the_step_that_starts_it_ends():
    engine, out, intake, held = HeldStepEngine(), RecordingPublisher(), StubIntake(), HeldRequests()
    with ThreadPoolExecutor(1) as step_thread:
        loop = StepLoop(engine, step_thread, held, StubCapacity(), intake, out, WorkerMetrics("m"),
                        drain_timeout_s=5)
        stop = asyncio.Event()
        running = asyncio.create_task(loop.run(stop))
        now = time.time()
        request = GenerateRequest("r1", "m", "pro", SamplingParams(max_tokens=1), now, now + 60, prompt="hi")
        held.add(Tracked(request, received_at=now, prepared=SimpleNamespace(num_dropped_messages=0)), msg="msg-r1")
        try:
            # The step is held: only a message sent before it ran can arrive now.
            await asyncio.wait_for(out.first_message.wait(), 10)
            assert out.sent == [("started", "r1")] and intake.acked == ["msg-r1"]
            assert engine.requests == ["r1"]  # in the engine, its step running
        finally:
            engine.release.set()
            stop.set()
            await asyncio.wait_for(running, 30)
    assert out.sent == [("started", "r1"), ("delta", "r1"), ("finished", "r1")]
