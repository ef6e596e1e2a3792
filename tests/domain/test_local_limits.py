"""The limiter a gateway falls back on while Postgres is away: its share of each key's limits, over a sliding
window (no burst of twice the limit across a minute boundary)."""

from __future__ import annotations

from switchyard.domain.local_limits import WINDOW_S, LocalLimiter


def test_each_gateway_enforces_its_share_of_the_requests_and_tokens_per_minute():
    limiter = LocalLimiter(share=1 / 3)
    admitted = [limiter.admit("k", rpm=30, tpm=10_000, tokens=10, now=float(i)) is None for i in range(12)]
    assert admitted == [True] * 10 + [False] * 2  # a third of 30 requests a minute
    assert limiter.admit("other", rpm=30, tpm=300, tokens=101, now=0.0) is not None  # a third of 300 tokens
    assert limiter.admit("other", rpm=30, tpm=300, tokens=100, now=0.0) is None


def test_the_window_slides_and_refusals_say_when_to_come_back():
    limiter = LocalLimiter()
    assert limiter.admit("k", rpm=2, tpm=100, tokens=1, now=0.0) is None
    assert limiter.admit("k", rpm=2, tpm=100, tokens=1, now=50.0) is None
    wait = limiter.admit("k", rpm=2, tpm=100, tokens=1, now=59.0)
    assert wait is not None and abs(wait - 1.0) < 1e-9  # the first request leaves the window at 60 s
    assert limiter.admit("k", rpm=2, tpm=100, tokens=1, now=WINDOW_S + 0.5) is None
    assert limiter.admit("k", rpm=2, tpm=100, tokens=1, now=WINDOW_S + 1.0) is not None  # 50 s is still in


def test_settling_gives_back_the_unused_reservation():
    limiter = LocalLimiter()
    assert limiter.admit("k", rpm=10, tpm=100, tokens=80, now=0.0) is None
    assert limiter.admit("k", rpm=10, tpm=100, tokens=30, now=1.0) is not None
    limiter.settle("k", reserved=80, used=20)
    assert limiter.admit("k", rpm=10, tpm=100, tokens=30, now=2.0) is None
