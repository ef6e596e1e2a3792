"""Streams that outlive their gateway, on real processes (gateway/stream_resume.py): a gateway killed mid-stream,
its client resumes on another with Last-Event-ID and gets every later event once, billed once; a resume that is
not the owner's, names nothing sent, or comes after the window gets a 404 or 410 and learns nothing."""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from switchyard.deploy.services import wait_until_ready
from switchyard.gateway.stream_ids import parse_event_id
from tests.support.system import free_port, poll, usage_rows

TOKENS = 60  # 3 s at 20 tokens/s: long enough to kill its gateway in the middle


@pytest.fixture(scope="module")
def sim_model(e2e, system):
    name = f"sim-resume-{uuid.uuid4().hex[:6]}"
    worker = e2e.start_worker(name, max_num_seqs=8, engine="simulated", simulated_tokens_per_s=20)
    try:
        wait_until_ready(system, name, timeout_s=60, watch=[worker])
        yield name
    finally:
        worker.stop()


def _body(model: str, chat: bool = False, **kw) -> dict:
    asked = ({"messages": [{"role": "user", "content": f"resume me {uuid.uuid4().hex}"}]} if chat
             else {"prompt": f"resume me {uuid.uuid4().hex}"})
    return {"model": model, **asked, "max_tokens": TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **kw}


def _path(body: dict) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


class Events:
    """A stream's SSE events as a client reads them: their ids, text and usage."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.text = ""
        self.usage: dict | None = None
        self.done = False
        self.roles = 0  # a chat stream's opening chunks

    async def read(self, response: httpx.Response | AsyncIterator[str], stop_after_texts: int | None = None) -> None:
        """Read events (``stop_after_texts``: then stop; pass the lines' iterator, not the response, to read on)."""
        event_id, texts = None, 0
        lines = response.aiter_lines() if isinstance(response, httpx.Response) else response
        async for line in lines:
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                assert event_id is not None, "every event of a resumable stream has an id"
                self.ids.append(event_id)
                event_id = None
                if line == "data: [DONE]":
                    self.done = True
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                self.usage = event.get("usage") or self.usage
                choice = event["choices"][0] if event["choices"] else {}
                if (choice.get("delta") or {}).get("role"):
                    self.roles += 1
                if text := choice.get("text") or (choice.get("delta") or {}).get("content"):
                    self.text += text
                    texts += 1
                    if stop_after_texts is not None and texts == stop_after_texts:
                        return


async def _reference_text(url: str, auth: dict, body: dict) -> str:
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(f"{url}{_path(body)}", headers=auth, json={**body, "stream": False,
                                                                         "stream_options": None})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]


async def _stream_then_kill_its_gateway(e2e, auth: dict, body: dict, texts: int, **gateway) -> Events:
    """Stream ``body`` through a gateway of its own, read ``texts`` text events, then SIGKILL that gateway."""
    port = free_port()
    gw = e2e.start_gateway(f"gateway-resume-{uuid.uuid4().hex[:4]}", port=port, **gateway)
    events = Events()
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", body["model"], timeout_s=60, watch=[gw])
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"http://127.0.0.1:{port}{_path(body)}", headers=auth,
                                   json=body) as r:
                assert r.status_code == 200
                await events.read(r, stop_after_texts=texts)
                os.kill(gw.pid, signal.SIGKILL)
    finally:
        gw.stop()
    assert not events.done
    return events


async def _resume(url: str, auth: dict, body: dict, last_event_id: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as http:
        return await http.post(f"{url}{_path(body)}", headers={**auth, "Last-Event-ID": last_event_id},
                               json=body)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_a_client_whose_gateway_died_resumes_on_another_and_gets_every_later_event_once_billed_once(
        e2e, system, auth, sim_model, nats_url, database_url, chat):
    body = _body(sim_model, chat)
    before = await _stream_then_kill_its_gateway(e2e, auth, body, texts=10)
    after = Events()
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{system}{_path(body)}", json=body,
                               headers={**auth, "Last-Event-ID": before.ids[-1]}) as r:
            assert r.status_code == 200, await r.aread()
            request_id = r.headers["X-Request-Id"]
            await after.read(r)
    assert after.done and after.usage is not None and after.usage["completion_tokens"] == TOKENS
    assert not set(before.ids) & set(after.ids) and before.roles + after.roles == chat  # nothing twice
    assert before.text + after.text == await _reference_text(system, auth, body)  # nothing missing
    assert request_id == before.ids[0].split(".")[0]
    (row,) = await usage_rows(database_url, nats_url, request_id, "completion_tokens")
    assert row["completion_tokens"] == TOKENS


async def test_only_the_owner_may_resume_and_only_from_an_event_that_was_sent(
        e2e, system, auth, sim_model, new_key):
    body = _body(sim_model, max_tokens=400)  # still running while it is asked about
    before = await _stream_then_kill_its_gateway(e2e, auth, body, texts=3)
    request_id, attempt, seq, n = before.ids[-1].rsplit(".", 3)
    _, other_key = await new_key()
    for key, last_event_id in ((f"Bearer {other_key}", before.ids[-1]),  # another tenant's
                               (auth["Authorization"], f"{request_id}.{attempt}.{int(seq) + 500}.0"),  # never sent
                               (auth["Authorization"], f"{uuid.uuid4().hex}.0.3.0"),  # no such request
                               (auth["Authorization"], "not-an-event-id")):
        r = await _resume(system, {"Authorization": key}, body, last_event_id)
        assert r.status_code == 404, (last_event_id, r.text)
        error = r.json()["error"]
        assert error["code"] == "stream_not_found" and request_id not in error["message"]
    # The owner still may (nothing above took the stream over).
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{system}/v1/completions", json=body,
                               headers={**auth, "Last-Event-ID": before.ids[-1]}) as r:
            assert r.status_code == 200
            after = Events()
            await after.read(r, stop_after_texts=1)
    assert after.ids and parse_event_id(after.ids[0])[1] > parse_event_id(before.ids[-1])[1]


