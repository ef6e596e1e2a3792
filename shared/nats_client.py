"""Connecting to NATS: one place for how a Switchyard process reaches its servers.

``url`` may name several servers of one cluster, comma-separated (``nats://a:4222,nats://b:4222``); the client
tries them in turn and, once connected, also learns the cluster's other servers from them, so losing the one it
is connected to costs a reconnect, not the service. ``tls://`` URLs encrypt the connection; the server's
certificate is checked against the system's CAs, or against ``tls_ca`` (a private CA, a self-signed server).
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
from nats.aio.client import Client as NATS


def server_urls(url: str) -> list[str]:
    """The servers named in ``url``, in order."""
    return [part.strip() for part in url.split(",") if part.strip()]


async def connect(url: str, name: str, *, reconnect_forever: bool = True, tls_ca: Path | None = None,
                  reconnected_cb: Callable[[], Awaitable[None]] | None = None) -> NATS:
    """Connect as ``name`` (shown by the server's monitoring); by default keep reconnecting while servers are
    away, as a long-running service must. ``reconnected_cb``: a coroutine function awaited after each reconnect."""
    tls = ssl.create_default_context(cafile=str(tls_ca)) if tls_ca is not None else None
    return await nats.connect(server_urls(url), name=name, max_reconnect_attempts=-1 if reconnect_forever else 1,
                              tls=tls, reconnected_cb=reconnected_cb)


async def settled(nc: NATS) -> None:
    """Return once the server has processed every command ``nc`` sent so far, subscriptions included, so another
    connection may publish to them.

    One ``flush()`` is not enough: nats-py (2.16) writes its PING straight to the socket, ahead of commands still
    queued for its flusher task, so the PONG can come back before a fresh SUB reaches the server. By the time that
    PONG arrives the flusher has written the queue, so a second PING follows every earlier command."""
    await nc.flush()
    await nc.flush()
