"""A request's token inbox on a real NATS server: messages in order, what is waiting counted in messages and bytes
(nats-py's own counts, which its slow-consumer bound reads), a wait that ends, and nothing left subscribed."""

from __future__ import annotations

import nats
import pytest

from switchyard.gateway.inbox import TokenInbox


async def test_the_inbox_hands_on_messages_in_order_and_counts_what_waits(nats_url):
    nc = await nats.connect(nats_url)
    try:
        inbox = await TokenInbox.subscribe(nc, "llm.tok.inbox-test")
        for i in range(3):
            await nc.publish("llm.tok.inbox-test", b"x" * (i + 1))
        await nc.flush()
        for _ in range(100):  # delivered in the server's own time: flush round trips until they are here
            if inbox.pending == 3:
                break
            await nc.flush()
        assert inbox.pending == 3 and inbox.pending_bytes == 6
        assert [(await inbox.next(1.0)).data for _ in range(3)] == [b"x", b"xx", b"xxx"]
        assert inbox.pending == 0 and inbox.pending_bytes == 0
        with pytest.raises(TimeoutError):
            await inbox.next(0.05)
        await nc.publish("llm.tok.inbox-test", b"late")  # a reader already waiting is woken by it
        assert (await inbox.next(5.0)).data == b"late"
        await inbox.close()
        assert not nc._subs  # unsubscribed
    finally:
        await nc.close()
