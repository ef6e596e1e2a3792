"""A stored response's stream taken over by this gateway (``GET /v1/responses/{id}?stream=true&starting_after=N``):
its worker hands the run over and sends every delta it had sent again, and the events are made again from them,
numbered as the first gateway numbered them (gateway/response_events.py), so only those after N go to the client.

    the stored row (the caller's, open) ──▶ take the request's stream over from its first delta (StreamResumer)
      ──▶ the run is a later attempt (a failover, a prefill's hand-over): its first run's deltas are gone: 410
      ──▶ the deltas sent again become events; N past the last of them was never sent: 404
      ──▶ the events after N, then the later deltas' (gateway/responses_service.py streams them on)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from switchyard.domain.errors import OpenAIError
from switchyard.gateway.response_run import ResponseRun, ResponseStream
from switchyard.gateway.serving import CompletionService, Outcome
from switchyard.gateway.stream_ids import Position
from switchyard.gateway.stream_resume import MOVED_MIDWAY, StreamResumer
from switchyard.shared.messages import StoredResponse, TokenDelta


def expired(message: str) -> OpenAIError:
    return OpenAIError(410, message, code="stream_expired", param="stream")


@dataclass
class TakenOver:
    """A response's stream taken over: its events made so far (``ready``: the client's from ``starting_after`` on),
    and the deltas still to come."""

    stream: ResponseStream
    relayed: object  # the RelayedRequest
    deltas: AsyncIterator[TokenDelta]
    ready: list[bytes]


async def take_over(resumer: StreamResumer, completions: CompletionService, stored: StoredResponse,
                    starting_after: int | None) -> TakenOver:
    """Take ``stored``'s stream over from its worker and make its events again up to what the worker had sent;
    raises OpenAIError 404 (``starting_after`` never sent) or 410 (not resumable any more)."""
    try:
        # First runs only: a later one's first deltas, from which the events are made again, died with its
        # first worker (a failover) or stayed with the prefill worker (a hand-over). Its worker leaves it with the
        # gateway that relays it, which runs it to its end and stores it.
        relayed, first, answer, _ = await resumer.take_over_request(stored.request_id, stored.tenant_id,
                                                                    Position(0, 0, 0), first_attempt_only=True)
    except OpenAIError as exc:
        if exc.status != 404:
            raise
        raise expired("This response's stream can no longer be resumed: its worker let it go.") from None
    if answer.request is not None and answer.request.attempt != 0:  # a worker older than first_attempt_only
        await completions.end(relayed, None, Outcome(request_id=stored.request_id), None)
        raise expired(MOVED_MIDWAY)
    stream = ResponseStream(ResponseRun.resumed(stored, relayed.request),
                            -1 if starting_after is None else starting_after)
    deltas = completions.deltas(relayed, first).__aiter__()
    ready = stream.opening()
    try:
        # The deltas the worker sent again (all it had sent: whatever the first gateway sent the client was made
        # of them) come first, at once; the client's position must be among their events.
        async for delta in deltas:
            ready += stream.add(delta)
            if stream.error is not None or delta.is_last:
                ready += stream.end()
                break
            if delta.seq >= answer.next_seq - 1:
                break
        if starting_after is not None and starting_after >= stream.events.num_made:
            raise OpenAIError(404, f"No event {starting_after} was sent in this response's stream.",
                              code="stream_not_found", param="starting_after")
    except BaseException:
        await relayed.close()  # not cancelled: the client may ask again, from where it is
        raise
    return TakenOver(stream, relayed, deltas, ready)
