"""OpenAI's Responses API request body (``POST /v1/responses``) and its translation to a chat turn on the wire: a
response runs on a worker exactly as a chat completion does (same queues, tiers, limits, billing), its ``input``
items and ``instructions`` becoming the messages (domain/api/response_items.py).

Every parameter is honoured or refused with a 400 naming it; one OpenAI does not have is an unrecognized argument.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, model_validator

from switchyard.domain.api.chat import FunctionDefinition, FunctionName
from switchyard.domain.api.fields import (
    INT32_MAX,
    MAX_TOOLS,
    Name,
    Strict,
    check_metadata,
    refuse_given,
    unsupported,
    validated,
)
from switchyard.domain.api.response_items import item_text, parse_input
from switchyard.domain.api.text import StoredText
from switchyard.shared.messages import ResponseFormat, SamplingParams, ToolSpec, ToolUse


class FunctionTool(FunctionDefinition):
    """A function tool as the Responses API writes it: chat's ``function`` fields beside ``type``, not in it."""

    type: Literal["function"]


class FunctionChoice(FunctionName):
    type: Literal["function"]


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Name | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if (self.type == "json_schema") != (self.schema_ is not None and self.name is not None):
            raise ValueError("name and schema are required with type json_schema, and only with it")
        return self

    def wire(self) -> ResponseFormat | None:
        if self.type == "text":
            return None
        return ResponseFormat(self.type, self.schema_, name=self.name or "", strict=bool(self.strict))


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ConversationRef(BaseModel):
    id: str


