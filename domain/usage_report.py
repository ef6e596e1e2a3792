"""A tenant's usage and cost from the billing rows (the ``requests`` table), grouped by model or day.

Shared by ``GET /v1/usage`` and ``switchyard usage`` (which reads it on a connection of its own).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import asyncpg

from switchyard.domain.errors import OpenAIError

_GROUPS = {"model": "model", "day": "to_char(date_trunc('day', created_at), 'YYYY-MM-DD')"}


def parse_time(value: str | None, default: dt.datetime, param: str) -> dt.datetime:
    """An ISO date/time or unix seconds (UTC unless it says otherwise); 400 for anything else, ``inf``, ``nan`` and
    times no calendar holds included."""
    if not value:
        return default
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        try:
            parsed = dt.datetime.fromtimestamp(float(value), tz=dt.UTC)
        except (ValueError, OverflowError, OSError):  # not a number, inf/nan, or past year 9999
            raise OpenAIError(400, f"Invalid {param}: use an ISO date/time or unix seconds (a time between the "
                              "years 1 and 9999).", param=param, code="invalid_value") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


async def usage_rows(conn: asyncpg.Connection | asyncpg.Pool, tenant_id: str, start: str | None,
                     end: str | None, group_by: str) -> list[dict[str, Any]]:
    if group_by not in _GROUPS:
        raise OpenAIError(400, "group_by must be 'model' or 'day'.", param="group_by", code="invalid_value")
    now = dt.datetime.now(dt.UTC)
    month_start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    start_at = parse_time(start, month_start, "start")
    end_at = parse_time(end, now + dt.timedelta(seconds=1), "end")
    key = _GROUPS[group_by]
    rows = await conn.fetch(
        f"SELECT {key} AS {group_by}, count(*) AS requests, sum(prompt_tokens) AS prompt_tokens, "
        "sum(completion_tokens) AS completion_tokens, sum(cached_tokens) AS cached_tokens, "
        "sum(cost_usd) AS cost_usd FROM requests WHERE tenant_id = $1 AND created_at >= $2 AND created_at < $3 "
        f"GROUP BY 1 ORDER BY 1", tenant_id, start_at, end_at)
    return [{group_by: r[group_by], "requests": r["requests"], "prompt_tokens": int(r["prompt_tokens"]),
             "completion_tokens": int(r["completion_tokens"]), "cached_tokens": int(r["cached_tokens"]),
             "cost_usd": float(r["cost_usd"])} for r in rows]


class UsageReport:
    """``usage_rows`` on the gateway's pool."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def rows(self, tenant_id: str, start: str | None, end: str | None, group_by: str) -> list[dict[str, Any]]:
        return await usage_rows(self._pool, tenant_id, start, end, group_by)
