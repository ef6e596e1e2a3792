"""Several models behind one endpoint: aliases, ``model: "auto"`` routed by the operator's rules to the model that
serves (and bills) the request, and a configured model with no worker answering 503, an unknown one 404."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import asyncpg
import openai
import pytest
from openai import OpenAI

from switchyard.deploy.services import wait_until_ready
from switchyard.deploy.system import LocalSystem
from switchyard.jobs.prices import apply_prices
from switchyard.shared.config import GatewayConfig, ModelEntry, RouteRule
from tests.support.system import free_port, poll

EASY = "hi there!"
HARD = ("Explain step by step why this sort is O(n log n), prove it, and compare the trade-offs of two other "
        "designs:\n```python\ndef f(xs):\n    return sorted(xs)\n```")
CATALOG = [ModelEntry(model="tiny", served_model_name="tiny-small", aliases=["fast"], input_per_mtok=1.0,
                      output_per_mtok=2.0),
           ModelEntry(model="tiny", served_model_name="tiny-large", input_per_mtok=10.0, output_per_mtok=20.0),
           ModelEntry(model="tiny", served_model_name="tiny-absent")]
ROUTES = [RouteRule(model="fast", max_difficulty=0.4), RouteRule(model="tiny-large")]


@pytest.fixture(scope="module")
def routed(e2e, database_url):
    """Two tiny workers, and a gateway of their own knowing the catalog and the routes; its base URL."""
    import asyncio

    workers = [e2e.start_worker("tiny-small", max_num_seqs=2, aliases=["fast"]),
               e2e.start_worker("tiny-large", max_num_seqs=2)]
    asyncio.run(apply_prices(database_url, CATALOG))
    work = Path(tempfile.mkdtemp(prefix="switchyard-models-"))
    config = e2e.config.model_copy(update={
        "data_dir": work, "models": CATALOG,
        "gateway": GatewayConfig(port=free_port(), run_jobs=False, queue_timeout_s=20, routes=ROUTES)})
    try:
        with LocalSystem(config, log_dir=work, log_level="WARNING") as system:
            system.start_gateway()
            for name in ("tiny-small", "tiny-large"):
                wait_until_ready(system.url(), name, timeout_s=120, watch=[*system.services, *workers])
            yield system.url()
    finally:
        for worker in workers:
            worker.stop()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def client(routed, api_key):
    with OpenAI(base_url=f"{routed}/v1", api_key=api_key, max_retries=0, timeout=60) as c:
        yield c


def ask(client: OpenAI, model: str, text: str):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                          max_completion_tokens=3)


async def test_auto_routes_by_difficulty_and_bills_the_model_that_served(client, database_url):
    easy, hard, aliased = ask(client, "auto", EASY), ask(client, "auto", HARD), ask(client, "fast", HARD)
    assert (easy.model, hard.model, aliased.model) == ("tiny-small", "tiny-large", "tiny-small")
    conn = await asyncpg.connect(database_url)
    try:
        for response, (input_price, output_price) in ((easy, (1.0, 2.0)), (hard, (10.0, 20.0))):
            row = await poll(lambda: conn.fetchrow("SELECT * FROM requests WHERE request_id = $1",
                                                   response.id.removeprefix("chatcmpl-")),
                             lambda r: r is not None, timeout_s=30, what="the usage row")
            assert row["model"] == response.model
            expected = (row["prompt_tokens"] * input_price + row["completion_tokens"] * output_price) / 1e6
            assert float(row["cost_usd"]) == pytest.approx(expected)
    finally:
        await conn.close()


def test_a_configured_model_without_a_worker_is_503_and_an_unknown_one_404(client):
    with pytest.raises(openai.InternalServerError) as absent:
        ask(client, "tiny-absent", EASY)
    assert absent.value.status_code == 503 and absent.value.body["code"] == "model_unavailable"
    with pytest.raises(openai.NotFoundError):
        ask(client, "no-such-model", EASY)


def test_models_lists_the_live_models_their_aliases_and_the_router(client):
    listed = {m.id: m for m in client.models.list().data}
    assert listed["tiny-small"].model_extra["aliases"] == ["fast"]
    assert listed["tiny-large"].model_extra["max_model_len"] > 0
    assert listed["auto"].model_extra["routes_to"] == ["fast", "tiny-large"]
    assert "tiny-absent" not in listed


def test_responses_take_aliases_and_auto_like_chat(client):
    def respond(model: str, text: str) -> str:
        return client.responses.create(model=model, input=text, max_output_tokens=3).model

    assert (respond("auto", EASY), respond("auto", HARD), respond("fast", HARD)) == (
        "tiny-small", "tiny-large", "tiny-small")
