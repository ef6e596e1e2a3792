"""OpenAI's chat completions request body (``POST /v1/chat/completions``, a batch line, a conversation turn) and
its translation to a wire request: messages, tools, response formats and the chat-only parameters.

Messages are lenient: fields a client copies back from an earlier response (``refusal``, ``annotations``) are
accepted. The sampling parameters are the ones every body shares (domain/api/fields.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from switchyard.domain.api.fields import (
    INT32_MAX,
    MAX_TOOLS,
    Name,
    SamplingFields,
    Strict,
    check_metadata,
    refuse_given,
    unsupported,
)
from switchyard.domain.api.text import StoredText
from switchyard.shared.messages import ChatMessage, ResponseFormat, SamplingParams, ToolCall, ToolSpec, ToolUse


class FunctionDefinition(Strict):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # decoding is always constrained to the schema: strict or not, calls validate



class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(Strict):
    name: Name
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None



class ResponseFormatIn(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormatIn:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only with it")
        return self

    def wire(self) -> ResponseFormat | None:
        if self.type == "text":
            return None
        if self.json_schema is None:
            return ResponseFormat(self.type)
        s = self.json_schema
        return ResponseFormat(self.type, s.schema_, name=s.name, strict=bool(s.strict))



class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCallIn(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessageIn(BaseModel):
    # Lenient on purpose: a client sends earlier assistant messages back as it got them, with response-only
    # fields (refusal, annotations, audio) that say nothing about what to generate next.
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields_where_they_belong(self) -> ChatMessageIn:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def wire(self) -> ChatMessage:
        # 'developer' is OpenAI's newer name for the system role; chat templates know only 'system'.
        calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or ()] or None
        return ChatMessage("system" if self.role == "developer" else self.role, self.text(), tool_calls=calls,
                           tool_call_id=self.tool_call_id, name=self.name)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormatIn | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Which tier runs it (domain/admission/service_tier.py); the response says which did.
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    # Kept with the request's usage record (requests.metadata), as OpenAI keeps it with a stored completion.
    metadata: dict[StoredText, StoredText] | None = None
    safety_identifier: StoredText | None = Field(None, max_length=256)  # OpenAI's newer name for `user`
    # Refused by name: what this platform cannot do (see _refuse_unsupported).
    store: bool | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        check_metadata(self.metadata)
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise unsupported("tools", "Each tool needs a name of its own.")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise unsupported("tool_choice", f"tool_choice names the function "
                                             f"'{self.tool_choice.function.name}', which is not among the tools.")
        if self.tool_choice in ("required",) and not names:
            raise unsupported("tool_choice", "tool_choice 'required' needs tools.")
        if self.parallel_tool_calls is not None and not names:
            raise unsupported("parallel_tool_calls", "parallel_tool_calls is only allowed with tools.")
        self._refuse_unsupported()
        return self

    def _refuse_unsupported(self) -> None:
        if self.store:
            raise unsupported("store", "Storing completions (store=true) is not supported; leave store unset or "
                                       "false.")
        if self.modalities is not None and self.modalities != ["text"]:
            raise unsupported("modalities", "Only the text modality is supported.")
        refused = {
            "audio": "Audio output is not supported.",
            "prediction": "Predicted outputs are not supported.",
            "reasoning_effort": "The models served here do not reason in hidden tokens; reasoning_effort is not "
                                "supported.",
            "verbosity": "verbosity is not supported.",
            "web_search_options": "Web search is not supported.",
            "functions": "functions is deprecated and not supported: use tools.",
            "function_call": "function_call is deprecated and not supported: use tool_choice.",
            "prompt_cache_key": "prompt_cache_key is not supported: prompts are cached automatically.",
            "prompt_cache_retention": "prompt_cache_retention is not supported.",
        }
        refuse_given(self, refused)

    @property
    def end_user(self) -> str | None:
        return self.safety_identifier or self.user

    def wire_messages(self) -> list[ChatMessage]:
        return [m.wire() for m in self.messages]

    def tool_use(self) -> ToolUse | None:
        if not self.tools:
            return None
        requested = self.tool_choice or "auto"
        if isinstance(requested, NamedToolChoice):
            choice, function = "function", requested.function.name
        else:
            choice, function = requested, None
        specs = [ToolSpec(t.function.name, t.function.description or "", t.function.parameters or {},
                          bool(t.function.strict)) for t in self.tools]
        return ToolUse(specs, choice, function, parallel=self.parallel_tool_calls is not False)

    @property
    def max_output_tokens(self) -> int | None:
        """The completion tokens asked for: ``max_completion_tokens``, OpenAI's newer name, wins over ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_choices(self) -> int:
        return self.n

    def sampling(self) -> SamplingParams:
        return self._sampling(self.max_output_tokens, self.logprobs, self.top_logprobs or 0)

    def wire_fields(self) -> dict[str, Any]:
        """Everything of a wire ``GenerateRequest`` that comes from the body."""
        return {"messages": self.wire_messages(), "sampling": self.sampling(),
                "response_format": self.response_format.wire() if self.response_format else None,
                "tool_use": self.tool_use()}

    def num_chars(self) -> int:
        return sum(len(m.text()) for m in self.messages)

    def screened_texts(self) -> tuple[list[str], str]:
        """What the input filter judges, and the parameter it came in: every message, since a client sends the
        whole history and may have written any of it, tool calls' arguments included."""
        texts = [m.text() for m in self.messages]
        texts += [c.function.arguments for m in self.messages for c in m.tool_calls or ()]
        return texts, "messages"

    def routing_text(self) -> str:
        """What ``auto`` routing judges the request by: the last user message (the ask; the history is context)."""
        return next((m.text() for m in reversed(self.messages) if m.role == "user"), "")
