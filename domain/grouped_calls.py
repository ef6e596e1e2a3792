"""Calls about one key (a tenant's rows) gathered into one statement while the key's last statement runs: group
commit, as a database does with its log.

    call(A, 1) ──▶ nothing running for A: a statement of [1]
    call(A, 2) ─┐
    call(A, 3) ─┼─▶ arrived while [1] ran: one statement of [2, 3, 4] once it is done
    call(A, 4) ─┘
    call(B, 5) ──▶ another key: a statement of its own, side by side

``Database.run`` runs one key's calls one at a time (so that one tenant's requests wait for each other without a
connection each, rather than hold every connection queueing on its row locks). A burst of a thousand requests from
one tenant then waits for a thousand round trips one after another, each behind a turn of an event loop busy with
the burst itself: seconds. Gathered, the burst waits for a few statements, and each statement judges its calls in
the order they arrived, as the same calls one at a time would have been judged (the statement's SQL does that).
A key still has at most one statement running, on one connection.

A caller cancelled before its statement went is left out of it; one cancelled while its statement ran gets no
answer, and ``abandoned`` (if given) undoes what the statement did for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

import asyncpg

from switchyard.domain.database import Database

Key = TypeVar("Key", bound=Hashable)
Item = TypeVar("Item")
Result = TypeVar("Result")

MAX_GROUP = 512  # calls per statement, at most: a statement's arrays stay small, and its run well within its bound

Statement = Callable[[asyncpg.Pool, Key, list[Item]], Awaitable[Sequence[Result]]]


class GroupedCalls(Generic[Key, Item, Result]):
    """``call(key, item)``: the result of ``statement(pool, key, items)`` for ``item`` (the statement answers one
    result per item, in order), raising what the statement raised (``DatabaseUnavailable`` included).
    ``rows_of(key)``: whose rows the key's statements touch, for ``Database.run``'s one call at a time (default: the
    key itself; a key of several parts, e.g. a rate window's (API key, minute), names its API key)."""

    def __init__(self, db: Database, statement: Statement[Key, Item, Result],
                 abandoned: Callable[[Key, Item, Result], Awaitable[None]] | None = None,
                 rows_of: Callable[[Key], str] = str) -> None:
        self._db = db
        self._statement = statement
        self._abandoned = abandoned
        self._rows_of = rows_of
        self._waiting: dict[Key, list[tuple[Item, asyncio.Future[Result]]]] = {}  # keys with a statement running
        self._tasks: set[asyncio.Task[None]] = set()  # referenced until done (the loop keeps weak references)

    async def call(self, key: Key, item: Item) -> Result:
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        waiting = self._waiting.get(key)
        if waiting is None:
            waiting = self._waiting[key] = []
            task = asyncio.create_task(self._run(key, waiting))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        waiting.append((item, future))
        return await future

    async def _run(self, key: Key, waiting: list[tuple[Item, asyncio.Future[Result]]]) -> None:
        """Statements for ``key`` until nobody waits (no await between the last look and leaving: a call that
        comes after finds no entry and starts the next run)."""
        try:
            while waiting:
                group = [(item, future) for item, future in waiting[:MAX_GROUP] if not future.cancelled()]
                del waiting[:MAX_GROUP]
                if group:
                    await self._one(key, group)
        finally:
            if self._waiting.get(key) is waiting:
                del self._waiting[key]
            for _, future in waiting:  # only when this task was cancelled (the loop closing)
                future.cancel()

    async def _one(self, key: Key, group: list[tuple[Item, asyncio.Future[Result]]]) -> None:
        items = [item for item, _ in group]
        try:
            results = await self._db.run(lambda pool: self._statement(pool, key, items), key=self._rows_of(key))
        except BaseException as exc:
            for _, future in group:
                if not future.done():
                    if isinstance(exc, asyncio.CancelledError):  # the loop closing: nobody gets an answer
                        future.cancel()
                    else:
                        future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (item, future), result in zip(group, results, strict=True):
            if not future.done():
                future.set_result(result)
            elif self._abandoned is not None:
                try:
                    await self._abandoned(key, item, result)
                except Exception:  # undoing is best effort: what it would undo expires (a lease, a minute)
                    pass
