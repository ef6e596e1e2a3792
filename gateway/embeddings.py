"""``POST /v1/embeddings``: an admitted request → one wire request to the embedding model's queue (the same
publishing, relay, tiers and billing as chat: gateway/serving.py's ``start``/``deltas``/``end``) → its vectors,
gathered from the worker's deltas in input order → OpenAI's list of embeddings, as floats or base64.

The worker sends each vector as little-endian float32 bytes, which is exactly what OpenAI's base64 encodes: base64
is those bytes encoded, floats are those bytes read. Not streamed (OpenAI's embeddings never are).
"""

from __future__ import annotations

import array
import base64
import sys

from fastapi.responses import JSONResponse

from switchyard.domain.admission.ticket import Ticket
from switchyard.domain.api.embeddings import EmbeddingRequest
from switchyard.domain.errors import OpenAIError
from switchyard.gateway.serving import CompletionService, Outcome
from switchyard.shared.messages import SamplingParams


def as_floats(vector: bytes) -> list[float]:
    values = array.array("f")
    values.frombytes(vector)
    if sys.byteorder == "big":
        values.byteswap()  # the wire's are little-endian
    return values.tolist()


def embedding_json(index: int, vector: bytes, encoding_format: str) -> dict:
    value = base64.b64encode(vector).decode() if encoding_format == "base64" else as_floats(vector)
    return {"object": "embedding", "index": index, "embedding": value}


class EmbeddingService:
    def __init__(self, completions: CompletionService) -> None:
        self._completions = completions

    async def embed(self, body: EmbeddingRequest, ticket: Ticket) -> JSONResponse:
        embed = body.wire()
        request = await self._completions.wire_request(body, ticket, embed=embed, sampling=SamplingParams())
        relayed, first = await self._completions.start(request, ticket)
        vectors: list[bytes] = []
        outcome = Outcome(request_id=request.request_id)  # no finish_reason: nothing for the affinity index
        try:
            async for delta in self._completions.deltas(relayed, first):
                if delta.error is not None:
                    raise OpenAIError.from_info(delta.error)
                vectors += delta.embeddings or ()
                if delta.usage is not None:
                    outcome.usage = delta.usage
        finally:
            await self._completions.end(relayed, ticket, outcome, outcome.usage.total_tokens)
        if len(vectors) != embed.num_inputs:  # a worker's bug, never a client's: say so, do not guess
            raise OpenAIError(502, f"The worker sent {len(vectors)} embeddings for {embed.num_inputs} "
                                   "inputs.", type="server_error", code="bad_worker_message")
        usage = outcome.usage.prompt_tokens
        return JSONResponse({"object": "list", "model": request.model,
                             "data": [embedding_json(i, v, body.encoding_format) for i, v in enumerate(vectors)],
                             "usage": {"prompt_tokens": usage, "total_tokens": usage}},
                            headers={"X-Request-Id": request.request_id})
