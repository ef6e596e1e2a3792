"""Per-key rate limits: requests and tokens per minute, over a sliding minute (the admission policy that applies
them is domain/admission/rate_limits.py).

Shared state is Postgres: one atomic upsert per request on a (key, minute) row admits or refuses it, so the
limits hold across any number of gateways without a lock or a read-then-write race; Postgres is already on the
request path's host and durable. Tokens are reserved at admission (estimated prompt tokens
+ n x max_tokens) and settled to what was really used when the request ends: the unused part returned, use beyond
the reservation charged.

While Postgres is away, each gateway enforces its share of every key's limits in memory (domain/local_limits.py).

Response headers follow OpenAI: ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from dataclasses import dataclass, field

from switchyard.domain.auth import AuthContext
from switchyard.domain.database import Database, DatabaseUnavailable
from switchyard.domain.errors import OpenAIError
from switchyard.domain.local_limits import LocalLimiter
from switchyard.shared.tiers import TierPolicy

UNLIMITED = 1 << 62
DEFAULT_COMPLETION_RESERVE = 1024  # reserved when a request sets no max_tokens

# A sliding minute, approximated from two fixed ones: the previous minute's counts weigh by how much of it still
# lies within the last 60 s ($6, rounded up), so a key cannot spend its limit at 0:59 and again at 1:00 (a 2x
# burst). The previous minute's row no longer changes, so the one statement stays atomic per key.
ADMIT_SQL = """
WITH prev AS (
    SELECT ceil(coalesce(max(requests), 0) * $6::float8)::bigint AS requests,
           ceil(coalesce(max(tokens), 0) * $6::float8)::bigint AS tokens
    FROM rate_windows WHERE key_id = $1 AND window_start = $2::timestamptz - interval '1 minute'
)
INSERT INTO rate_windows AS w (key_id, window_start, requests, tokens)
SELECT $1, $2, 1, $3 FROM prev WHERE prev.requests + 1 <= $4 AND prev.tokens + $3 <= $5
ON CONFLICT (key_id, window_start) DO UPDATE
    SET requests = w.requests + 1, tokens = w.tokens + EXCLUDED.tokens
    WHERE w.requests + 1 + (SELECT requests FROM prev) <= $4
      AND w.tokens + EXCLUDED.tokens + (SELECT tokens FROM prev) <= $5
RETURNING requests + (SELECT requests FROM prev) AS requests, tokens + (SELECT tokens FROM prev) AS tokens
"""
USED_SQL = """
SELECT coalesce(max(requests) FILTER (WHERE window_start = $2), 0)
           + ceil(coalesce(max(requests) FILTER (WHERE window_start < $2), 0) * $3::float8)::bigint AS requests,
       coalesce(max(tokens) FILTER (WHERE window_start = $2), 0)
           + ceil(coalesce(max(tokens) FILTER (WHERE window_start < $2), 0) * $3::float8)::bigint AS tokens
FROM rate_windows WHERE key_id = $1 AND window_start IN ($2::timestamptz, $2::timestamptz - interval '1 minute')
"""


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
            weight = _previous_weight(reset_s)
            row = await self._db.run(lambda pool: pool.fetchrow(ADMIT_SQL, auth.key_id, window_start, tokens, rpm,
                                                                tpm, weight), key=auth.key_id)
            if row is None:
                used = await self._db.run(lambda pool: pool.fetchrow(USED_SQL, auth.key_id, window_start, weight),
                                          key=auth.key_id)
        except DatabaseUnavailable:
            return self._admit_locally(auth, rpm, tpm, tokens, window_start)
        if row is None:
            assert used is not None  # an aggregate without GROUP BY answers one row, even over no rows
            which = "requests" if used["requests"] + 1 > rpm else "tokens"
            limit = rpm if which == "requests" else tpm
            headers = _headers(rpm, tpm, used["requests"], used["tokens"], reset_s)
            headers["Retry-After"] = str(max(1, math.ceil(reset_s)))
            raise OpenAIError(429, f"Rate limit reached for {which} per minute: limit {limit}. Please try again in "
                              f"{reset_s:.0f}s.", type="rate_limit_error", code="rate_limit_exceeded",
                              headers=headers)
        return Reservation(auth.key_id, window_start, tokens, _headers(rpm, tpm, row["requests"], row["tokens"],
                                                                      reset_s))

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
                await self._db.run(lambda pool: pool.execute(
                    "UPDATE rate_windows SET tokens = greatest(tokens + $3, 0) WHERE key_id = $1 "
                    "AND window_start = $2", reservation.key_id, reservation.window_start, difference),
                    key=reservation.key_id)
            except DatabaseUnavailable:  # the window keeps its reservation: a limit errs on the safe side
                pass

    async def prune(self) -> None:
        """Drop windows older than an hour (called periodically)."""
        self._local.forget_idle()
        await self._db.pool.execute("DELETE FROM rate_windows WHERE window_start < now() - interval '1 hour'")
