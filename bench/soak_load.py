"""The soak's traffic (bench/soak.py): tenants coming and going across the tiers, each sending a mix of what the
API serves, every request's outcome written in a ledger the end of the soak checks against the billing rows.

The mix, drawn per request (``MIX``): streamed chat (a tenth of them cut by the client after its second chunk),
non-streamed chat, stored Responses, background Responses polled to their end (a few cancelled), background
Responses' streams left after a few events and resumed on the other gateway (``starting_after``), embeddings
(when an embedding model is served: ``embedding_model``), a conversation's next turn (a tenant's conversation
grows until ``TURNS_PER_CONVERSATION``, then it starts another), and a small batch (its input file uploaded, the
batch polled, its output file downloaded). Arrivals are open-loop (Poisson at ``rate``
per second), so a slow system meets the same offered load and its queues show it.

Tenants: ``tenants`` of them, created up front on the interactive tiers; a tenth have a small rpm limit and are
sent over it. At any time ``active`` of them send; every ``churn_s`` one leaves and a new one comes, so over an
hour every tenant comes and goes.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

MIX = (("chat_stream", 35), ("chat", 12), ("response", 12), ("response_background", 8), ("response_resumed", 5),
       ("response_cancelled", 3), ("conversation", 15), ("batch", 5), ("embeddings", 5))
TURNS_PER_CONVERSATION = 12
CUT_AFTER_CHUNKS = 2  # a cut stream: the client leaves after this many chunks
ENDED = ("response.completed", "response.incomplete", "response.failed")
OVER_LIMIT_RPM = 6  # the tenants sent over their limit
# The codes of an error answer to a request that ran (docs/api/errors.md): it was accepted, and what ran is billed
# once. Any other error answer refuses the request, which must not be billed.
RAN_CODES = frozenset({"worker_lost", "worker_timeout", "worker_shutdown", "stream_gap", "internal_error",
                       "out_of_memory"})


@dataclass
class Outcome:
    """One request as its client saw it. ``status``: completed, failed (accepted, then an explicit error, in its
    stream or as the answer of one that ran: ``code``),
    cut (the client left on purpose), lost (accepted, then neither an end nor an error), or refused (an HTTP error
    instead of a response, or no answer at all: ``code``)."""

    kind: str
    tier: str
    sent_at: float  # wall clock
    status: str = "lost"
    code: str = ""
    request_ids: list[str] = field(default_factory=list)  # batch: one per line
    completion_tokens: int | None = None  # what the client was told it used (None: not told)
    ttft_s: float | None = None


@dataclass
class Tenant:
    name: str
    tier: str
    key: str
    over_limit: bool
    conversation: str | None = None
    turns: int = 0


class Load:
    """Open-loop traffic through ``base_urls`` (the gateways, a tenant sticks to one) until ``stop()``."""

    def __init__(self, base_urls: list[str], model: str, tenants: list[Tenant], rate: float, active: int,
                 churn_s: float, embedding_model: str | None = None, seed: int = 7) -> None:
        self.base_urls, self.model, self.rate = base_urls, model, rate
        self.embedding_model = embedding_model
        self.tenants, self.active_count, self.churn_s = tenants, active, churn_s
        self.random = random.Random(seed)
        self.ledger: list[Outcome] = []
        self.left: set[str] = set()  # tenants that came and went
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=100)
        timeout = httpx.Timeout(120, connect=10)
        self.clients = [httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) for url in self.base_urls]
        try:
            order = list(self.tenants)
            self.random.shuffle(order)
            active, waiting = order[:self.active_count], order[self.active_count:]
            next_churn = time.monotonic() + self.churn_s
            while not self._stopping.is_set():
                await asyncio.sleep(self.random.expovariate(self.rate))
                if time.monotonic() >= next_churn and waiting:
                    gone = active.pop(self.random.randrange(len(active)))
                    self.left.add(gone.name)
                    active.append(waiting.pop(0))
                    next_churn += self.churn_s
                tenant = self.random.choice(active)
                kinds = [(k, w) for k, w in MIX if k != "embeddings" or self.embedding_model is not None]
                kind = self.random.choices([k for k, _ in kinds], [w for _, w in kinds])[0]
                task = asyncio.create_task(self._send(tenant, kind))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            if self._tasks:  # every request sent gets its outcome
                await asyncio.wait(list(self._tasks), timeout=300)
        finally:
            for client in self.clients:
                await client.aclose()

    async def _send(self, tenant: Tenant, kind: str) -> None:
        out = Outcome(kind, tenant.tier, time.time())
        self.ledger.append(out)
        http = self._client_of(tenant)
        headers = {"Authorization": f"Bearer {tenant.key}"}
        try:
            await getattr(self, f"_{kind}")(http, headers, tenant, out)
        except httpx.HTTPError as exc:
            if out.status == "lost" and not out.request_ids:
                out.status, out.code = "refused", f"client {type(exc).__name__}"
            elif out.status == "lost":
                out.code = f"client {type(exc).__name__} after accept"
        except Exception as exc:  # noqa: BLE001 - a bug in the load must not end the soak; it shows in the ledger
            out.status, out.code = "failed", f"load {type(exc).__name__}: {exc}"[:120]

    def _client_of(self, tenant: Tenant, other: bool = False) -> httpx.AsyncClient:
        """The gateway a tenant sticks to (``other``: the next one, where a cut stream is resumed)."""
        return self.clients[(hash(tenant.name) + other) % len(self.clients)]

    # -- the kinds ----------------------------------------------------------------------------------------------
    def _tokens(self) -> int:
        return self.random.randint(8, 32)

    def _chat_body(self, tenant: Tenant, stream: bool) -> dict:
        body = {"model": self.model, "max_tokens": self._tokens(), "stream": stream,
                "messages": [{"role": "user", "content": f"{tenant.name} asks {self.random.random():.6f}"}]}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    @staticmethod
    def _refused(out: Outcome, r: httpx.Response) -> bool:
        """Whether ``r`` is an error answer: a refusal (never accepted), or a failure of a request that ran."""
        if r.status_code == 200:
            return False
        if request_id := r.headers.get("X-Request-Id"):  # the ledger checks what was billed under it
            out.request_ids.append(request_id)
        try:
            code = r.json()["error"]["code"]
        except Exception:  # noqa: BLE001
            code = "(no OpenAI error body)"
        out.status, out.code = "failed" if code in RAN_CODES else "refused", f"{r.status_code} {code}"
        return True

    async def _chat_stream(self, http, headers, tenant, out: Outcome) -> None:
        """A streamed chat (a tenth cut by its client on purpose). One whose connection breaks (its gateway
        killed) is resumed on the other gateway with the ``Last-Event-ID`` of the last event read, as a client of
        resumable streams does (gateway/stream_resume.py): lost only if that fails too."""
        body = self._chat_body(tenant, True)
        stream = _ChatStream(cut=self.random.random() < 0.1, start=time.monotonic())
        async with http.stream("POST", "/v1/chat/completions", headers=headers, json=body) as r:
            if r.status_code != 200:
                await r.aread()
            if self._refused(out, r):
                return
            out.request_ids.append(r.headers.get("X-Request-Id", ""))
            try:
                await stream.read(r, out)
            except httpx.TransportError:
                if stream.last_event_id is None or stream.ended:
                    raise
                broken = True
            else:
                broken = False
        if broken:
            resume = {**headers, "Last-Event-ID": stream.last_event_id}
            async with self._client_of(tenant, other=True).stream("POST", "/v1/chat/completions", headers=resume,
                                                                  json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    out.code = f"resume {r.status_code} {r.text[:60]}"
                    return
                out.code = "resumed"
                await stream.read(r, out)
        if out.status == "lost" and stream.done and stream.finish is not None:
            out.status = "completed"

    async def _chat(self, http, headers, tenant, out: Outcome) -> None:
        start = time.monotonic()
        r = await http.post("/v1/chat/completions", headers=headers, json=self._chat_body(tenant, False))
        if self._refused(out, r):
            return
        out.request_ids.append(r.headers.get("X-Request-Id", ""))
        out.ttft_s = time.monotonic() - start
        out.completion_tokens = r.json()["usage"]["completion_tokens"]
        out.status = "completed"

    async def _post_response(self, http, headers, tenant, out: Outcome, **extra) -> dict | None:
        start = time.monotonic()
        body = {"model": self.model, "input": f"{tenant.name} wonders {self.random.random():.6f}",
                "max_output_tokens": self._tokens(), **extra}
        r = await http.post("/v1/responses", headers=headers, json=body)
        if self._refused(out, r):
            return None
        answer = r.json()
        out.request_ids.append(answer["id"].removeprefix("resp_"))
        out.ttft_s = time.monotonic() - start
        return answer

    @staticmethod
    def _finish_response(out: Outcome, answer: dict) -> None:
        if answer["status"] in ("completed", "incomplete"):  # incomplete: ended at max_output_tokens
            out.status, out.completion_tokens = "completed", answer["usage"]["output_tokens"]
        elif answer["status"] == "failed":
            out.status, out.code = "failed", f"response {(answer.get('error') or {}).get('code')}"
        else:
            out.code = out.code or f"response {answer['status']}"

    async def _response(self, http, headers, tenant, out: Outcome) -> None:
        answer = await self._post_response(http, headers, tenant, out)
        if answer is not None:
            self._finish_response(out, answer)

    async def _response_background(self, http, headers, tenant, out: Outcome) -> None:
        await self._poll_response(http, headers, out,
                                  await self._post_response(http, headers, tenant, out, background=True))

    async def _poll_response(self, http, headers, out: Outcome, answer: dict | None) -> None:
        """Until the response ``answer`` ends (each second), then its outcome."""
        deadline = time.monotonic() + 300
        while answer is not None and answer["status"] in ("queued", "in_progress") and time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            r = await _get(http, f"/v1/responses/{answer['id']}", headers)
            if r.status_code != 200:
                out.code = f"poll {r.status_code}"
                continue  # a gateway restarting: ask again
            answer = r.json()
        if answer is not None:
            self._finish_response(out, answer)

    async def _response_cancelled(self, http, headers, tenant, out: Outcome) -> None:
        """A background response cancelled soon after it was queued: it ends cancelled, or as it ended first."""
        answer = await self._post_response(http, headers, tenant, out, background=True)
        if answer is None:
            return
        await asyncio.sleep(self.random.uniform(0.0, 1.0))
        r = await http.post(f"/v1/responses/{answer['id']}/cancel", headers=headers)
        if r.status_code != 200:
            out.status, out.code = "failed", f"cancel {r.status_code}"
            return
        answer = r.json()
        if answer["status"] == "cancelled":
            out.status, out.code = "cut", "cancelled"  # as asked; the ledger allows a row for what ran
        else:
            self._finish_response(out, answer)

    async def _response_resumed(self, http, headers, tenant, out: Outcome) -> None:
        """A background response's stream read for a few events on the tenant's gateway, left, and read on from
        the other gateway (``starting_after``), as OpenAI's clients resume one (a client that leaves a
        foreground stream cancels it; a background one runs on)."""
        start = time.monotonic()
        answer = await self._post_response(http, headers, tenant, out, background=True)
        deadline = time.monotonic() + 300
        while answer is not None and answer["status"] == "queued" and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            r = await _get(http, f"/v1/responses/{answer['id']}", headers)
            answer = r.json() if r.status_code == 200 else answer
        if answer is None or answer["status"] != "in_progress":
            if answer is not None:
                self._finish_response(out, answer)  # it ended before its stream was asked for
            return
        response_id, last = answer["id"], -1
        async with http.stream("GET", f"/v1/responses/{response_id}", headers=headers,
                               params={"stream": "true"}) as r:
            if r.status_code == 200:
                async for event in _events(r):
                    last = event["sequence_number"]
                    if event["type"] == "response.output_text.delta" and out.ttft_s is None:
                        out.ttft_s = time.monotonic() - start
                    if last >= 3 or event["type"] in ENDED:
                        break
            else:
                await r.aread()  # ended meanwhile (410), or refused: read it whole below
                out.code = f"stream {r.status_code} {r.text[:60]}"
        other = self._client_of(tenant, other=True)
        if last >= 0:
            try:
                async with other.stream("GET", f"/v1/responses/{response_id}", headers=headers,
                                        params={"stream": "true", "starting_after": str(last)}) as r:
                    if r.status_code == 200:
                        async for event in _events(r):
                            if event["sequence_number"] != last + 1:
                                out.status, out.code = "failed", f"resumed at {event['sequence_number']} after {last}"
                                return
                            last = event["sequence_number"]
                            if event["type"] in ENDED:
                                self._finish_response(out, event["response"])
                                return
                    else:
                        await r.aread()  # it ended meanwhile (410): read it whole
                        out.code = f"resume {r.status_code} {r.text[:60]}"
            except httpx.TransportError as exc:  # the other gateway down (killed, restarting): ask this one
                out.code = f"resume {type(exc).__name__}"
                other = http
        await self._poll_response(other, headers, out, {"id": response_id, "status": "in_progress"})

    async def _embeddings(self, http, headers, tenant, out: Outcome) -> None:
        start = time.monotonic()
        inputs = [f"{tenant.name} embeds {self.random.random():.6f}" for _ in range(self.random.randint(1, 4))]
        r = await http.post("/v1/embeddings", headers=headers, json={"model": self.embedding_model, "input": inputs})
        if self._refused(out, r):
            return
        out.request_ids.append(r.headers.get("X-Request-Id", ""))
        out.ttft_s = time.monotonic() - start
        out.status, out.completion_tokens = "completed", 0

    async def _conversation(self, http, headers, tenant, out: Outcome) -> None:
        if tenant.conversation is None or tenant.turns >= TURNS_PER_CONVERSATION:
            r = await http.post("/v1/conversations", headers=headers, json={})
            if self._refused(out, r):
                return
            tenant.conversation, tenant.turns = r.json()["id"], 0
        tenant.turns += 1
        answer = await self._post_response(http, headers, tenant, out, conversation=tenant.conversation)
        if answer is not None:
            self._finish_response(out, answer)

    async def _batch(self, http, headers, tenant, out: Outcome) -> None:
        lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                             "body": self._chat_body(tenant, False)}) for i in range(3)]
        r = await http.post("/v1/files", headers=headers, data={"purpose": "batch"},
                            files={"file": ("lines.jsonl", ("\n".join(lines) + "\n").encode())})
        if self._refused(out, r):
            return
        r = await http.post("/v1/batches", headers=headers, json={
            "input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
        if self._refused(out, r):
            return
        batch = r.json()
        deadline = time.monotonic() + 600
        while batch["status"] not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
            await asyncio.sleep(2.0)
            r = await _get(http, f"/v1/batches/{batch['id']}", headers)
            if r.status_code == 200:
                batch = r.json()
        if batch["status"] != "completed" or not batch.get("output_file_id"):
            out.status, out.code = "failed", f"batch {batch['status']}"
            return
        deadline = time.monotonic() + 120
        while True:  # a tenant over its rate limit is told to come back (429): it does, as a client would
            r = await _get(http, f"/v1/files/{batch['output_file_id']}/content", headers)
            if r.status_code not in (429, 503) or time.monotonic() > deadline:
                break
            await asyncio.sleep(2.0)
        if self._refused(out, r):
            return
        tokens = 0
        for line in r.text.splitlines():
            response = json.loads(line)["response"]
            out.request_ids.append(response["request_id"])
            tokens += response["body"]["usage"]["completion_tokens"]
        out.status, out.completion_tokens = "completed", tokens


async def _events(r: httpx.Response):
    """The JSON events of a Responses stream."""
    async for line in r.aiter_lines():
        if line.startswith("data: "):
            yield json.loads(line[6:])


async def _get(http: httpx.AsyncClient, url: str, headers: dict) -> httpx.Response:
    """A poll's GET: a gateway restarting (no connection, a cut one) is asked again, as a client polling would;
    only an answer, whatever its status, is returned (or the last error, after two minutes without one)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return await http.get(url, headers=headers)
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)


