"""A relayed request's lifecycle: one state machine says which worker runs it, which of the deltas that arrive the
client gets, and what the relay must do when a delta comes or a worker goes. Pure: no I/O, no clock of its own.

    WAITING ──── a worker's first message (it took the request) ───────────────────────▶ RUNNING on A
    RUNNING on A ──── no token by the hedge delay, a seat free elsewhere (gateway/hedging.py) ──▶ HEDGED on A, B
    HEDGED on A, B ──── the first of them to produce a token (the other is dismissed) ──────────▶ RUNNING on it
                   ──── one of them gone (dead, its stream broken, its offer never taken) ────▶ RUNNING on the other
                   ──── both gone ─────────────────────────────────────────────────────────────▶ CONTINUING
    RUNNING on A ──── A dead or its stream broken (failover), or a prefill's part done (hand-over) ──▶ CONTINUING
    CONTINUING ──── published again from what the client has; a worker's first message ─────▶ RUNNING on it
    any state ──── the last delta, an error, or the relay giving up (abandon, cancel) ─────────▶ FINISHED
    RUNNING on A ──── A says another gateway took the stream over (its client resumed there) ──▶ FINISHED, handed off

Every run is one worker's run of one attempt (``Resume.attempt``: a continuation is the next attempt). A delta of
an attempt moved on from is dropped and its worker told to stop that attempt (``stale``); a delta of the current
attempt from a worker the request was not given to (JetStream delivered it twice) or from one dismissed is dropped,
the former told to stop (``dismiss``). Hedged, the two runs' deltas are held back until one produces a token: the
client never sees two streams, and the loser is dismissed, so it bills nothing (workers/service/intake.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from switchyard.shared.messages import STREAM_TAKEN_OVER, TokenDelta


class Phase(enum.Enum):
    WAITING = "waiting"  # published; no worker has taken it yet
    RUNNING = "running"  # one worker runs it
    HEDGED = "hedged"  # two workers run it (the second perhaps not yet taken), neither has produced a token
    CONTINUING = "continuing"  # published again after a failure or a hand-over; no worker has taken it yet
    FINISHED = "finished"


@dataclass
class Run:
    """One worker's run of the current attempt."""

    next_seq: int = 0  # the sequence number its next delta must carry (a lower or higher one: a hole)
    taken: bool = True  # it has sent a message (a hedge offered but not taken yet has not)
    offer_until: float = float("inf")  # unix time: an untaken offer is dropped by its worker after this
    # Taken over on the gateway that relays it (its token subject the same): deltas numbered below this, and past
    # ``next_seq``, that come before the resend's first are live ones sent before the worker moved the stream,
    # routed to the new inbox already; the resend repeats them (0: nothing to wait for).
    resent_until: int = 0


@dataclass(frozen=True)
class Verdict:
    """What to do with one arriving delta."""

    deliver: bool = False  # the client gets it
    dismiss: list[str] = field(default_factory=list)  # workers to tell, by name, to stop and bill nothing
    why: str = ""  # why they are dismissed, for the log
    stale: tuple[str, int] | None = None  # a worker to tell to stop one earlier attempt
    broken: bool = False  # the run the client is on has a hole: go on elsewhere or end the request
    expected_seq: int | None = None  # broken: the number the run's next delta should have had
    hedge_won: bool | None = None  # a hedge was decided: True when the second worker won


# The verdicts of nearly every delta, shared: judging one is on the relay's per-token path. Never mutated.
DROP = Verdict()
DELIVER = Verdict(deliver=True)


