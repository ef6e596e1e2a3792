"""A streamed response outlives its gateway, on real processes (gateway/responses_service.py's ``resume``): its
gateway killed mid-stream, the client asks another with ``GET /v1/responses/{id}?stream=true&starting_after=N`` and
gets every later event once, the response stored and billed once; a client that comes back elsewhere while its
first gateway lives moves the stream, and that gateway lets go of it quietly; one whose worker never answers the
ask leaves the run where it was, to end stored once. Bad asks get a 400, 404 or 410 and learn nothing."""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import AsyncIterator

import asyncpg
import httpx
import openai

from switchyard.deploy.services import wait_until_ready
from tests.e2e.test_stream_resume import sim_model  # noqa: F401 (a simulated worker at 20 tokens/s)
from tests.support.system import free_port, poll, usage_rows

TOKENS = 60  # 3 s at 20 tokens/s: long enough to break the stream in the middle
ENDED = "response.incomplete"  # the simulated engine writes up to max_output_tokens: cut there, as OpenAI says


def _body(model: str, tokens: int = TOKENS, **kw) -> dict:
    return {"model": model, "input": f"resume me {uuid.uuid4().hex}", "max_output_tokens": tokens, "stream": True,
            **kw}


async def _events(response: httpx.Response | AsyncIterator[str], stop_after_texts: int | None = None) -> list[dict]:
    """The events of a Responses stream as a client reads them (``stop_after_texts``: then it stops reading; pass
    the lines' iterator, not the response, to read on later)."""
    events, texts = [], 0
    lines = response.aiter_lines() if isinstance(response, httpx.Response) else response
    async for line in lines:
        if not line.startswith("data: "):
            continue
        events.append(json.loads(line[6:]))
        if events[-1]["type"] == "response.output_text.delta":
            texts += 1
            if texts == stop_after_texts:
                break
    return events


