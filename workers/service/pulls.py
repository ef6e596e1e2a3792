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

A queue that holds more than the message just pulled (each delivery says how many its consumer has left) can be
asked for up to that many more at once (``more``): ``no_wait``, so the server answers with what is there now and
holds nothing open, and within ``max_bytes``, so that what a batch hands the worker to prepare is bounded by its
size whatever its count. One tenant's burst then fills free seats a batch per round trip, not a request per.

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
# A batch's messages together, at most: small prompts (a few KB each) fill a batch, large ones come one a pull, and
# whatever a batch holds costs the worker little to prepare (a grammar compiles at about 1.5 ms per KiB of schema).
MORE_MAX_BYTES = 16 * 1024
EMPTY = frozenset({"404", "408"})  # no message now / the pull expired: the queue is empty for us
GONE = frozenset({"503"})  # no responders: the consumer is not there (deleted when idle, or a fresh server)


class ConsumerGone(Exception):
    """The consumer asked is not on the server (make it again, then pull)."""


class _Pull:
    """One pull out: the messages it wants, those in so far, and its end (a future: the messages, or a status)."""

    __slots__ = ("wanted", "got", "done")

    def __init__(self, wanted: int) -> None:
        self.wanted = wanted
        self.got: list = []
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()


class ConsumerPulls:
    """Pulls from named consumers over one connection's single inbox subscription (see the module docstring)."""

    def __init__(self, nc) -> None:
        self._nc = nc
        self._prefix = nc.new_inbox()
        self._sub = None
        # A message arrives on its own subject (the request's), its reply naming stream and consumer; a status on
        # the pull's inbox subject. A worker pulls a consumer once at a time, so (stream, consumer) finds the pull.
        self._waiting: dict[tuple[str, str], _Pull] = {}
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
        for pull in self._waiting.values():
            pull.done.cancel()
        self._waiting.clear()

    async def next(self, stream: str, consumer: str, timeout_s: float):
        """The consumer's next message, or None when it has none now (the server says so within
        ``PULL_EXPIRES_S``); ``timeout_s`` bounds a lost answer; raises ConsumerGone when the consumer is not on the
        server."""
        got, status = await self._pull(stream, consumer, NEXT_ONE, 1, timeout_s)
        if got:
            return got[0]
        if status in GONE:
            raise ConsumerGone(f"{stream}/{consumer}")
        return None

    async def more(self, stream: str, consumer: str, count: int, timeout_s: float) -> list:
        """Up to ``count`` more messages that the consumer has now (none waited for), within ``MORE_MAX_BYTES``."""
        ask = json.dumps({"batch": count, "no_wait": True, "max_bytes": MORE_MAX_BYTES}).encode()
        got, _ = await self._pull(stream, consumer, ask, count, timeout_s)
        return got

    async def _pull(self, stream: str, consumer: str, ask: bytes, wanted: int,
                    timeout_s: float) -> tuple[list, str | None]:
        """The messages a pull brought (all ``wanted``, or fewer and the status that ended it; None: timed out)."""
        if self._sub is None:
            await self.start()
        key, token = (stream, consumer), str(next(self._tokens))
        pull = self._waiting[key] = _Pull(wanted)
        self._inboxes[token] = key
        status = None
        try:
            await self._nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}", ask,
                                   reply=f"{self._prefix}.{token}")
            msg = await asyncio.wait_for(pull.done, timeout_s)
            status = None if msg is None else (msg.headers or {}).get("Status")
        except TimeoutError:
            pass
        finally:
            if self._waiting.get(key) is pull:
                del self._waiting[key]
            del self._inboxes[token]
        if status is not None and status not in EMPTY | GONE:
            log.debug("pull from %s/%s answered %s %s", stream, consumer, status,
                      (msg.headers or {}).get("Description", ""))
        return pull.got, status

    async def _on_answer(self, msg) -> None:
        is_message = msg.reply.startswith("$JS.ACK.")
        key: tuple[str, str] | None
        if is_message:
            key = (msg.metadata.stream, msg.metadata.consumer)
        else:
            key = self._inboxes.get(msg.subject.rsplit(".", 1)[-1])
        pull = self._waiting.get(key) if key is not None else None
        if pull is not None and not pull.done.done():
            if not is_message:  # the pull ended with fewer than it wanted (empty, expired, gone, over max_bytes)
                pull.done.set_result(msg)
            else:
                pull.got.append(msg)
                if len(pull.got) >= pull.wanted:
                    pull.done.set_result(None)
            return
        if is_message:
            # A message for a pull that gave up waiting: back to the queue now, not after the ack wait.
            try:
                await msg.nak()
            except Exception as exc:
                log.debug("could not hand back a late message: %r", exc)
