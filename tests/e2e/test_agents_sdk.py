"""OpenAI's Agents SDK against ``switchyard up`` (what ``make up`` runs) as a new user would run it: its default model
class (``OpenAIResponsesModel``, over ``POST /v1/responses``) drives an agent with a function tool on SmolLM2, and
the default install's embedding model answers ``client.embeddings.create``.

SmolLM2-135M is weak at deciding to call a tool on its own, so the agent's model settings force the first call
(``tool_choice`` naming the function); the SDK resets the choice after it (``reset_tool_choice``), so the second
turn answers freely from the tool's output. Everything else is the SDK's defaults.
"""

from __future__ import annotations

import pytest

from switchyard.workers.model_store import pull
from tests.support.system import model_cache_dir
from tests.support.up import running_up

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def up():
    """``switchyard up`` in a data dir of its own (embedded NATS and Postgres), serving SmolLM2 and the default
    embedding model from the test model cache; yields (base URL, API key)."""
    cache = model_cache_dir()
    chat, embed = pull("smollm2", cache), pull("all-minilm-l6-v2", cache)
    with running_up(["--model", f"smollm2={chat}", "--embedding-model", str(embed), "--max-num-seqs", "4"],
                    ["smollm2", "all-minilm-l6-v2"]) as system:
        yield system.base_url, system.api_key


def _agent(base: str, key: str, calls: list[str], stream: bool = False):
    from agents import Agent, ModelSettings, function_tool, set_default_openai_client, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    set_default_openai_client(AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0), use_for_tracing=False)

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 degrees Celsius in {city}."

    return Agent(name="weather", instructions="You answer questions about the weather using your tool.",
                 tools=[get_weather], model="smollm2",
                 model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=48))


async def test_an_agent_calls_its_tool_and_answers(up):
    from agents import Runner

    base, key = up
    calls: list[str] = []
    agent = _agent(base, key, calls)
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    assert calls, "the agent never called its tool"
    assert isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    # Both turns went over the Responses API (the SDK's default model class): each has a stored response's id.
    assert [r.response_id[:5] for r in result.raw_responses] == ["resp_", "resp_"]


async def test_a_streamed_agent_run(up):
    from agents import Runner

    base, key = up
    calls: list[str] = []
    result = Runner.run_streamed(_agent(base, key, calls), "Weather in Oslo?", max_turns=4)
    kinds = [event.type async for event in result.stream_events()]
    assert "raw_response_event" in kinds and calls
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_the_default_install_serves_embeddings(up):
    from openai import OpenAI

    base, key = up
    with OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0) as client:
        r = client.embeddings.create(model="all-minilm-l6-v2", input=["hello", "world"])
    assert [len(d.embedding) for d in r.data] == [384, 384]
