"""Before authentication, tried as a hostile client would: a wrong key is refused before a byte of its body is read,
a body trickled in is cut at its deadline, and an address that keeps guessing keys is throttled (429, Retry-After)
while a good key from another address goes on being served."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from switchyard.deploy.services import wait_until_ready
from tests.support.system import free_port

MODEL = "tiny"
BODY_TIMEOUT_S = 2.0
FAILED_PER_MINUTE = 5


@pytest.fixture(scope="module")
def gate(e2e):
    """A gateway that wants a body whole within 2 s and lets an address fail 5 keys a minute."""
    port = free_port()
    gateway = e2e.start_gateway("gateway-gate", port=port, run_jobs=False, body_timeout_s=BODY_TIMEOUT_S,
                                failed_auth_per_minute=FAILED_PER_MINUTE)
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", MODEL, timeout_s=60, watch=[gateway])
        yield port
    finally:
        gateway.stop()


def read_response(sock: socket.socket, timeout_s: float) -> tuple[int, dict[str, str], dict]:
    """The status, headers and JSON body of the one response on ``sock`` (the server closes it after)."""
    sock.settimeout(timeout_s)
    raw = b""
    while b"\r\n\r\n" not in raw or len(raw.partition(b"\r\n\r\n")[2]) < _length(raw):
        chunk = sock.recv(65536)
        if not chunk:
            break
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body[:int(headers["content-length"])])


def _length(raw: bytes) -> int:
    for line in raw.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


def open_request(port: int, key: str, length: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection that sent a chat request's headers, announcing ``length`` bytes of body, and none of it yet."""
    sock = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {key}\r\nContent-Length: {length}\r\n\r\n".encode())
    return sock


def test_a_wrong_key_is_refused_before_its_body_is_read(gate):
    # 3.4 MB announced, nothing sent: a gateway that read the body first would wait for it (then 408), not answer.
    sock = open_request(gate, "sk-not-a-key", 3_400_000, source="127.0.0.9")
    try:
        status, headers, body = read_response(sock, timeout_s=BODY_TIMEOUT_S / 2)
    finally:
        sock.close()
    assert status == 401, body
    assert body["error"]["code"] == "invalid_api_key"
    assert headers.get("connection") == "close"  # the unread body is not waited for


async def test_a_body_trickled_in_is_cut_at_its_deadline(gate, new_key):
    _, secret = await new_key("pro")
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    sock = open_request(gate, secret, len(body))
    t0 = time.monotonic()
    try:
        sock.settimeout(0.5)
        answered = b""
        for byte in body:  # a byte every 0.5 s: the whole body would take many times the deadline
            sock.sendall(bytes([byte]))
            try:
                answered = sock.recv(65536, socket.MSG_PEEK)
            except (TimeoutError, BlockingIOError):
                continue
            if answered:
                break
        assert answered, "the gateway waited for the whole trickled body"
        status, _, error = read_response(sock, timeout_s=5)
    finally:
        sock.close()
    assert status == 408, error
    assert error["error"]["code"] == "request_timeout"
    assert time.monotonic() - t0 < BODY_TIMEOUT_S + 3  # cut at its deadline, not served after minutes


async def test_an_address_guessing_keys_is_throttled_and_another_address_is_not(gate, new_key):
    _, secret = await new_key("pro")
    base = f"http://127.0.0.1:{gate}"

    def client(source: str, key: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30,
                                 transport=httpx.AsyncHTTPTransport(local_address=source))

    async with client("127.0.0.2", "sk-guess") as guesser, client("127.0.0.2", secret) as same_address, \
            client("127.0.0.3", secret) as other_address:
        for _ in range(FAILED_PER_MINUTE):
            assert (await guesser.get("/v1/models")).status_code == 401
        throttled = await guesser.get("/v1/models", headers={"X-Forwarded-For": "10.9.9.9"})  # not a trusted proxy
        assert throttled.status_code == 429, throttled.text
        assert throttled.json()["error"]["code"] == "too_many_failed_keys"
        assert 1 <= int(throttled.headers["Retry-After"]) <= 60
        # The guessing address is refused before any key is looked up, even a good one...
        assert (await same_address.get("/v1/models")).status_code == 429
        # ...while a good key from another address is served as before.
        served = await other_address.get("/v1/models")
        assert served.status_code == 200, served.text
        assert MODEL in {m["id"] for m in served.json()["data"]}