async def test_a_stream_no_gateway_took_over_within_the_window_is_cancelled_billed_and_gone(
        e2e, system, auth, sim_model, nats_url, database_url):
    body = _body(sim_model, max_tokens=2000)  # far longer than the window: it must be cut
    before = await _stream_then_kill_its_gateway(e2e, auth, body, texts=3, stream_resume_window_s=1.0)
    request_id = before.ids[0].split(".")[0]
    # Its gateway is taken for dead after 3 s, the window is 1 s: then its worker cancels it, billed for what ran.
    (row,) = await poll(lambda: usage_rows(database_url, nats_url, request_id,
                                           "completion_tokens, finish_reason"),
                        timeout_s=30, what="the cancelled stream's usage row")
    assert row["finish_reason"] == "cancelled" and 3 <= row["completion_tokens"] < 2000
    r = await _resume(system, auth, body, before.ids[-1])
    assert r.status_code == 410 and r.json()["error"]["code"] == "stream_expired", r.text


async def test_a_stream_whose_client_left_its_live_gateway_is_gone(system, auth, sim_model, nats_url,
                                                                   database_url):
    body = _body(sim_model, max_tokens=400)
    events = Events()
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{system}/v1/completions", headers=auth, json=body) as r:
            request_id = r.headers["X-Request-Id"]
            await events.read(r, stop_after_texts=2)  # then the client closes the connection: it is cancelled
    await poll(lambda: usage_rows(database_url, nats_url, request_id, "finish_reason"), timeout_s=20,
               what="the cancelled stream's usage row")
    r = await _resume(system, auth, body, events.ids[-1])
    assert r.status_code == 410 and r.json()["error"]["code"] == "stream_expired", r.text


async def test_a_client_back_elsewhere_while_its_gateway_lives_moves_the_stream_billed_once(
        e2e, system, auth, sim_model, nats_url, database_url):
    body = _body(sim_model, chat=True)
    port = free_port()
    gw = e2e.start_gateway(f"gateway-resume-{uuid.uuid4().hex[:4]}", port=port)
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", sim_model, timeout_s=60, watch=[gw])
        before, after = Events(), Events()
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", headers=auth,
                                   json=body) as first:
                lines = first.aiter_lines()
                await before.read(lines, stop_after_texts=5)
                # The first connection hangs, not closed: the client comes back on another gateway.
                async with http.stream("POST", f"{system}/v1/chat/completions", json=body,
                                       headers={**auth, "Last-Event-ID": before.ids[-1]}) as r:
                    assert r.status_code == 200
                    await after.read(r)
                left = [line async for line in lines if line.startswith("data: ")]
        assert after.done and after.usage["completion_tokens"] == TOKENS
        assert before.text + after.text == await _reference_text(system, auth, body)
        # The first gateway let go: its copy ends with the worker's word, and nothing was billed there.
        events = [json.loads(line[6:]) for line in left if line != "data: [DONE]"]
        assert events and events[-1]["error"]["code"] == "stream_taken_over"
        (row,) = await usage_rows(database_url, nats_url, before.ids[0].split(".")[0], "completion_tokens")
        assert row["completion_tokens"] == TOKENS
    finally:
        gw.stop()


async def test_an_ask_that_fails_on_the_gateway_relaying_the_stream_leaves_the_stream_whole(
        system, auth, sim_model, new_key, nats_url, database_url):
    # Another tenant's ask for the stream (never answered) and its owner's ask from an event never sent ("ahead"),
    # each made to the gateway that relays it while it runs: each is refused, and the stream reads on to its end,
    # nothing missing, billed once. (The take-over's inbox had displaced the stream's own, and left it deaf.)
    body = _body(sim_model, max_tokens=200)  # 10 s: running still when the other tenant's ask has waited its 5 s
    _, other_key = await new_key()
    events = Events()
    async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=20)) as http:
        async with http.stream("POST", f"{system}{_path(body)}", headers=auth, json=body) as r:
            assert r.status_code == 200
            request_id = r.headers["X-Request-Id"]
            lines = r.aiter_lines()
            await events.read(lines, stop_after_texts=3)
            request, attempt, seq, _ = events.ids[-1].rsplit(".", 3)
            for key, last_event_id in ((f"Bearer {other_key}", events.ids[-1]),
                                       (auth["Authorization"], f"{request}.{attempt}.{int(seq) + 500}.0")):
                refused = await _resume(system, {"Authorization": key}, body, last_event_id)
                assert refused.status_code == 404, (key == auth["Authorization"], refused.text)
                assert refused.json()["error"]["code"] == "stream_not_found"
            await events.read(lines)
    assert events.done and events.usage is not None and events.usage["completion_tokens"] == 200
    assert events.text == await _reference_text(system, auth, body)
    (row,) = await usage_rows(database_url, nats_url, request_id, "completion_tokens")
    assert row["completion_tokens"] == 200
