"""Which models are served right now, read from the workers' heartbeats in the ``workers`` KV bucket.

Entries expire with the bucket's TTL, so a dead worker disappears on its own. Reads are cached briefly: a
request path must not pay a KV scan, and a second of staleness only delays a 404 or its end.

An entry can also go while its worker lives: a restarted NATS has lost the in-memory bucket, and a cluster electing
the bucket's leader for longer than the TTL expires entries nobody could refresh meanwhile. A gateway hears every
worker's liveness pings (core NATS, which rides a stream's election out), so a worker gone from the listing but
still pinging stays listed as last seen; only one that is silent too is gone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from nats.aio.client import Client as NATS

from switchyard.domain.errors import service_unavailable
from switchyard.shared.jetstream import live_workers
from switchyard.shared.messages import WorkerInfo
from switchyard.shared.single_flight import SingleFlight

_CACHE_S = 1.0
# While the registry cannot be read (a NATS node lost and a new leader being elected, a reconnect), the last
# listing stands in for this long: requests go on to the queue, which rides the same outage out (relay.submit).
_STALE_OK_S = 30.0
# A model served in the last minute whose workers are all gone now (one crashed and is restarting, NATS restarted
# and the heartbeats are not back yet) answers 503 "retry", not 404 "no such model".
_REMEMBER_S = 60.0
_UNREACHABLE_RETRY_AFTER_S = 5

log = logging.getLogger("switchyard.registry")


class ModelRegistry:
    def __init__(self, nc: NATS, catalog: dict[str, list[str]] | None = None,
                 is_dead: Callable[[str], bool] | None = None) -> None:
        """``nc``: the NATS connection it reads through (while that has no server at all, reads fail at once).
        ``catalog``: the models the deployment is configured with (served name -> aliases): known before any of
        their workers is live, so a request for one with no worker is a 503 to retry, not a 404.
        ``is_dead``: whether a worker's liveness pings have stopped (gateway/liveness.py); without it a worker is
        listed exactly while its heartbeat entry is."""
        self._nc, self._js = nc, nc.jetstream()
        self._cached: dict[str, list[WorkerInfo]] = {}
        self._cached_at = 0.0
        self._reads: SingleFlight[list[WorkerInfo]] = SingleFlight()  # one read for every request waiting on it
        self._last_served: dict[str, float] = {}  # model -> when a listing last had it
        self._catalog = catalog or {}
        self._catalog_aliases = {alias: model for model, aliases in self._catalog.items() for alias in aliases}
        self._is_dead = is_dead

    async def models(self, fresh: bool = False) -> dict[str, list[WorkerInfo]]:
        """Served model name → the live workers serving it. While NATS cannot be read, the last listing for up to
        ``_STALE_OK_S``, then OpenAIError 503: a client gets "retry", never a 500 or a false 404."""
        if not fresh and time.monotonic() - self._cached_at < _CACHE_S:
            return self._cached
        found: dict[str, list[WorkerInfo]] = {}
        try:
            if not self._nc.is_connected:  # every read would wait out its timeout: the same as failing now
                raise ConnectionError("not connected to NATS")
            workers = await self._reads.run(None, lambda: live_workers(self._js))
        except Exception as exc:
            log.warning("cannot read the worker registry: %r", exc)
            if self._cached and time.monotonic() - self._cached_at < _STALE_OK_S:
                return self._cached
            raise service_unavailable("The request queue is unreachable right now; please retry.",
                                      _UNREACHABLE_RETRY_AFTER_S) from None
        for info in workers:
            found.setdefault(info.model, []).append(info)
        self._keep_pinging(found)
        self._cached, self._cached_at = found, time.monotonic()
        self._last_served.update(dict.fromkeys(found, self._cached_at))
        return found

    def _keep_pinging(self, found: dict[str, list[WorkerInfo]]) -> None:
        """Add to ``found`` the workers of the last listing it lacks whose pings still come (see the module
        docstring): listed until their next heartbeat lands, or until they fall silent."""
        if self._is_dead is None:
            return
        listed = {info.worker_id for infos in found.values() for info in infos}
        for model, infos in self._cached.items():
            for info in infos:
                if info.worker_id not in listed and not self._is_dead(info.worker_id):
                    found.setdefault(model, []).append(info)

    async def resolve(self, name: str) -> str:
        """The served model ``name`` stands for: itself, or the model whose alias it is (a live worker's, then the
        catalog's)."""
        served = await self.models()
        if name in served:
            return name
        for model, workers in served.items():
            if any(name in w.aliases for w in workers):
                return model
        return self._catalog_aliases.get(name, name)

    @property
    def catalog_models(self) -> list[str]:
        """The models the deployment is configured with, live or not."""
        return list(self._catalog)

    def aliases(self, model: str) -> list[str]:
        """Every alias of ``model`` known now (live workers' and the catalog's)."""
        found = {a for w in self._cached.get(model, ()) for a in w.aliases} | set(self._catalog.get(model, ()))
        return sorted(found)

    async def is_served(self, model: str) -> bool:
        """Whether a worker serves ``model`` now; raises OpenAIError 503 for one served a moment ago (its workers
        are coming back), so a client retries rather than taking it for a model that does not exist."""
        if model in await self.models():
            return True
        # A worker may have started within the cache window: look again before answering 404.
        if model in await self.models(fresh=True):
            return True
        if time.monotonic() - self._last_served.get(model, float("-inf")) < _REMEMBER_S:
            raise service_unavailable(f"No worker serves `{model}` right now (it did a moment ago); please retry.",
                                      _UNREACHABLE_RETRY_AFTER_S, code="model_unavailable")
        if model in self._catalog:
            raise service_unavailable(f"No worker serves `{model}` right now (it is configured here but none is "
                                      "live); please retry.", _UNREACHABLE_RETRY_AFTER_S, code="model_unavailable")
        return False
