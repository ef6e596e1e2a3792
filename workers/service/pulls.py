"""One message at a time from any of thousands of durable pull consumers, through one subscription.

A worker reads a queue per tier and tenant (tenant_queues.py). nats-py's pull subscription costs a subscription of
its own per consumer, and its ``fetch`` waits out its whole timeout when the queue turns out empty; with more
active tenants than subscriptions kept, every pull would also make a consumer and a subscription again. Here every pull
is one request on JetStream's own pull API, ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`` with
``{"batch": 1, "expires": 50 ms}``, answered on one wildcard inbox: the consumer's next message, or a status saying
it has none (408 when the pull expired, 404), or that nobody serves that consumer (503: JetStream deleted it after
its idle hour, or the server restarted without it). Not ``no_wait``: a doorbell can reach the worker before the
stream hands its message to the consumer, and a pull that answered "none" at once would forget that tenant until
the next sweep, a second later, while its request waits.

The messages are ordinary JetStream messages: ack, nak, in-progress and term answer their reply subject as with
nats-py's own pulls. One that arrives after its pull gave up (a lost answer's timeout) is handed back at once (nak)
so that another pull, here or at another worker, takes it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging

log = logging.getLogger("switchyard.worker")

PULL_EXPIRES_S = 0.05  # how long the server holds a pull for a message that is on its way
NEXT_ONE = json.dumps({"batch": 1, "expires": int(PULL_EXPIRES_S * 1e9)}).encode()
EMPTY = frozenset({"404", "408"})  # no message now / the pull expired: the queue is empty for us
GONE = frozenset({"503"})  # no responders: the consumer is not there (deleted when idle, or a fresh server)


class ConsumerGone(Exception):
    """The consumer asked is not on the server (make it again, then pull)."""


class ConsumerPulls:
    """Pulls from named consumers over one connection's single inbox subscription (see the module docstring)."""

    def __init__(self, nc) -> None:
        self._nc = nc
        self._prefix = nc.new_inbox()
        self._sub = None
        # A message arrives on its own subject (the request's), its reply naming stream and consumer; a status on
        # the pull's inbox subject. A worker pulls a consumer once at a time, so (stream, consumer) finds the pull.
        self._waiting: dict[tuple[str, str], asyncio.Future] = {}
        self._inboxes: dict[str, tuple[str, str]] = {}  # the pull's inbox token -> (stream, consumer)
        self._tokens = itertools.count()

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(f"{self._prefix}.*", cb=self._on_answer)

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # the connection may be closing: nothing left to release then
                pass
            self._sub = None
        for future in self._waiting.values():
            future.cancel()
        self._waiting.clear()

    async def next(self, stream: str, consumer: str, timeout_s: float):
        """The consumer's next message, or None when it has none now (the server says so within
        ``PULL_EXPIRES_S``); ``timeout_s`` bounds a lost answer; raises ConsumerGone when the consumer is not on the
        server."""
        if self._sub is None:
            await self.start()
        key, token = (stream, consumer), str(next(self._tokens))
        future = asyncio.get_running_loop().create_future()
        self._waiting[key], self._inboxes[token] = future, key
        try:
            await self._nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}", NEXT_ONE,
                                   reply=f"{self._prefix}.{token}")
            msg = await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            return None
        finally:
            if self._waiting.get(key) is future:
                del self._waiting[key]
            del self._inboxes[token]
        status = (msg.headers or {}).get("Status")
        if status is None:
            return msg
        if status in GONE:
            raise ConsumerGone(f"{stream}/{consumer}")
        if status not in EMPTY:
            log.debug("pull from %s/%s answered %s %s", stream, consumer, status,
                      (msg.headers or {}).get("Description", ""))
        return None

    async def _on_answer(self, msg) -> None:
        is_message = msg.reply.startswith("$JS.ACK.")
        key: tuple[str, str] | None
        if is_message:
            key = (msg.metadata.stream, msg.metadata.consumer)
        else:
            key = self._inboxes.get(msg.subject.rsplit(".", 1)[-1])
        future = self._waiting.pop(key, None) if key is not None else None
        if future is not None and not future.done():
            future.set_result(msg)
            return
        if is_message:
            # A message for a pull that gave up waiting: back to the queue now, not after the ack wait.
            try:
                await msg.nak()
            except Exception as exc:
                log.debug("could not hand back a late message: %r", exc)
