"""A tenant whose prompts are slow to prepare, beside a victim tenant on the same worker: the scenario that
tests/e2e/test_hostile_work.py asserts the mechanism of and bench/hostile.py times.

An attack runs six loops in a process of their own (a client elsewhere: building and sending its bodies must not
hold up the victim's measurements), at a lower CPU priority. Each loop sends, while the attack is on, a body that
is slow to prepare: a 350 KB schema (about half a second of grammar compiling) or 2048 messages; or one the
gateway refuses as oversized (``OVERSIZED``: what it costs is the gateway's own). A pair, in time order:

    attack on → every loop has a request in flight, and one has been answered since (the attacker's work is
    reaching the worker) → the victim's streamed request ("attacked") → attack off → no attacker request in
    flight (the worker is the victim's alone) → the victim's request again ("idle")

Samples in pairs close in time: the machine's other load weighs on both alike.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import queue
import time
from dataclasses import dataclass, field

import httpx

LOOPS = 6


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def chat_body(model: str, max_tokens: int = 2, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **extra}


def heavy_schema(salt: int, branches: int = 8000) -> dict:
    """An anyOf of ``branches`` objects (8000: about 700 KB; compiles for about a second, then runs out of fuel).
    ``salt`` makes each one new (a compiled grammar is cached by its text)."""
    return {"type": "object", "required": ["x"], "properties": {"x": {"anyOf": [
        {"type": "object", "properties": {f"k{i}": {"const": f"v{i}_{salt}"}}, "required": [f"k{i}"]}
        for i in range(branches)]}}}


def with_schema(schema: dict, model: str) -> dict:
    return chat_body(model, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})


def huge_schema_attack(model: str, salt: int) -> dict:
    # Half the 8000-branch schema (350 KB over the wire): still three times a gateway's default limit, and about
    # half a second of compiling for the tiny model's vocabulary, against the victim's tens of milliseconds.
    return with_schema(heavy_schema(salt, 4000), model)


def many_messages_attack(model: str, salt: int) -> dict:
    return chat_body(model, messages=[{"role": "user", "content": f"m{salt} {i}"} for i in range(2048)])


def oversized_schema_attack(model: str, salt: int) -> dict:
    # The whole 8000-branch schema (700 KB): five times the default limit, refused by the gateway with a 400.
    return with_schema(heavy_schema(salt), model)


def oversized_messages_attack(model: str, salt: int) -> dict:
    # 15,000 messages (about 500 KB): over the 2048 allowed, refused by the gateway with a 400.
    return chat_body(model, messages=[{"role": "user", "content": f"m{salt}"}] * 15_000)


ATTACKS = {"huge schema": huge_schema_attack, "2048 messages": many_messages_attack}
# Bodies the gateway refuses: what they cost is the gateway's, before anything reaches a worker.
OVERSIZED = {"8000-branch schema": oversized_schema_attack, "15000 messages": oversized_messages_attack}
BODIES = {**ATTACKS, **OVERSIZED}


def attacker_process(base_url: str, secret: str, model: str, attack: str, on, stop, spans, in_flight) -> None:
    """The attacking loops (see the module docstring): they send while ``on`` is set, count what they have sent
    and not had answered in ``in_flight``, and put each request's (start, end) on ``spans``."""
    import concurrent.futures

    os.setpriority(os.PRIO_PROCESS, 0, 10)

    def loop(n: int) -> None:
        with httpx.Client(base_url=base_url, headers=bearer(secret), timeout=120) as http:
            salt = n * 1_000_000
            while not stop.is_set():
                if not on.wait(0.1):
                    continue
                body = json.dumps(BODIES[attack](model, salt)).encode()
                salt += 1
                with in_flight.get_lock():
                    in_flight.value += 1
                if not on.is_set():  # switched off meanwhile: the victim may be measured idle now
                    with in_flight.get_lock():
                        in_flight.value -= 1
                    continue
                start = time.monotonic()
                try:
                    r = http.post("/v1/chat/completions", content=body,
                                  headers={"Content-Type": "application/json"})
                    # 429: the gateway refuses this key's bodies unread once it has refused too many (a hostile
                    # client sends on regardless).
                    assert r.status_code in (200, 400) or (r.status_code == 429 and attack in OVERSIZED), r.text[:300]
                    spans.put((start, time.monotonic()))
                finally:
                    with in_flight.get_lock():
                        in_flight.value -= 1

    with concurrent.futures.ThreadPoolExecutor(LOOPS) as pool:
        list(pool.map(loop, range(LOOPS)))