def _text(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def _gateway(e2e, model: str):
    port = free_port()
    gw = e2e.start_gateway(f"gateway-rresume-{uuid.uuid4().hex[:4]}", port=port)
    wait_until_ready(f"http://127.0.0.1:{port}", model, timeout_s=60, watch=[gw])
    return gw, f"http://127.0.0.1:{port}"


async def _stream_then_kill_its_gateway(e2e, auth: dict, body: dict, texts: int) -> list[dict]:
    gw, url = _gateway(e2e, body["model"])
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{url}/v1/responses", headers=auth, json=body) as r:
                assert r.status_code == 200
                events = await _events(r, stop_after_texts=texts)
                os.kill(gw.pid, signal.SIGKILL)
    finally:
        gw.stop()
    assert events[-1]["type"] == "response.output_text.delta"
    return events


async def _background_running(http: httpx.AsyncClient, url: str, auth: dict, model: str) -> str:
    """A background response created through ``url``, once it runs: its id."""
    queued = (await http.post(f"{url}/v1/responses", headers=auth,
                              json=_body(model, stream=False, background=True))).json()

    async def running() -> bool:
        r = await http.get(f"{url}/v1/responses/{queued['id']}", headers=auth)
        return r.json()["status"] == "in_progress"

    await poll(running, timeout_s=30, what="the background response running")
    return queued["id"]


def _resume_url(url: str, response_id: str, starting_after: int | None = None) -> str:
    after = "" if starting_after is None else f"&starting_after={starting_after}"
    return f"{url}/v1/responses/{response_id}?stream=true{after}"


async def test_a_client_whose_gateway_died_resumes_the_response_on_another_every_later_event_once(
        e2e, system, auth, sim_model, nats_url, database_url):
    body = _body(sim_model)
    before = await _stream_then_kill_its_gateway(e2e, auth, body, texts=10)
    response_id, last = before[0]["response"]["id"], before[-1]["sequence_number"]
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("GET", _resume_url(system, response_id, last), headers=auth) as r:
            assert r.status_code == 200, await r.aread()
            after = await _events(r)
        stored = (await http.get(f"{system}/v1/responses/{response_id}", headers=auth)).json()
    # Numbered on from the client's last event: nothing twice, nothing skipped.
    assert [e["sequence_number"] for e in after] == list(range(last + 1, last + 1 + len(after)))
    done = after[-1]
    assert done["type"] == ENDED and done["response"]["usage"]["output_tokens"] == TOKENS
    said = done["response"]["output"][0]["content"][0]["text"]
    assert _text(before) + _text(after) == said  # what the client assembled is the whole reply
    assert stored["status"] == "incomplete" and stored["output"] == done["response"]["output"]
    rows = await usage_rows(database_url, nats_url, response_id.removeprefix("resp_"), "completion_tokens")
    assert [row["completion_tokens"] for row in rows] == [TOKENS]  # billed once


async def test_only_the_owner_resumes_and_only_from_an_event_that_was_sent(e2e, system, auth, sim_model, new_key):
    body = _body(sim_model, tokens=400)  # still running while it is asked about
    before = await _stream_then_kill_its_gateway(e2e, auth, body, texts=3)
    response_id = before[0]["response"]["id"]
    _, other_key = await new_key()
    async with httpx.AsyncClient(timeout=60) as http:
        for headers, url, status, code in (
                ({"Authorization": f"Bearer {other_key}"}, _resume_url(system, response_id), 404, "not_found"),
                (auth, _resume_url(system, f"resp_{uuid.uuid4().hex}"), 404, "not_found"),
                (auth, _resume_url(system, response_id, 100_000), 404, "stream_not_found"),
                (auth, f"{system}/v1/responses/{response_id}?starting_after=3", 400, "invalid_request")):
            r = await http.get(url, headers=headers)
            assert r.status_code == status and r.json()["error"]["code"] == code, (url, r.text)
        r = await http.get(f"{_resume_url(system, response_id)}&include_obfuscation=true", headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "include_obfuscation", r.text
    # The owner still may, from the very start (nothing above took the stream over for good), with the official
    # client's own call for it.
    client = openai.AsyncOpenAI(base_url=f"{system}/v1", api_key=auth["Authorization"].removeprefix("Bearer "),
                                max_retries=0)
    again = []
    stream = await client.responses.retrieve(response_id, stream=True)
    async for event in stream:
        again.append(event.model_dump(mode="json", exclude_unset=True))
        if len([e for e in again if e["type"] == "response.output_text.delta"]) == 4:
            break
    await stream.close()
    await client.close()
    assert [e["sequence_number"] for e in again] == list(range(len(again)))
    assert again[:len(before)] == before  # made again, event for event


async def test_a_response_that_ended_is_not_streamed_again(system, auth, sim_model):
    async with httpx.AsyncClient(timeout=60) as http:
        done = (await http.post(f"{system}/v1/responses", headers=auth,
                                json=_body(sim_model, tokens=2, stream=False))).json()
        r = await http.get(_resume_url(system, done["id"], 0), headers=auth)
        assert r.status_code == 410 and r.json()["error"]["code"] == "stream_expired", r.text


async def test_a_background_response_whose_gateway_died_is_streamed_and_run_to_its_end_by_another(
        e2e, system, auth, sim_model, nats_url, database_url):
    gw, url = _gateway(e2e, sim_model)
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            response_id = await _background_running(http, url, auth, sim_model)
            os.kill(gw.pid, signal.SIGKILL)
            # Its client streams it from another gateway, from the start, then leaves after a few events: the
            # response goes on to its end there all the same, as a background one does.
            async with http.stream("GET", _resume_url(system, response_id), headers=auth) as r:
                assert r.status_code == 200, await r.aread()
                seen = await _events(r, stop_after_texts=3)
            assert [e["sequence_number"] for e in seen] == list(range(len(seen)))
            assert seen[0]["type"] == "response.created" and seen[0]["response"]["background"] is True

            async def ended() -> dict | None:
                body = (await http.get(f"{system}/v1/responses/{response_id}", headers=auth)).json()
                return body if body["status"] not in ("queued", "in_progress") else None

            stored = await poll(ended, timeout_s=60, what="the background response's end")
        assert stored["status"] == "incomplete" and stored["usage"]["output_tokens"] == TOKENS
        assert stored["output"][0]["content"][0]["text"].startswith(_text(seen))
        rows = await usage_rows(database_url, nats_url, response_id.removeprefix("resp_"), "completion_tokens")
        assert [row["completion_tokens"] for row in rows] == [TOKENS]  # billed once
    finally:
        gw.stop()


async def test_a_client_back_elsewhere_while_its_gateway_lives_moves_the_stream_and_it_ends_once(
        e2e, system, auth, sim_model, nats_url, database_url):
    body = _body(sim_model)
    gw, url = _gateway(e2e, sim_model)
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{url}/v1/responses", headers=auth, json=body) as first:
                lines = first.aiter_lines()
                before = await _events(lines, stop_after_texts=5)
                response_id, last = before[0]["response"]["id"], before[-1]["sequence_number"]
                # The first connection hangs, not closed (a client's network gone quiet): the client comes back
                # on another gateway, which takes the stream over.
                async with http.stream("GET", _resume_url(system, response_id, last), headers=auth) as r:
                    assert r.status_code == 200
                    after = await _events(r)
                left = await _events(lines)  # what the first gateway still wrote: its end, quietly
        assert after[-1]["type"] == ENDED
        assert after[-1]["response"]["output"][0]["content"][0]["text"].startswith(_text(before))
        assert left and left[-1]["type"] == "response.failed"
        assert left[-1]["response"]["error"]["code"] == "stream_taken_over"
        async with httpx.AsyncClient(timeout=60) as http:
            stored = (await http.get(f"{system}/v1/responses/{response_id}", headers=auth)).json()
        assert stored["status"] == "incomplete"  # stored by the gateway that finished it, not failed by the other
        rows = await usage_rows(database_url, nats_url, response_id.removeprefix("resp_"), "completion_tokens")
        assert [row["completion_tokens"] for row in rows] == [TOKENS]
    finally:
        gw.stop()


async def test_a_take_over_its_stalled_worker_never_answers_leaves_the_run_on_its_gateway_to_end_once(
        e2e, system, auth, nats_url, database_url):
    # The two-hour soak's lost response: a background run's client streamed it from the gateway running it, the
    # worker did not answer the take-over in time (410), and the run, its deltas routed to the failed take-over's
    # inbox and no longer woken to look after its worker, waited with no end, its row kept alive, its seat held.
    name = f"sim-stalled-ask-{uuid.uuid4().hex[:6]}"
    worker = e2e.start_worker(name, max_num_seqs=4, engine="simulated", simulated_tokens_per_s=20)
    try:
        wait_until_ready(system, name, timeout_s=60, watch=[worker])
        async with httpx.AsyncClient(timeout=60) as http:
            response_id = await _background_running(http, system, auth, name)
            os.kill(worker.pid, signal.SIGSTOP)  # it answers nothing, and misses its pings
            try:
                r = await http.get(_resume_url(system, response_id), headers=auth)  # the gateway running it
            finally:
                os.kill(worker.pid, signal.SIGCONT)
            assert r.status_code == 410 and r.json()["error"]["code"] == "stream_expired", r.text

            async def ended() -> dict | None:
                body = (await http.get(f"{system}/v1/responses/{response_id}", headers=auth)).json()
                return body if body["status"] not in ("queued", "in_progress") else None

            stored = await poll(ended, timeout_s=60, what="the background response's end")
        # Its only worker went silent past the gateway's patience: the run, hearing nothing, took it for lost and
        # queued its continuation, which the worker, back, took: the response ends whole, billed once.
        assert stored["status"] == "incomplete", stored.get("error")  # at its max_output_tokens, as asked
        assert stored["usage"]["output_tokens"] == TOKENS
        request_id = response_id.removeprefix("resp_")
        rows = await usage_rows(database_url, nats_url, request_id, "completion_tokens")
        assert [row["completion_tokens"] for row in rows] == [stored["usage"]["output_tokens"]]  # as it was told
        conn = await asyncpg.connect(database_url)
        try:
            await poll(lambda: conn.fetchval("SELECT count(*) FROM open_requests WHERE request_id = $1", request_id),
                       until=lambda n: n == 0, timeout_s=10, what="its seat given back")
        finally:
            await conn.close()
    finally:
        worker.stop()


async def test_a_background_responses_stream_asked_for_on_the_gateway_running_it_is_every_event_once(
        e2e, system, auth):
    """The two-hour soak's "out of order" streams: the gateway running a background response opens the asking
    client's inbox before its worker answers, and a token the worker sends meanwhile came ahead of the resend. It
    must be taken for what it is (a copy the resend repeats), not for a hole that sends the run elsewhere."""
    name = f"sim-fast-{uuid.uuid4().hex[:6]}"
    # Fast enough that a token goes out between the inbox opening and the worker's answer, on most asks.
    metrics_port = free_port()
    worker = e2e.start_worker(name, max_num_seqs=8, engine="simulated", simulated_tokens_per_s=500,
                              metrics_port=metrics_port)
    tokens = 400
    try:
        wait_until_ready(system, name, timeout_s=60, watch=[worker])
        async with httpx.AsyncClient(timeout=60) as http:
            for _ in range(6):
                queued = (await http.post(f"{system}/v1/responses", headers=auth,
                                          json=_body(name, tokens, stream=False, background=True))).json()

                async def running(response_id: str = queued["id"]) -> bool:
                    r = await http.get(f"{system}/v1/responses/{response_id}", headers=auth)
                    return r.json()["status"] != "queued"

                await poll(running, timeout_s=30, what="the background response running")
                async with http.stream("GET", _resume_url(system, queued["id"]), headers=auth) as r:
                    assert r.status_code == 200, await r.aread()
                    events = await _events(r)
                assert [e["sequence_number"] for e in events] == list(range(len(events)))
                assert events[-1]["type"] == ENDED, events[-1]
                assert events[-1]["response"]["output"][0]["content"][0]["text"] == _text(events)
                assert events[-1]["response"]["usage"]["output_tokens"] == tokens
            text = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
        dismissed = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("switchyard:worker_dismissed_tokens_total{") and name in line)
        assert dismissed == 0  # no run was taken for broken, dismissed and run again
    finally:
        worker.stop()
