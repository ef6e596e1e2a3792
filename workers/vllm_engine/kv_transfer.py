"""Disaggregated serving on vLLM: a worker's role as vLLM's KV connector, and what each request carries for it.

    prefill worker (role prefill: kv_producer)          decode worker (role decode: kv_consumer)
    ───────────────────────────────────────────          ─────────────────────────────────────────
    prompt P (L tokens), max_tokens 2,                   prompt P + [t1] (L + 1 tokens), the request's own
    kv_transfer_params {"do_remote_decode": True}        max_tokens less one, kv_transfer_params = what the
      step 1 ─▶ t1: sent to the client at once             prefill's vLLM returned (do_remote_prefill, its engine,
      step 2 ─▶ t2: KV of P + [t1] now in its blocks;      host, port, remote_block_ids ...), from Resume.kv_transfer
                t2 dropped; the request ends "length"    ─▶ its connector pulls the L + 1 tokens' blocks (NIXL
                and vLLM holds its blocks for the           READ), vLLM recomputes the last one for its logits,
                decode side ─▶ our delta: HANDOVER,         and t2 onwards are sampled here
                kv_transfer = vLLM's kv_transfer_params

Why the prefill runs to a second token. The decode side's vLLM loads as many tokens as its own request's prompt
holds (all but those it already has cached), into as many blocks, and asserts that the prefill side sent at least
that many; it never reads ``remote_num_tokens`` for this. A continuation's prompt is the prompt and the first token
(L + 1: that is how any continuation here goes on, and the client has that token). A prefill stopped at its first
token has KV for L tokens only: the decode side would then ask for one block more than was sent whenever L is a
multiple of the block size (vLLM's assertion fails the step; or, where it has the prompt's first blocks cached, it
lines the blocks it reads up by their end, each a block off: wrong KV, silently), and take one slot it was never
sent otherwise. vLLM's own proxy avoids this by giving the decode side the very same prompt and letting it sample the
first token again; here the client already has the prefill's first token, and a decode worker sampling its own
(another draw at a temperature above 0) would go on from a token the client never saw. A second token on the
prefill side puts t1's KV in the prefill's blocks, so they hold exactly the decode request's prompt: the token the
client saw is the one the decode worker goes on from, at any temperature, and for any L. The price is one decode
step of the prefill worker per request (one token in its batch), after t1 has gone out.

How long the blocks wait. The prefill's vLLM keeps them for ``kv_lease_duration`` (30 s by default), renewed by the
decode side's heartbeats once its vLLM has the request, and then frees them whether or not they were read; a read
after that would take whatever the blocks hold by then. The continuation may wait longer than that in the model's
queue (a busy decode pool), so the hand-over is stamped with the time it left the prefill worker, and a decode
worker that takes it up after two thirds of the lease computes the prompt instead (as after a failover).

Pure (no vLLM import): the settings and the requests' parameters are tested where vLLM is not installed.
"""

from __future__ import annotations

from typing import Any

from switchyard.shared.config import WorkerConfig
from switchyard.shared.messages import ErrorInfo, GenerateRequest
from switchyard.workers.serving.prompts import RequestRejected

DEFAULT_CONNECTOR = "NixlConnector"
# The worker's role as vLLM's kv_role (vLLM 0.32's NIXL connector warns that kv_both is deprecated for a prefill or
# a decode instance; a both worker with a connector asked for is both).
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
# What each kv_role lets a worker serve as, besides whole requests (which a connector never prevents).
_ROLES_OF = {"kv_producer": ("both", "prefill"), "kv_consumer": ("both", "decode"),
             "kv_both": ("both", "prefill", "decode")}
# Tokens a prefill request runs to (see the module docstring): the first is the client's, the second puts the
# first's KV in the blocks the decode side loads, and is dropped.
PREFILL_TOKENS = 2
# Our key in a hand-over's kv_transfer_params (vLLM ignores keys it does not read): when it left the prefill worker.
HANDED_OVER_AT = "switchyard_handed_over_at"
DEFAULT_LEASE_S = 30.0  # vLLM's kv_lease_duration


def connector_config(worker: WorkerConfig) -> dict[str, Any] | None:
    """vLLM's ``kv_transfer_config`` for ``worker``'s role (None: no connector, a both worker's default); raises
    ValueError for settings that would be ignored: connector settings with no connector."""
    v = worker.vllm
    connector = v.kv_connector if v.kv_connector is not None else (
        DEFAULT_CONNECTOR if worker.role != "both" else None)
    if connector is None:
        if v.kv_connector_extra_config:
            raise ValueError("vllm.kv_connector_extra_config needs a KV connector: a both worker has none unless "
                             "vllm.kv_connector names one (or give the worker role prefill or decode)")
        return None
    if not connector:
        raise ValueError(f"vllm.kv_connector is empty: a {worker.role} worker needs one (None: {DEFAULT_CONNECTOR})")
    # A load that fails (the prefill's worker died, its blocks were freed) recomputes what it could not load, as a
    # continuation does after a failover, instead of failing the request (vLLM's default).
    return {"kv_connector": connector, "kv_role": KV_ROLES[worker.role],
            "kv_connector_extra_config": dict(v.kv_connector_extra_config), "kv_load_failure_policy": "recompute"}


