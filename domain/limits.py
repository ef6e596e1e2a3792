"""Per-key rate limits: requests and tokens per minute, over a sliding minute (the admission policy that applies
them is domain/admission/rate_limits.py).

Shared state is Postgres: one statement on a (key, minute) row admits or refuses the requests of that key that
reached this gateway together (while its last statement ran: domain/grouped_calls.py, migration 0020), each in turn
as if alone, so the limits hold across any number of gateways without a read-then-write race, and a burst on one
key waits for a few statements rather than one round trip per request; Postgres is already on the request path's
host and durable. Tokens are reserved at admission (estimated prompt tokens + n x max_tokens) and settled to what
was really used when the request ends (grouped too): the unused part returned, use beyond the reservation charged.

While Postgres is away, each gateway enforces its share of every key's limits in memory (domain/local_limits.py).

Response headers follow OpenAI: ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import asyncpg

from switchyard.domain.auth import AuthContext
from switchyard.domain.database import Database, DatabaseUnavailable
from switchyard.domain.errors import OpenAIError
from switchyard.domain.grouped_calls import GroupedCalls
from switchyard.domain.local_limits import LocalLimiter
from switchyard.shared.tiers import TierPolicy

UNLIMITED = 1 << 62
DEFAULT_COMPLETION_RESERVE = 1024  # reserved when a request sets no max_tokens

# A sliding minute, approximated from two fixed ones: the previous minute's counts weigh by how much of it still
# lies within the last 60 s (rounded up), so a key cannot spend its limit at 0:59 and again at 1:00 (a 2x burst).
# The previous minute's row no longer changes, so each statement stays atomic per key (migration 0020).
ADMIT_SQL = ("SELECT admitted, held_requests, held_tokens FROM admit_rate_window($1, $2::timestamptz, "
             "$3::bigint[], $4::bigint[], $5::bigint[], $6::float8)")
SETTLE_SQL = "SELECT settle_rate_windows($1, $2::timestamptz[], $3::bigint[])"


class _Asked(NamedTuple):
    """One request asking for its key's window, as the admission statement takes it."""

    tokens: int
    rpm: int
    tpm: int
    previous_weight: float  # how much of the previous minute still counts, when it asked


class _Held(NamedTuple):
    admitted: bool
    requests: int  # the key's requests and tokens in the sliding minute after this request was judged
    tokens: int


Window = tuple[str, dt.datetime]  # (API key id, the minute's start)


async def _admit(pool: asyncpg.Pool, window: Window, asked: list[_Asked]) -> list[_Held]:
    """One statement for ``asked`` (one key's, in arrival order, in one minute). The previous minute is weighed as
    when the first of them asked: the largest weight of the group, so the limit errs on the safe side."""
    key_id, window_start = window
    rows = await pool.fetch(ADMIT_SQL, key_id, window_start, [a.tokens for a in asked], [a.rpm for a in asked],
                            [a.tpm for a in asked], asked[0].previous_weight)
    return [_Held(*row) for row in rows]


async def _settle(pool: asyncpg.Pool, key_id: str, differences: list[tuple[dt.datetime, int]]) -> list[None]:
    await pool.execute(SETTLE_SQL, key_id, [w for w, _ in differences], [d for _, d in differences])
    return [None] * len(differences)


def text_tokens(text_chars: int) -> int:
    """A text's tokens before anything tokenized it: ~4 characters a token."""
    return math.ceil(text_chars / 4)


def estimate_tokens(text_chars: int, max_tokens: int | None, n: int = 1) -> int:
    """What to reserve before the worker has tokenized anything: the text's tokens (``text_tokens``), plus the
    completion of each of the ``n`` choices. An estimate: ``Limiter.settle`` charges what was really used, beyond
    it too."""
    return text_tokens(text_chars) + n * (max_tokens or DEFAULT_COMPLETION_RESERVE)


@dataclass(slots=True)
class Reservation:
    """A request let through: the tokens it holds in its key's window, and the headers every response to it
    carries."""

    key_id: str
    window_start: dt.datetime
    reserved_tokens: int
    headers: dict[str, str] = field(default_factory=dict)
    settled: bool = False
    local: bool = False  # admitted by the local limiter (Postgres away): settled there