async def first_token_s(http: httpx.AsyncClient, model: str) -> tuple[float, float, float]:
    """(start, time to the first token, end) of one streamed request of the victim's."""
    start = time.monotonic()
    first = None
    async with http.stream("POST", "/v1/chat/completions", json=chat_body(model, stream=True)) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if first is None and '"content"' in line:
                first = time.monotonic() - start
    assert first is not None
    return start, first, time.monotonic()


@dataclass
class Pairs:
    idle: list[float] = field(default_factory=list)  # the victim's time to first token, no attack on
    attacked: list[tuple[float, float, float]] = field(default_factory=list)  # (start, ttft, end), attack on
    attacks: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of every attacker request

    def inside(self) -> int:
        """How many attacked victim requests started and ended within one attacker request: the victim was
        served while the attacker's slow request was still in progress, not after it."""
        return sum(1 for s, _, e in self.attacked if any(a <= s and e <= b for a, b in self.attacks))


async def measure_pairs(victim: httpx.AsyncClient, attacker: httpx.AsyncClient, model: str, attack: str,
                        pairs: int, poll_s: float = 0.02, answer_timeout_s: float = 120.0) -> Pairs:
    """Run ``pairs`` pairs (module docstring); every wait is on an event of the attack, none on a clock."""
    for _ in range(3):  # warm: the worker's first requests pay for what is made on first use
        await first_token_s(victim, model)
    ctx = multiprocessing.get_context("spawn")
    on, stop, spans, in_flight = ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Value("i", 0)
    secret = attacker.headers["authorization"].removeprefix("Bearer ")
    child = ctx.Process(target=attacker_process,
                        args=(str(attacker.base_url), secret, model, attack, on, stop, spans, in_flight))
    child.start()
    out = Pairs()

    async def until(holds, what: str) -> None:
        """Poll ``holds()``; a loop that stopped (its request failed: the child's log says how) or an attack that
        never gets there fails the test instead of hanging it."""
        deadline = time.monotonic() + answer_timeout_s
        while not holds():
            assert child.is_alive(), f"the attacker process exited ({child.exitcode}) while waiting for {what}"
            assert time.monotonic() < deadline, f"{what}: not within {answer_timeout_s} s (in flight: " \
                                                f"{in_flight.value} of {LOOPS})"
            await asyncio.sleep(poll_s)

    try:
        for _ in range(pairs):
            on.set()
            began = time.monotonic()
            await until(lambda: in_flight.value >= LOOPS, "every attacker loop sending")
            # One answered since the attack began (not a late one of the last pair): the attacker's work is
            # reaching the worker, and its loops keep it supplied.
            while True:
                span = await asyncio.to_thread(spans.get, True, answer_timeout_s)
                out.attacks.append(span)
                if span[1] > began:
                    break
            await until(lambda: in_flight.value >= LOOPS - 1, "the attacker loops sending again")
            out.attacked.append(await first_token_s(victim, model))
            on.clear()
            # Every attacker request answered: the worker is the victim's alone.
            await until(lambda: not in_flight.value, "every attacker request answered")
            out.idle.append((await first_token_s(victim, model))[1])
    finally:
        on.set()
        stop.set()
        await asyncio.to_thread(child.join, 120)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0, child.exitcode
    while True:  # the child has exited: every span it put is here
        try:
            out.attacks.append(spans.get(timeout=1))
        except queue.Empty:
            break
    return out
