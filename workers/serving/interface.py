"""What the worker service needs of an engine: the one typed boundary between them.

    worker service (workers/service/)                 an engine (ours: workers/engine/engine.py)
    ─────────────────────────────────                 ──────────────────────────────────────────
    intake thread   prepare(request) ───────────────▶ tokenize, chat template, grammar; checks  ──▶ Prepared
    step thread     add_request(request, prepared) ─▶ queue it (tier = priority, tenant = cache salt,
                                                       request.resume = where a continuation starts)
                    abort_request(request_id, error)
                    step(background_limit) ─────────▶ schedule → run → update, no I/O           ──▶ [TokenDelta]
                    capacity() ─────────────────────▶ seats, KV use, waiting: what may be pulled  ──▶ EngineCapacity
                    stats(), take_safety_events() ──▶ for metrics and heartbeats
                    take_kv_changes() ──────────────▶ blocks stored / removed per tier  ──▶ the KV events
                                                       (hashes of kv_block_size-token blocks, our chain)
                    set_pause_rules(tier -> tokens) ▶ each tier's pausing quantum, as ops set it (only an engine
                                                       whose capabilities say pausing)
    at start        capabilities ───────────────────▶ roles, KV exchange, batch limits per step ──▶ EngineCapabilities
                    connect_kv_peers(peers) ────────▶ fetch blocks other nodes hold; serve this node's (only an
                                                       engine whose capabilities say kv_exchange)
                    shutdown()                         once, after the last step

The worker touches an engine from one thread only (its step thread: torch's OpenMP pool belongs to the calling
thread), except ``prepare``, which its intake thread calls so that tokenizing never delays a step. Nothing in the
worker reads an engine's internals: a second engine (vLLM for GPU fleets, a simulated one for load tests) is a
class with these methods and one entry in ``workers/service/engines.py``, which builds it by the name
``worker.engine`` gives.

What a request's deltas must look like (``TokenDelta``, shared/messages.py): at most one per choice per step; each
choice's last has ``finish_reason`` and the request's usage so far; the request's very last has ``is_last`` and
the whole request's usage (the engine counts the choices that ended; the worker only reads ``is_last``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

import msgspec

from switchyard.shared.messages import ErrorInfo, GenerateRequest, TokenDelta
from switchyard.workers.serving.kv_changes import KVChanges
from switchyard.workers.serving.output_filter import SafetyEvent
from switchyard.workers.serving.prompts import RequestRejected
from switchyard.workers.serving.stats import EngineCapacity, EngineStats

if TYPE_CHECKING:
    from switchyard.workers.kv_tiers.remote import KVPeers

# Reads a block file this node's KV tiers hold, by layout (workers/kv_tiers BlockLayout.key), scope and block hash
# (None: not here, or of another layout), for another node.
BlockReader = Callable[[str, str, int], "bytes | bytearray | None"]

__all__ = ["BlockReader", "EngineCapabilities", "EngineCapacity", "EngineStats", "EngineUnavailable", "Prepared",
           "RequestRejected", "SafetyEvent", "ServingEngine"]

# A worker's roles: ``both`` serves whole requests; ``prefill`` computes prompts and hands each on after its first
# token, ``decode`` continues what a prefill worker handed on (disaggregated serving).
ROLES = ("both", "prefill", "decode")


class EngineCapabilities(msgspec.Struct, frozen=True):
    """What an engine can do beyond serving whole requests, stated by the engine so that the worker asks instead of
    assuming (and an operator reads it in the worker's start-up log)."""

    roles: tuple[str, ...] = ("both",)  # of ``ROLES``, the ones it can serve as
    # Keeps its KV tiers as block files by content: a request naming a ``kv_source`` loads its prefix from that
    # node, and this node's blocks are served to others (``connect_kv_peers``).
    kv_exchange: bool = False
    # ``step(background_limit)`` bounds the batch-tier sequences of each step; without it only the worker's pulls
    # bound batch work (and the engine's own priorities: vLLM admits it last and preempts it first).
    background_limit: bool = False
    # With every seat of a tier taken, pauses a long generation (its KV kept) for a new request of a tenant holding
    # fewer seats, by the rule of scheduler/pausing.py and each tier's quantum (``set_pause_rules``); the worker then
    # pulls such a request with no free seat when the tier's fair share says its tenant is far behind.
    pausing: bool = False

    def describe(self) -> str:
        """For a log line: ``roles both; KV exchange; batch limit per step; pausing``."""
        return "; ".join(["roles " + ", ".join(self.roles)] + ["KV exchange"] * self.kv_exchange
                         + ["batch limit per step"] * self.background_limit + ["pausing"] * self.pausing)


class EngineUnavailable(RuntimeError):
    """The engine asked for cannot be built here (its package is not installed); the message says how to fix it."""


class Prepared(Protocol):
    """A request made ready off the step thread (``ServingEngine.prepare``); opaque to the worker but for this."""

    @property
    def num_dropped_messages(self) -> int:
        """Conversation turns dropped to fit the context (the request's first delta says how many)."""
        ...


PreparedT = TypeVar("PreparedT", bound=Prepared)


class ServingEngine(Protocol[PreparedT]):
    """An engine the worker can serve from; see the module docstring for which thread calls what. ``PreparedT``:
    the engine's own prepared request, which the worker holds without reading and hands back to ``add_request``
    (the worker serves any engine: ``ServingEngine[Any]``)."""

    @property
    def capabilities(self) -> EngineCapabilities:
        """What this engine can do beyond serving whole requests (fixed once it is built)."""
        ...

    @property
    def max_context(self) -> int:
        """The most tokens one request may hold, prompt and completion (in the worker's heartbeat)."""
        ...

    @property
    def device_type(self) -> str:
        """``cpu`` or ``cuda``: where a step's cost grows with its batch, and where it hardly does."""
        ...

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV block: the size of the blocks ``take_kv_changes`` and ``kv_listing`` name, and so of the
        worker's KV events (ours: its ``block_size``; vLLM's own, 128 on a CPU)."""
        ...

    def prepare(self, request: GenerateRequest, /) -> PreparedT:
        """Tokenize ``request`` (chat template, history fitted to the context), compile the grammar its output
        must follow, and check it can run here; raises ``RequestRejected`` with what the client gets otherwise.
        Safe to call from a thread other than the step thread, while steps run."""
        ...

    def add_request(self, request: GenerateRequest, prepared: PreparedT, /) -> int:
        """Queue a prepared request; returns its prompt's token count. Raises ``RequestRejected`` for what can
        never run (and leaves nothing behind); any other exception fails this request alone."""
        ...

    def abort_request(self, request_id: str, error: ErrorInfo | None = None, /) -> bool:
        """Stop a request now and free what it holds; its final deltas come with the next step: ``cancelled``,
        or ``error`` when one is given. False when the engine does not hold it."""
        ...

    def has_unfinished_requests(self) -> bool:
        """Whether a step would have anything to do (requests to run, finals to send)."""
        ...

    def step(self, background_limit: int | None = None, /) -> list[TokenDelta]:
        """One step of every request: schedule → run → update, no I/O. ``background_limit``: at most this many
        batch-tier sequences run in it (None: no limit; the worker's capacity decides)."""
        ...

    def capacity(self) -> EngineCapacity:
        """Seats, KV use and waiting requests now."""
        ...

    def stats(self) -> EngineStats:
        """Load per tier and counters since start, for metrics."""
        ...

    def take_safety_events(self) -> list[SafetyEvent]:
        """The output filter's verdicts since the last call (each is returned once)."""
        ...

    def take_kv_changes(self) -> KVChanges | None:
        """Blocks stored and removed per KV tier, and chat prompts' message-prefix segments, since the last call:
        the worker's KV events (shared/kv_events.py). None: the engine publishes none."""
        ...

    def kv_listing(self) -> dict[str, list[int]]:
        """Every block held now, per tier (a KV-events snapshot). Safe to call from any thread."""
        ...

    def connect_kv_peers(self, peers: KVPeers) -> BlockReader:
        """Let requests naming a ``kv_source`` fetch their prefix from that node through ``peers`` (called once,
        before the first step, and only when ``capabilities.kv_exchange``); returns how to read a block of this
        node's tiers for another node."""
        ...

    def set_pause_rules(self, after_tokens: dict[str, int], /) -> None:
        """Each tier's pausing quantum (``TierPolicy.pause_after_tokens``; 0 or absent: off), from the next step on
        (called on the step thread, and only when ``capabilities.pausing``)."""
        ...

    def shutdown(self) -> None:
        """Release what the engine holds; no call follows."""
        ...
