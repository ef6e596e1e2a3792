"""Streams that outlive their gateway: the deltas a worker sent of each resumable request, kept so that another
gateway can take the stream over when the one relaying it dies (gateway/stream_resume.py).

    every delta of a resumable request ──▶ record: kept (at most MAX_BYTES_PER_REQUEST; the oldest go first while
                                           its gateway reads, the request is cancelled once they would while none
                                           does), sent to the request's route: its gateway's token subject
    gateways' pings (llm.gw.alive.<id>) ─▶ heard: a request whose gateway is silent for DEAD_AFTER_S is orphaned
    sweep, every second              ──▶ an orphan past its window (``GenerateRequest.resumable_s``): cancelled,
                                           billed for what ran; a finished one's deltas dropped after FINISHED_KEEP_S
                                           (kept until its window ends if its gateway died meanwhile)
    llm.resume.<request_id>          ──▶ resume: the owner tenant's ask answered ok (the route moves to the asking
                                           gateway, the deltas from the client's on are sent there again, then the
                                           later ones; the answer says what the client had before them),
                                           or gone (a recent request ended, for its tenant only); anyone else's
                                           ask is not answered, so the asker cannot tell it from an unknown id

Pure bookkeeping: the worker's event loop calls it (workers/service/publisher.py sends, worker.py subscribes).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from switchyard.shared import subjects
from switchyard.shared.messages import GenerateRequest, ResumeAnswer, StreamResume, TokenDelta

# A gateway is taken for dead after missing this many of its pings (as the gateways judge workers).
DEAD_AFTER_S = 3 * subjects.ALIVE_INTERVAL_S
# A finished request's deltas are kept this long in case its gateway dies before it wrote the last of them.
FINISHED_KEEP_S = DEAD_AFTER_S + 2 * subjects.ALIVE_INTERVAL_S
MAX_BYTES_PER_REQUEST = 4 << 20
# Every stream's together: a tenant asking for long outputs with many logprobs must not grow the worker's memory
# by max_num_seqs times the per-request cap. Past it, each stream that grows lets its oldest deltas go.
MAX_BYTES_TOTAL = 256 << 20
GONE_REMEMBERED = 10_000  # ended requests whose owner is told "gone" rather than nothing


@dataclass
class Replay:
    """One resumable request's sent deltas and where they go."""

    request: GenerateRequest
    route: str  # the token subject its deltas go to: its gateway's, or the one that took the stream over
    deltas: list[bytes] = field(default_factory=list)  # encoded TokenDeltas, seq first_seq onward
    # Before each kept delta: how many of ``tokens`` and how much of choice 0's text its client had, so that a
    # gateway taking the stream over from the middle is sent only what follows, and knows what precedes it.
    marks: list[tuple[int, int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # choice 0's token ids of this run, every one
    text_len: int = 0  # choice 0's text of this run, in characters
    first_seq: int = 0
    size: int = 0
    orphaned_at: float | None = None  # when its gateway was found gone (None: one reads it)
    finished_at: float | None = None  # when its last delta went out
    overflowed: bool = False  # its kept deltas passed the cap while no gateway read them


class StreamReplays:
    """Every resumable request of one worker; see the module docstring. Times are ``time.monotonic()``."""

    def __init__(self, worker_id: str, started_at: float, max_bytes: int = MAX_BYTES_PER_REQUEST,
                 max_bytes_total: int = MAX_BYTES_TOTAL) -> None:
        self._worker_id = worker_id
        self._max_bytes = max_bytes
        self._max_bytes_total = max_bytes_total
        self._total = 0  # bytes kept, every stream's
        self._replays: dict[str, Replay] = {}
        self._gone: OrderedDict[str, str | None] = OrderedDict()  # request id -> its tenant
        self._heard: dict[str, float] = {}  # gateway id -> last ping
        self._listening_since = started_at

    def __len__(self) -> int:
        return len(self._replays)

    def tenant_state(self) -> dict[str, int]:
        """Resumable requests kept (each its tenant's), ended ones remembered with their tenant (tenant_state.py)."""
        return {"resumable_streams": len(self._replays), "resume_gone": len(self._gone)}

    def route(self, request: GenerateRequest) -> str | None:
        """Where ``request``'s deltas go now."""
        replay = self._replays.get(request.request_id)
        return replay.route if replay is not None else request.reply_subject

    def route_of(self, request_id: str) -> str | None:
        """Where ``request_id``'s deltas go now, if it is kept here."""
        replay = self._replays.get(request_id)
        return replay.route if replay is not None else None

    def record(self, request: GenerateRequest, delta: TokenDelta, data: bytes) -> None:
        """``request``'s ``delta`` (``data`` encoded) goes out now. A run's first delta starts its replay; a new
        attempt's (a continuation that came back here) starts it again."""
        if not request.resumable_s or request.reply_subject is None:
            return
        seq = delta.seq
        replay = self._replays.get(request.request_id)
        if seq == 0:
            route = replay.route if replay is not None else request.reply_subject
            if replay is not None:
                self._total -= replay.size
            replay = self._replays[request.request_id] = Replay(request, route)
        elif replay is None:
            return  # a run let go of (superseded): nothing of it is kept again
        replay.deltas.append(data)
        replay.marks.append((len(replay.tokens), replay.text_len))
        if delta.index == 0:
            replay.tokens += delta.token_ids or ()
            replay.text_len += len(delta.text)
        replay.size += len(data)
        self._total += len(data)
        while ((replay.size > self._max_bytes or self._total > self._max_bytes_total)
               and len(replay.deltas) > 1):
            if replay.orphaned_at is not None:
                replay.overflowed = True  # no one reads it and it would lose what a resume needs: the sweep ends it
                return
            dropped = len(replay.deltas.pop(0))
            replay.marks.pop(0)
            replay.size -= dropped
            self._total -= dropped
            replay.first_seq += 1

    def finished(self, request_id: str, now: float, cancelled: bool = False) -> None:
        """Its last delta is out; ``cancelled``, a gateway stopped it (its client left): nothing to resume."""
        replay = self._replays.get(request_id)
        if replay is not None:
            replay.finished_at = now
            if cancelled:
                self._forget(request_id)

    def drop(self, request_id: str, attempt: int) -> None:
        """Let go of run ``attempt`` of ``request_id``, with no trace: it was superseded (a gateway dismissed it,
        a later attempt runs) or handed over, and the run that goes on elsewhere answers for the stream."""
        replay = self._replays.get(request_id)
        if replay is not None and replay.request.attempt == attempt:
            del self._replays[request_id]
            self._total -= replay.size

    def heard(self, gateway_id: str, now: float) -> None:
        self._heard[gateway_id] = now

    def reconnected(self, now: float) -> None:
        """This worker's NATS connection came back: pings missed meanwhile say nothing of the gateways."""
        self._listening_since = now

    def _gateway_gone(self, route: str, now: float) -> bool:
        gateway = subjects.gateway_of(route)
        if gateway is None:
            return False
        return now - max(self._heard.get(gateway, 0.0), self._listening_since) > DEAD_AFTER_S

    def sweep(self, now: float) -> list[str]:
        """Orphan the requests whose gateway went, drop what need not be kept; returns the requests to cancel
        (orphans past their window, or whose kept deltas overflowed)."""
        cancel: list[str] = []
        for request_id, replay in list(self._replays.items()):
            if self._gateway_gone(replay.route, now):
                replay.orphaned_at = replay.orphaned_at or now
            else:
                replay.orphaned_at = None
            if replay.orphaned_at is None:
                if replay.finished_at is not None and now - replay.finished_at > FINISHED_KEEP_S:
                    self._forget(request_id)
                continue
            if replay.overflowed or now - replay.orphaned_at > replay.request.resumable_s:
                if replay.finished_at is None:
                    cancel.append(request_id)
                self._forget(request_id)
        return cancel

    def _forget(self, request_id: str) -> None:
        replay = self._replays.pop(request_id)
        self._total -= replay.size
        self._gone[request_id] = replay.request.tenant_id
        while len(self._gone) > GONE_REMEMBERED:
            self._gone.popitem(last=False)

    def resume(self, ask: StreamResume) -> tuple[ResumeAnswer, list[bytes]] | None:
        """Answer a gateway's ask to take a stream over: the answer and the deltas to send it (the route moves to
        it first), or None when this worker has nothing of it for that tenant (the ask goes unanswered)."""
        replay = self._replays.get(ask.request_id)
        if replay is None or replay.request.tenant_id != ask.tenant_id:
            if ask.request_id in self._gone and self._gone[ask.request_id] == ask.tenant_id:
                return ResumeAnswer("gone", worker_id=self._worker_id), []
            return None
        attempt = replay.request.attempt
        if ask.first_attempt_only and attempt != 0:
            return ResumeAnswer("moved", worker_id=self._worker_id), []  # its gateway keeps relaying it
        next_seq = replay.first_seq + len(replay.deltas)
        if ask.attempt > attempt or (ask.attempt == attempt and ask.seq >= next_seq):
            return ResumeAnswer("ahead", worker_id=self._worker_id), []
        # The client's delta itself is sent again (some of its events may not have reached it), then the rest; a
        # client on an earlier run needs this one whole.
        start = ask.seq if ask.attempt == attempt else 0
        if start < replay.first_seq:
            return ResumeAnswer("gone", worker_id=self._worker_id), []  # what follows the client's was let go
        replay.route = ask.reply_subject
        replay.orphaned_at = None
        i = start - replay.first_seq
        tokens_before, text_before = replay.marks[i]
        answer = ResumeAnswer("ok", replay.request, self._worker_id, start, next_seq, replay.tokens[:tokens_before],
                              text_before)
        return answer, replay.deltas[i:]


