"""Streams that outlive their gateway, a gateway's side: a client whose stream broke sends its request again, to any
gateway, with the ``Last-Event-ID`` of the last event it got; the worker running it hands the stream over, and the
client gets every later event once (the worker's side: workers/service/stream_replay.py).

    POST /v1/chat/completions or /v1/completions, "stream": true, Last-Event-ID: <request>.<attempt>.<seq>.<n>
      ──▶ not an id of ours: 404 ──▶ this gateway's inbox for the request opened, then
          llm.resume.<request> (StreamResume: the caller's tenant, this gateway's token subject, the position)
      ──▶ no answer within RESUME_ASK_S: 404 (unknown, another tenant's, or its worker gone too)
          gone:  410 (it ended, was cancelled, or waited past stream_resume_window_s with no gateway)
          ahead: 404 (the id names an event never sent)
          ok:    the worker resends its run's deltas from the client's on, then the later ones, and says what the
                 client had before them; they are formatted as the first gateway did and only the events after the
                 client's are written (gateway/stream_ids.py)

Nothing is admitted or billed again: the request was admitted once, and its worker bills it when it ends. A
stream whose client closed the connection itself was cancelled then (as OpenAI's API does), so it is gone.
"""

from __future__ import annotations

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from switchyard.domain.errors import OpenAIError
from switchyard.gateway.relay import Relay
from switchyard.gateway.relayed_request import RelayedRequest
from switchyard.gateway.stream_ids import Position, parse_event_id
from switchyard.shared import subjects
from switchyard.shared.messages import TAKEN_OVER, ResumeAnswer, StreamResume, TokenDelta, decode, encode

# The worker holding the stream answers within milliseconds, unless it is answering a gateway's whole load of
# streams at once (its gateway died); silence this long means none holds it, so an unknown id waits this long.
RESUME_ASK_S = 5.0
_FIRST_DELTA_S = 10.0  # its resent deltas follow the answer at once; this only bounds a NATS hiccup
MOVED_MIDWAY = "This response's stream moved to another worker midway and can no longer be resumed."


def _not_found() -> OpenAIError:
    return OpenAIError(404, "No stream to resume for this Last-Event-ID: it is not one of your streams, or it "
                       "names an event that was never sent.", code="stream_not_found", param="Last-Event-ID")


class StreamResumer:
    """Takes streams over for this gateway; one per gateway process."""

    def __init__(self, nc: NATS, relay: Relay) -> None:
        self._nc = nc
        self._relay = relay

    async def take_over(self, last_event_id: str, tenant_id: str | None
                        ) -> tuple[RelayedRequest, TokenDelta, Position, int]:
        """The relayed request, its first resent delta, where the client is, and how much of choice 0's text it
        had before that delta; raises OpenAIError 404/410."""
        try:
            request_id, position = parse_event_id(last_event_id)
        except ValueError:
            raise _not_found() from None
        relayed, first, _, text_before = await self.take_over_request(request_id, tenant_id, position)
        return relayed, first, position, text_before

    async def take_over_request(self, request_id: str, tenant_id: str | None, position: Position,
                                first_attempt_only: bool = False) -> tuple[RelayedRequest, TokenDelta, ResumeAnswer,
                                                                           int]:
        """Take ``request_id``'s stream over from ``position`` (the client's last delta, sent again): the relayed
        request, its first resent delta, the worker's answer (its run, how many deltas it had sent) and how much
        of choice 0's text came before that delta; raises OpenAIError 404/410 (``first_attempt_only``: 410 for a
        later attempt, which stays with its gateway)."""
        displaced = self._relay.inbox_of(request_id)  # this gateway relays it already: its client came back here
        inbox = self._relay.open_inbox(request_id)  # before asking: the resent deltas come right after the answer
        try:
            ask = StreamResume(request_id, tenant_id, self._relay.token_subject, position.attempt, position.seq,
                               first_attempt_only)
            try:
                reply = await self._nc.request(subjects.resume_subject(request_id), encode(ask),
                                               timeout=RESUME_ASK_S)
                answer = decode(reply.data, ResumeAnswer)
            except (NatsTimeoutError, NoRespondersError, TimeoutError):
                raise _not_found() from None
            if answer.status == "gone":
                raise OpenAIError(410, "This stream can no longer be resumed: it ended, was cancelled when its "
                                  "client left, or waited longer than the resume window with no gateway.",
                                  code="stream_expired", param="Last-Event-ID")
            if answer.status == "moved":
                raise OpenAIError(410, MOVED_MIDWAY, code="stream_expired", param="stream")
            if answer.status != "ok" or answer.request is None:
                raise _not_found()
            relayed = self._relay.taken_over(answer.request, inbox, answer)
            if displaced is not None and displaced is not inbox:
                # The worker tells another gateway its stream was taken over; this one it cannot (the subject is
                # the same, and the new inbox gets it now): the run relayed here hears it as the worker would say
                # it, and ends its part quietly, its seat given back, nothing cancelled or stored.
                displaced.put(encode(TokenDelta(request_id, error=TAKEN_OVER, is_last=True, seq=answer.next_seq,
                                                attempt=answer.request.attempt, worker_id=answer.worker_id)))
        except BaseException:
            await inbox.close()
            raise
        text_before = relayed.text_len
        try:
            first = await relayed.first(_FIRST_DELTA_S)
        except BaseException:
            await relayed.close()
            raise
        return relayed, first, answer, text_before