class _ChatStream:
    """What a streamed chat's client has read, across a resume: the last event's id, the end and the finish."""

    def __init__(self, cut: bool, start: float) -> None:
        self.cut, self.start = cut, start
        self.chunks, self.done, self.finish = 0, False, None
        self.last_event_id: str | None = None

    @property
    def ended(self) -> bool:
        return self.done or self.cut and self.chunks >= CUT_AFTER_CHUNKS

    async def read(self, r: httpx.Response, out: Outcome) -> None:
        async for line in r.aiter_lines():
            if line.startswith("id: "):
                self.last_event_id = line[4:]
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                self.done = True
                return
            self.chunks += 1
            event = json.loads(line[6:])
            if "error" in event:
                out.status, out.code = "failed", f"event {event['error'].get('code')}"
                continue
            for choice in event.get("choices") or []:
                self.finish = choice.get("finish_reason") or self.finish
                # The first token, not the first chunk: a chat's opening chunk (its role, no content) goes out when
                # a worker starts the request, before its prefill.
                if out.ttft_s is None and (choice.get("delta") or {}).get("content"):
                    out.ttft_s = time.monotonic() - self.start
            if event.get("usage"):
                out.completion_tokens = event["usage"]["completion_tokens"]
            if self.cut and self.chunks >= CUT_AFTER_CHUNKS:
                out.status = "cut"
                return