def _window(now: float) -> tuple[dt.datetime, float]:
    """The current fixed minute's start, and the seconds until it ends."""
    start = int(now // 60) * 60
    return dt.datetime.fromtimestamp(start, tz=dt.UTC), start + 60 - now


def _previous_weight(reset_s: float) -> float:
    """How much of the previous minute still lies in the sliding minute ending now."""
    return reset_s / 60


def _headers(rpm: int, tpm: int, used_requests: int, used_tokens: int, reset_s: float) -> dict[str, str]:
    headers: dict[str, str] = {}
    reset = f"{max(reset_s, 0):.0f}s"
    if rpm < UNLIMITED:
        headers |= {"x-ratelimit-limit-requests": str(rpm),
                    "x-ratelimit-remaining-requests": str(max(rpm - used_requests, 0)),
                    "x-ratelimit-reset-requests": reset}
    if tpm < UNLIMITED:
        headers |= {"x-ratelimit-limit-tokens": str(tpm),
                    "x-ratelimit-remaining-tokens": str(max(tpm - used_tokens, 0)),
                    "x-ratelimit-reset-tokens": reset}
    return headers


class Limiter:
    def __init__(self, db: Database, local_share: float = 1.0) -> None:
        """``local_share``: the part of each key's limits this gateway enforces alone while Postgres is away."""
        self._db = db
        self._local = LocalLimiter(local_share)
        self._admissions = GroupedCalls(db, _admit, rows_of=lambda window: window[0])
        self._settles = GroupedCalls(db, _settle)

    async def admit(self, auth: AuthContext, policy: TierPolicy, tokens: int) -> Reservation:
        """Count the request and reserve ``tokens``; raises 429 ``rate_limit_exceeded``."""
        rpm = auth.rpm_limit or policy.rpm or UNLIMITED
        tpm = auth.tpm_limit or policy.tpm or UNLIMITED
        window_start, reset_s = _window(time.time())
        if tokens > tpm:
            raise OpenAIError(429, f"Request too large: it may use up to {tokens} tokens, over your limit of {tpm} "
                              "tokens per minute. Lower max_tokens or the prompt.", type="rate_limit_error",
                              code="rate_limit_exceeded", headers=_headers(rpm, tpm, 0, 0, reset_s))
        try:
            held = await self._admissions.call((auth.key_id, window_start),
                                               _Asked(tokens, rpm, tpm, _previous_weight(reset_s)))
        except DatabaseUnavailable:
            return self._admit_locally(auth, rpm, tpm, tokens, window_start)
        if not held.admitted:
            which = "requests" if held.requests + 1 > rpm else "tokens"
            limit = rpm if which == "requests" else tpm
            headers = _headers(rpm, tpm, held.requests, held.tokens, reset_s)
            headers["Retry-After"] = str(max(1, math.ceil(reset_s)))
            raise OpenAIError(429, f"Rate limit reached for {which} per minute: limit {limit}. Please try again in "
                              f"{reset_s:.0f}s.", type="rate_limit_error", code="rate_limit_exceeded",
                              headers=headers)
        return Reservation(auth.key_id, window_start, tokens, _headers(rpm, tpm, held.requests, held.tokens, reset_s))

    def _admit_locally(self, auth: AuthContext, rpm: int, tpm: int, tokens: int,
                       window_start: dt.datetime) -> Reservation:
        wait_s = self._local.admit(auth.key_id, rpm, tpm, tokens)
        if wait_s is not None:
            raise OpenAIError(429, f"Rate limit reached (limits enforced per gateway while the database is away). "
                              f"Please try again in {wait_s:.0f}s.", type="rate_limit_error",
                              code="rate_limit_exceeded", headers={"Retry-After": str(math.ceil(wait_s))})
        return Reservation(auth.key_id, window_start, tokens, local=True)

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        """Bring the window to what the request really used: the unused part of the reservation goes back (all of
        it for a request that never ran), and use beyond it (a prompt that took more tokens than the ~4 characters
        a token estimate) is charged, even past the limit, so the key's next requests wait for it."""
        if reservation.settled:
            return
        reservation.settled = True
        if reservation.local:
            self._local.settle(reservation.key_id, reservation.reserved_tokens, used_tokens)
            return
        difference = used_tokens - reservation.reserved_tokens
        if difference != 0:
            try:
                await self._settles.call(reservation.key_id, (reservation.window_start, difference))
            except DatabaseUnavailable:  # the window keeps its reservation: a limit errs on the safe side
                pass

    def tenant_state(self) -> dict[str, int]:
        return {"local_rate_windows": len(self._local)}

    def forget_idle(self) -> None:
        """Drop the in-memory windows (kept while Postgres was away) of keys with nothing in the last minute."""
        self._local.forget_idle()

    async def prune(self) -> None:
        """Drop windows older than an hour (called periodically)."""
        self.forget_idle()
        await self._db.pool.execute("DELETE FROM rate_windows WHERE window_start < now() - interval '1 hour'")