class RelayState:
    """The state of one relayed request; the relay feeds it every delta and every liveness check, and carries
    out the verdicts (gateway/relayed_request.py)."""

    def __init__(self, attempt: int = 0) -> None:
        self.phase = Phase.WAITING
        self.attempt = attempt
        self.runs: dict[str, Run] = {}  # worker -> its run of ``attempt`` (RUNNING: one, HEDGED: two)
        self.worker_id: str | None = None  # the run the client is on (HEDGED: the first worker)
        self.hedge_worker: str | None = None  # HEDGED: the second
        self.has_output = False  # the client has had a token of this request (from any attempt)
        # Finished by its worker's notice that another gateway took the stream over (its client resumed there): it
        # goes on there, which ends it, stores it and has it billed; this gateway's part ends quietly.
        self.handed_off = False
        self._dismissed: set[tuple[str, int]] = set()
        self._stale: set[tuple[str, int]] = set()

    @property
    def is_finished(self) -> bool:
        return self.phase is Phase.FINISHED

    @property
    def may_hedge(self) -> bool:
        """Running on one worker with nothing streamed yet: a second worker could still win."""
        return self.phase is Phase.RUNNING and not self.has_output

    # -- deltas ---------------------------------------------------------------------------------------------
    def on_delta(self, delta: TokenDelta) -> Verdict:
        """Judge one arriving delta, and move on the state it implies."""
        if self.phase is Phase.FINISHED:
            return DROP
        worker = delta.worker_id
        notice = delta.error is not None and delta.error.code == STREAM_TAKEN_OVER
        if notice and worker == self.worker_id and delta.attempt == self.attempt and self.phase is Phase.RUNNING:
            # Outside the run's numbering: it ends whatever this gateway had of it.
            self.phase, self.handed_off = Phase.FINISHED, True
            return DELIVER
        if delta.attempt != self.attempt:
            told = (worker, delta.attempt) in self._stale or (worker, delta.attempt) in self._dismissed
            if delta.attempt < self.attempt and worker is not None and not told:
                self._stale.add((worker, delta.attempt))
                return Verdict(stale=(worker, delta.attempt))
            return DROP
        # A delta naming no worker (a test's, or an engine's that names none) is the run of the worker it is on.
        key = worker if worker is not None else (self.worker_id or "")
        if (key, self.attempt) in self._dismissed:
            return DROP
        run = self.runs.get(key)
        if run is None and self.phase in (Phase.WAITING, Phase.CONTINUING):
            run = self.runs[key] = Run()
            self.worker_id, self.phase = key or None, Phase.RUNNING
        if run is None:  # a worker it was not given to runs it too (delivered twice): only the first goes on
            if not key:
                return DROP  # unnamed, it cannot be told apart (nor told to stop)
            self._dismissed.add((key, self.attempt))
            return Verdict(dismiss=[key], why=f"it runs on {self.worker_id} (delivered twice)")
        if delta.seq != run.next_seq:
            if run.next_seq < delta.seq < run.resent_until:
                return DROP  # a live copy from before the take-over's answer: the resend brings it in its place
            return self._broken(key, run.next_seq)
        run.next_seq += 1
        run.resent_until = 0  # the resend has begun: from here a hole is a hole
        run.taken = True
        produced = bool(delta.num_tokens or delta.text or delta.is_last or delta.error is not None)
        verdict = DELIVER
        if self.phase is Phase.HEDGED:
            if not produced:
                return DROP  # its taking or a step without a token: the client already has the request's start
            verdict = Verdict(deliver=True, dismiss=[w for w in self.runs if w != key],
                              why=f"{key} produced a token first", hedge_won=key == self.hedge_worker)
            self._keep_only(key)
        self.has_output = self.has_output or produced
        if delta.is_last or delta.error is not None:
            self.phase = Phase.FINISHED
            self.handed_off = notice  # a notice in its run's numbering (a hedged run's) hands it off too
        return verdict

    def _broken(self, worker: str, expected_seq: int) -> Verdict:
        """``worker``'s stream has a hole: hedged, the other run goes on alone; else the relay continues the
        request elsewhere (``lost``, ``continued``) or ends it."""
        if self.phase is Phase.HEDGED:
            self._dismissed.add((worker, self.attempt))
            self._keep_only(next(w for w in self.runs if w != worker))
            return Verdict(dismiss=[worker], why="its stream has a hole")
        return Verdict(broken=True, expected_seq=expected_seq)

    def _keep_only(self, worker: str) -> None:
        for other in [w for w in self.runs if w != worker]:
            self._dismissed.add((other, self.attempt))
            del self.runs[other]
        self.worker_id, self.hedge_worker, self.phase = worker or None, None, Phase.RUNNING

    # -- workers going ----------------------------------------------------------------------------------------
    def drop_gone(self, is_dead, now: float) -> list[str]:
        """Hedged: forget a run whose worker ``is_dead(worker)`` or whose offer ended untaken, the other going on
        alone; returns the workers to dismiss. A lone run's loss is the relay's to judge (its silence rules)."""
        if self.phase is not Phase.HEDGED:
            return []
        gone = [w for w, run in self.runs.items() if is_dead(w) or (not run.taken and now > run.offer_until)]
        if len(gone) != 1:
            return []  # both gone: the first one's loss (the relay's rules) continues the request
        self._dismissed.add((gone[0], self.attempt))
        self._keep_only(next(w for w in self.runs if w != gone[0]))
        return gone

    def offer_unused(self, now: float) -> bool:
        """The run the client is on is an offer its worker never took, and its time is over (a hedge whose first
        worker went): no one runs the request."""
        run = self.runs.get(self.worker_id) if self.worker_id is not None else None
        return run is not None and not run.taken and now > run.offer_until

    # -- the relay's moves ------------------------------------------------------------------------------------
    def hedged(self, worker: str, offer_until: float) -> None:
        """The request was offered to ``worker`` too, until unix time ``offer_until``."""
        assert self.may_hedge and worker not in self.runs, (self.phase, worker)
        self.runs[worker] = Run(taken=False, offer_until=offer_until)
        self.hedge_worker, self.phase = worker, Phase.HEDGED

    def taken_over(self, worker: str, next_seq: int, resent_until: int = 0) -> None:
        """This gateway took over a stream (gateway/stream_resume.py): ``worker`` runs it and resends its deltas
        from ``next_seq`` up to ``resent_until``. Its client has had the request's start: it is not hedged.

        When this gateway relayed it already, the new inbox had its deltas from the moment it opened, before the
        worker answered: live ones it had sent meanwhile may come ahead of the resend, which repeats them. They
        are dropped, not taken for a hole (the two-hour soak's "out of order" streams: a background response's
        stream asked for on the gateway running it, the worker between two tokens)."""
        self.runs = {worker: Run(next_seq=next_seq, resent_until=resent_until)}
        self.worker_id, self.phase, self.has_output = worker, Phase.RUNNING, True

    def lost(self) -> list[str]:
        """Every run is taken for lost (the relay will continue the request or end it): the workers to dismiss."""
        workers = list(self.runs)
        for w in workers:
            self._dismissed.add((w, self.attempt))
        self.runs, self.worker_id, self.hedge_worker = {}, None, None
        return [w for w in workers if w]  # an unnamed run cannot be told to stop by name

    def continued(self, attempt: int) -> None:
        """Published again as ``attempt`` (a failover or a hand-over): the next worker to take it runs it."""
        self.runs, self.worker_id, self.hedge_worker = {}, None, None
        self.attempt, self.phase = attempt, Phase.CONTINUING

    def finish(self) -> None:
        self.phase = Phase.FINISHED
