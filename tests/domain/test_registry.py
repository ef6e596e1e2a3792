"""The registry of served models: a worker whose heartbeat entry is gone but whose pings still come stays listed
(a cluster electing the bucket's leader expires entries nobody could refresh); one silent too is gone."""

from __future__ import annotations

import pytest

from switchyard.domain import registry as registry_module
from switchyard.domain.errors import OpenAIError
from switchyard.domain.registry import ModelRegistry
from switchyard.shared.messages import WorkerInfo


class FakeNats:
    is_connected = True

    def jetstream(self):
        return None


@pytest.fixture
def listing(monkeypatch):
    """What the heartbeat bucket holds now: set it, and the registry's next fresh read sees it."""
    entries: list[WorkerInfo] = []

    async def live_workers(_js):
        return list(entries)

    monkeypatch.setattr(registry_module, "live_workers", live_workers)
    return entries


def worker(worker_id: str, model: str = "m") -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, model=model, max_context=64, started_at=0.0)


async def test_a_worker_gone_from_the_bucket_but_pinging_stays_listed_until_it_falls_silent(listing):
    silent: set[str] = set()
    registry = ModelRegistry(FakeNats(), is_dead=silent.__contains__)
    listing[:] = [worker("a"), worker("b")]
    assert {w.worker_id for w in (await registry.models(fresh=True))["m"]} == {"a", "b"}

    listing[:] = [worker("b")]  # a's entry expired while its pings go on
    assert {w.worker_id for w in (await registry.models(fresh=True))["m"]} == {"a", "b"}
    listing[:] = []  # both entries expired (the bucket's leader lost): the model is still served
    assert {w.worker_id for w in (await registry.models(fresh=True))["m"]} == {"a", "b"}
    assert await registry.is_served("m")

    silent.add("a")
    assert [w.worker_id for w in (await registry.models(fresh=True))["m"]] == ["b"]
    silent.add("b")  # silent too: gone, and the model served a moment ago is a 503 to retry
    assert "m" not in await registry.models(fresh=True)
    with pytest.raises(OpenAIError) as caught:
        await registry.is_served("m")
    assert (caught.value.status, caught.value.code) == (503, "model_unavailable")

    silent.clear()  # a worker heard again but out of the listing since: not brought back from an older one
    assert "m" not in await registry.models(fresh=True)


async def test_without_pings_to_hear_a_worker_is_listed_exactly_while_its_entry_is(listing):
    registry = ModelRegistry(FakeNats())
    listing[:] = [worker("a")]
    assert "m" in await registry.models(fresh=True)
    listing[:] = []
    assert "m" not in await registry.models(fresh=True)