def check_offloading(kwargs: dict) -> None:
    """Refuse vLLM's KV offloading beside a connector: vLLM replaces a ``kv_transfer_config``'s connector with its
    offloading one (``kv_offloading_size``), so the prefill's blocks would never move."""
    config = kwargs.get("kv_transfer_config")
    if kwargs.get("kv_offloading_size") is not None and isinstance(config, dict) and config.get("kv_connector"):
        raise ValueError(
            f"KV offloading (kv_offload_gib, vllm.kv_offloading_size) and the KV connector {config['kv_connector']} "
            "cannot both be set: vLLM would put its offloading connector in the connector's place. For both, give "
            "vllm.engine_args.kv_transfer_config a MultiConnector of the two, and no kv_offloading_size")


def connector_roles(kwargs: dict) -> tuple[str, ...]:
    """The roles an engine built from ``kwargs`` (``engine_kwargs``, with what ``engine_args`` changed) can serve as:
    whole requests always; prefill with a connector that produces KV, decode with one that consumes it."""
    config = kwargs.get("kv_transfer_config")
    if not isinstance(config, dict) or not config.get("kv_connector"):
        return ("both",)
    return _ROLES_OF.get(str(config.get("kv_role")), ("both",))


def check_prefill_model(roles: tuple[str, ...], is_hybrid: bool, lookahead_tokens: int) -> None:
    """Refuse the prefill role for a model whose prompt vLLM's connector cuts short on the prefill side: a Mamba
    hybrid's (``is_hybrid``: the decode side recomputes the last token to rebuild its state) or one whose drafter
    reads ahead (``lookahead_tokens``, vLLM's ``num_prefill_lookahead_tokens``: multi-token prediction). vLLM's
    own proxy discards the prefill's token; here it is the client's first, and it would not follow the whole
    prompt."""
    if "prefill" not in roles:
        return
    if is_hybrid or lookahead_tokens > 1:
        raise ValueError("role prefill: vLLM's KV connector stops this model's prefill short of its prompt's last "
                         "tokens (a Mamba hybrid, or a drafter that reads ahead), so the first token could not be "
                         "sent from the prefill worker; serve this model with role both")


def prefill_max_tokens(max_tokens: int) -> int:
    """The tokens a prefill request runs to, of the ``max_tokens`` it may have: ``PREFILL_TOKENS``, or the one
    allowed (the request then ends here, whole: nothing is left to hand over)."""
    return min(PREFILL_TOKENS, max_tokens)


def lease_s(kwargs: dict) -> float:
    """How long a prefill's vLLM keeps a request's blocks unread: the ``kv_lease_duration`` of the connector
    ``kwargs`` configure (both pools are configured alike: the decode side reads its own)."""
    config = kwargs.get("kv_transfer_config")
    extra = (config.get("kv_connector_extra_config") or {}) if isinstance(config, dict) else {}
    return float(extra.get("kv_lease_duration", DEFAULT_LEASE_S))


def stamp(params: dict[str, Any] | None, now: float) -> dict[str, Any] | None:
    """A prefill's ``kv_transfer_params`` as its hand-over carries them: stamped with when it left (``now``, unix
    time), for the decode side's ``request_params``."""
    return None if params is None else {**params, HANDED_OVER_AT: now}


def request_params(req: GenerateRequest, max_tokens: int, consumes_kv: bool, lease: float = DEFAULT_LEASE_S,
                   now: float = 0.0) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` a request goes to vLLM with (``SamplingParams.extra_args``), or None:
    a prefill (``req.handover``) with more than one token to run asks vLLM to keep its blocks for a remote decode;
    a continuation after a vLLM prefill (``req.resume.kv_transfer``) on an engine that consumes KV pulls the blocks
    it names (a copy: vLLM marks the dict as it goes), unless it comes after two thirds of the prefill's ``lease``
    (``now``: unix time), when the blocks may be freed before they are read. Anything else computes its prompt
    here."""
    if req.handover:
        return {"do_remote_decode": True} if max_tokens > 1 else None
    resume = req.resume
    if resume is None or not resume.kv_transfer or not consumes_kv:
        return None
    handed_over_at = resume.kv_transfer.get(HANDED_OVER_AT)
    if isinstance(handed_over_at, (int, float)) and now - handed_over_at > lease * 2 / 3:
        return None
    return dict(resume.kv_transfer)


def check_request(req: GenerateRequest, roles: tuple[str, ...]) -> None:
    """Refuse, with the error its client gets, a prefill request (``req.handover``) an engine of ``roles`` cannot
    hand over: without a connector that produces KV, vLLM would drop ``kv_transfer_params`` with a warning and the
    request would look handed over with nothing to load. Only the prefill queue carries such requests, and only
    prefill workers (whose engines have the connector) take it: this is the platform's fault, never the client's."""
    if not req.handover:
        return
    if "prefill" not in roles:
        raise RequestRejected(ErrorInfo(
            "This vLLM worker has no KV connector to hand a prefill over with (vllm.kv_connector; role prefill).",
            code="handover_unsupported", type="server_error", status=500))
    if req.sampling.n != 1 or req.resume is not None:
        raise RequestRejected(ErrorInfo("Only a first run of one choice is handed over after its prefill.",
                                        code="handover_unsupported", type="server_error", status=500))