class Reasoning(Strict):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponseCreate(Strict):
    model: str | None = Field(None, min_length=1)  # None: the previous response's or the conversation's
    input: str | list[Any] = Field(min_length=1)
    instructions: StoredText | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    user: StoredText | None = Field(None, max_length=256)
    safety_identifier: StoredText | None = Field(None, max_length=256)
    metadata: dict[StoredText, StoredText] | None = None
    stream: bool = False
    store: bool = True  # as OpenAI's: kept, so a later request can name it as previous_response_id
    previous_response_id: str | None = None
    conversation: str | ConversationRef | None = None
    background: bool = False
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: Reasoning | None = None
    # Refused by name (see _refuse_unsupported).
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    stream_options: dict[str, Any] | None = None
    # Parsed once, by the validator below.
    _items: list[dict[str, Any]] = PrivateAttr(default_factory=list)
    _tools: list[FunctionTool] = PrivateAttr(default_factory=list)
    _choice: tuple[str, str | None] = PrivateAttr(("auto", None))

    @model_validator(mode="after")
    def _checks(self) -> ResponseCreate:
        self._items = parse_input(self.input)
        self._tools = [self._function_tool(i, t) for i, t in enumerate(self.tools or ())]
        names = [t.name for t in self._tools]
        if len(set(names)) != len(names):
            raise unsupported("tools", "Each tool needs a name of its own.")
        self._choice = self._tool_choice(names)
        if self.parallel_tool_calls is not None and not names:
            raise unsupported("parallel_tool_calls", "parallel_tool_calls is only allowed with tools.")
        check_metadata(self.metadata)
        if self.previous_response_id is not None and self.conversation is not None:
            raise unsupported("previous_response_id", "previous_response_id and conversation cannot both be given.")
        if self.background and not self.store:
            raise unsupported("background", "A background response is stored to be polled: it needs store=true.")
        if self.background and self.stream:
            raise unsupported("stream", "A background response is polled (GET /v1/responses/{id}), not streamed.")
        self._refuse_unsupported()
        return self

    @staticmethod
    def _function_tool(i: int, tool: dict[str, Any]) -> FunctionTool:
        kind = tool.get("type")
        if kind != "function":
            raise unsupported(f"tools[{i}].type", f"Tools of type {kind!r} are not supported: only function tools.")
        return validated(FunctionTool, tool, f"tools[{i}]")

    def _tool_choice(self, names: list[str]) -> tuple[str, str | None]:
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function":
                raise unsupported("tool_choice", f"tool_choice of type {choice.get('type')!r} is not supported: use "
                                                 "none, auto, required or a function.")
            name = validated(FunctionChoice, choice, "tool_choice").name
            if name not in names:
                raise unsupported("tool_choice", f"tool_choice names the function '{name}', which is not among the "
                                                 "tools.")
            return "function", name
        if choice == "required" and not names:
            raise unsupported("tool_choice", "tool_choice 'required' needs tools.")
        return choice or "auto", None

    def _refuse_unsupported(self) -> None:
        if self.include:
            raise unsupported("include", f"include {self.include[0]!r} is not supported: nothing more can be included.")
        if self.text is not None and self.text.verbosity is not None:
            raise unsupported("text.verbosity", "text.verbosity is not supported.")
        if self.reasoning is not None and (self.reasoning.effort not in (None, "none") or self.reasoning.summary
                                           or self.reasoning.generate_summary):
            raise unsupported("reasoning", "The models served here do not reason in hidden tokens; only reasoning "
                                           "effort 'none' is supported.")
        refused = {
            "top_logprobs": "top_logprobs is not supported on /v1/responses (chat completions has logprobs).",
            "max_tool_calls": "max_tool_calls is not supported.",
            "prompt": "Stored prompt templates are not supported.",
            "prompt_cache_key": "prompt_cache_key is not supported: prompts are cached automatically.",
            "prompt_cache_retention": "prompt_cache_retention is not supported.",
            "stream_options": "stream_options is not supported on /v1/responses.",
        }
        refuse_given(self, refused)

    # -- what the request asks for ---------------------------------------------------------------------------
    @property
    def items(self) -> list[dict[str, Any]]:
        """``input`` as stored items, each with an id."""
        return self._items

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation

    @property
    def end_user(self) -> str | None:
        return self.safety_identifier or self.user

    @property
    def num_choices(self) -> int:
        return 1

    def num_chars(self) -> int:
        return len(self.instructions or "") + sum(len(item_text(i)) for i in self._items)

    def screened_texts(self) -> tuple[list[str], str]:
        """What the input filter judges: the new input and the instructions (a stored history was judged when it
        was new)."""
        return [item_text(i) for i in self._items] + ([self.instructions] if self.instructions else []), "input"

    def routing_text(self) -> str:
        return next((item_text(i) for i in reversed(self._items)
                     if i["type"] == "message" and i["role"] == "user"), "")

    def tool_use(self) -> ToolUse | None:
        if not self._tools:
            return None
        choice, function = self._choice
        specs = [ToolSpec(t.name, t.description or "", t.parameters or {}, bool(t.strict)) for t in self._tools]
        return ToolUse(specs, choice, function, parallel=self.parallel_tool_calls is not False)

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_output_tokens,
                              temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p)

    def response_format(self) -> ResponseFormat | None:
        return self.text.format.wire() if self.text is not None and self.text.format is not None else None

    def echo(self) -> dict[str, Any]:
        """The request's settings as a response object repeats them."""
        fmt = self.text.format.model_dump(by_alias=True, exclude_none=True) if self.text and self.text.format \
            else {"type": "text"}
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p,
                "tools": [{**t.model_dump(), "strict": bool(t.strict)} for t in self._tools],
                "tool_choice": choice, "parallel_tool_calls": self.parallel_tool_calls is not False,
                "text": {"format": fmt}, "metadata": self.metadata or {}, "store": self.store,
                "background": self.background, "previous_response_id": self.previous_response_id,
                "conversation": {"id": self.conversation_id} if self.conversation is not None else None,
                "truncation": self.truncation or "disabled", "user": self.user,
                "safety_identifier": self.safety_identifier, "reasoning": {"effort": None, "summary": None}}
