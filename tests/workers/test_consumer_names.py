"""The consumer names a worker remembers (workers/service/consumer_names.py): kept while used, forgotten once
unused as long as JetStream keeps an idle consumer, so a worker holds nothing of tenants long gone."""

from __future__ import annotations

from switchyard.workers.service.consumer_names import ConsumerNames


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_name_used_within_the_window_is_kept_and_one_unused_past_it_is_forgotten():
    clock = Clock()
    names = ConsumerNames(idle_s=600, clock=clock)
    names.put(("pro", "a"), ("REQUESTS_PRO", "req-m-pro-a"))
    names.put(("pro", "b"), ("REQUESTS_PRO", "req-m-pro-b"))
    clock.now = 500
    assert names.get(("pro", "a")) == ("REQUESTS_PRO", "req-m-pro-a")  # used: its window starts again
    clock.now = 700  # b unused for 700 s: the server deleted it; a was used 200 s ago
    assert names.get(("pro", "b")) is None and len(names) == 1
    clock.now = 1099
    assert names.get(("pro", "a")) is not None
    clock.now = 10_000  # every tenant gone for hours: nothing held
    assert names.get(("pro", "a")) is None and len(names) == 0


def test_a_name_found_gone_is_made_again():
    names = ConsumerNames(idle_s=600, clock=Clock())
    names.put(("pro", "a"), ("REQUESTS_PRO", "req-m-pro-a"))
    names.pop(("pro", "a"))
    names.pop(("pro", "never"))
    assert names.get(("pro", "a")) is None and len(names) == 0
