"""The gateway's named services: what its routes use, made when it starts (NATS, Postgres) and closed when it stops.

    config ──▶ GatewayServices.start()
        nats ─┬─ registry ── router ─┐
              ├─ tier policies ──────┼─▶ admission (domain/admission/policies.py) ─┐
        postgres ─ database ─────────┘        authenticator                        ├─▶ completions (serving.py)
              publisher ── relay (token router, liveness, failover, hedging) ── placement ───┘
        nats ─ llm.kv.* ─ the fleet's KV index (kv_index.py): placement by what workers hold
        stores: conversations, responses, files, batches, usage      queue gauges (poller), loop lag probe, GC pauses
        responses (responses_service.py), embeddings (embeddings.py): over completions (and the stores)

Routes are handed this object when the app is made (gateway/routes/) and read the service they need from it when
a request comes; nothing else is looked up at run time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import asyncpg
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from switchyard.domain.admission.pipeline import UPKEEP_EVERY_S, Pipeline
from switchyard.domain.admission.policies import admission_pipeline
from switchyard.domain.admission.routing import Router
from switchyard.domain.admission.safety import InputSafety
from switchyard.domain.auth import Authenticator
from switchyard.domain.batches import Batches
from switchyard.domain.conversations import Conversations
from switchyard.domain.database import Database, connect
from switchyard.domain.files import Files
from switchyard.domain.publish import RequestPublisher
from switchyard.domain.registry import ModelRegistry
from switchyard.domain.responses import Responses
from switchyard.domain.usage_report import UsageReport
from switchyard.gateway.affinity import AffinityIndex
from switchyard.gateway.drain import InFlightCounter
from switchyard.gateway.embeddings import EmbeddingService
from switchyard.gateway.failover import Failover
from switchyard.gateway.hedging import Hedging
from switchyard.gateway.kv_index import KVIndex
from switchyard.gateway.liveness import WorkerLiveness
from switchyard.gateway.loop_lag import LoopLagProbe
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.gateway.queue_metrics import QueuePoller
from switchyard.gateway.relay import Relay
from switchyard.gateway.responses_service import ResponseService
from switchyard.gateway.serving import CompletionService
from switchyard.gateway.stream_resume import StreamResumer
from switchyard.gateway.token_router import TokenRouter
from switchyard.shared import nats_client
from switchyard.shared.config import SwitchyardConfig
from switchyard.shared.gc_pauses import GcPauses
from switchyard.shared.jetstream import ensure_streams
from switchyard.shared.tier_store import PolicyCache

log = logging.getLogger("switchyard.gateway")


class GatewayServices:
    """See the module docstring. Until ``start`` only ``config``, ``metrics``, ``in_flight`` and ``draining`` are
    there; the others are set by ``start``."""

    nc: NATS
    js: JetStreamContext
    db: Database
    registry: ModelRegistry
    router: Router
    tier_policies: PolicyCache
    authenticator: Authenticator
    admission: Pipeline
    completions: CompletionService
    conversations: Conversations
    responses: ResponseService
    embeddings: EmbeddingService
    response_store: Responses
    files: Files
    batches: Batches
    usage: UsageReport

    def __init__(self, config: SwitchyardConfig, metrics: GatewayMetrics | None = None) -> None:
        if not config.nats_url or not config.database_url:
            raise ValueError("the gateway needs nats_url and database_url (switchyard up starts both for you)")
        self.config = config
        self.metrics = metrics or GatewayMetrics()
        self.in_flight = InFlightCounter()
        self.draining = False  # set by DrainingServer on SIGTERM; /readyz reads it
        self._pool: asyncpg.Pool | None = None
        self._poller: QueuePoller | None = None
        self._loop_lag = LoopLagProbe(self.metrics.loop_lag)
        self._gc_pauses = GcPauses(self.metrics.gc_pauses)
        self._upkeep: asyncio.Task | None = None
        self._tokens: TokenRouter | None = None
        self.kv_index: KVIndex | None = None  # the fleet's KV index, with placement "kv_index"

    async def start(self) -> None:
        config, gateway = self.config, self.config.gateway
        # First: a safety configuration that cannot work stops the start; the classifier is loaded once, here.
        safety = InputSafety(gateway.safety, self.metrics.safety_input)
        assert config.nats_url and config.database_url  # __init__ refuses a config without them
        self.nc = await nats_client.connect(config.nats_url, "switchyard-gateway", tls_ca=config.nats_tls_ca)
        self.js = self.nc.jetstream()
        await ensure_streams(self.js, config.nats_replicas)
        self._pool = pool = await connect(config.database_url, gateway.database_pool_size)
        self.db = Database(pool)
        liveness = WorkerLiveness()
        await liveness.start(self.nc)
        self.registry = ModelRegistry(self.nc, {m.served_name: m.aliases for m in config.models}, liveness.is_dead)
        self.router = Router(self.registry, gateway)
        self.tier_policies = PolicyCache(self.js)
        self.authenticator = Authenticator(self.db)
        self.admission = admission_pipeline(db=self.db, registry=self.registry, router=self.router,
                                            tier_policies=self.tier_policies, safety=safety,
                                            local_share=1 / gateway.num_gateways)
        publisher = RequestPublisher(self.nc, self.js, gateway.retry_after_s)
        self._tokens = TokenRouter(self.nc)
        await self._tokens.start()
        affinity: AffinityIndex | KVIndex | None = None
        if gateway.affinity and gateway.placement == "kv_index":
            affinity = self.kv_index = KVIndex(liveness.is_dead)
            await self.kv_index.start(self.nc)
        elif gateway.affinity:
            affinity = AffinityIndex(self.js, config.nats_replicas)
        relay = Relay(self.nc, self._tokens, publisher, gateway.stall_timeout_s, gateway.retry_after_s, liveness,
                      Failover(self.js, publisher, kv_index=self.kv_index),
                      Hedging(self.tier_policies, self.registry, liveness, publisher, self.metrics))
        resumer = StreamResumer(self.nc, relay) if gateway.stream_resume_window_s else None
        self.completions = CompletionService(relay, self.registry, self.tier_policies, self.admission, gateway,
                                             self.metrics, affinity=affinity, resumer=resumer)
        state = self.metrics.tenant_state  # the middleware (gatekeeper, refused bodies) watch theirs when made
        state.watch("authenticator", self.authenticator.tenant_state)
        state.watch("admission", self.admission.tenant_state)
        state.watch("database", self.db.tenant_state)
        if affinity is not None:
            state.watch("placement", affinity.tenant_state)
        self.conversations = Conversations(pool, self.js)
        self.embeddings = EmbeddingService(self.completions)
        self.response_store = Responses(pool, self.js)
        self.responses = ResponseService(self.completions, self.response_store, self.conversations, self.in_flight,
                                         self.nc, config.gateway.limits, resumer)
        self.files = Files(pool)
        self.batches = Batches(pool, self.files)
        self.usage = UsageReport(pool)
        self._poller = QueuePoller(self.metrics, self.js, self.registry, self.db, self.batches)
        self._poller.start()
        self._loop_lag.start()
        self._gc_pauses.start()
        self._upkeep = asyncio.create_task(self._keep_up())

    async def _keep_up(self) -> None:
        """The admission policies' periodic work (leases of the requests this gateway serves, what they hold of
        tenants that stopped calling), and the keys the authenticator may forget."""
        while True:
            await asyncio.sleep(UPKEEP_EVERY_S)
            self.authenticator.forget_idle()
            try:
                await self.admission.upkeep()
            except Exception as exc:  # Postgres away: the next round tries again
                log.warning("admission upkeep failed: %r", exc)

    async def stop(self) -> None:
        if self._upkeep is not None:
            self._upkeep.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._upkeep
        await self._loop_lag.stop()
        self._gc_pauses.stop()
        if self._poller is not None:
            await self._poller.stop()
        if self._tokens is not None:
            await self._tokens.stop()
        if self._pool is not None:
            await self._pool.close()
        if getattr(self, "nc", None) is not None:
            await self.nc.close()
