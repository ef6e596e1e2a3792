"""Pydantic models of the OpenAI request bodies we accept, and their translation to wire messages.

Every parameter of OpenAI's chat and legacy completions requests is either honoured or refused with a 400 naming
it (README, "Parameters"); a parameter OpenAI does not have is refused as an unrecognized argument, as OpenAI
does. vLLM's common extensions are honoured too (top_k, min_p, repetition_penalty, ignore_eos). Messages are more
lenient: fields a client copies back from an earlier response (``refusal``, ``annotations``) are accepted.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from switchyard.shared.messages import (ChatMessage, ResponseFormat, SamplingParams, ToolCall, ToolSpec, ToolUse)

MAX_STOP_SEQUENCES = 4
MAX_N = 16  # choices per prompt (best_of included), as the worker allows
MAX_PROMPTS = 16  # prompts in one legacy completions request
MAX_TOOLS = 128
MAX_LOGIT_BIAS = 300
INT32_MAX = 2**31 - 1  # counts (tokens, top_k): beyond any context, and within what every layer below carries
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # OpenAI's seed is a signed 64-bit integer
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def _check_name(name: str) -> str:
    """A function's or schema's name, as OpenAI allows them."""
    if not _NAME.match(name):
        raise ValueError("a name has 1 to 64 letters, digits, underscores and dashes")
    return name


Name = Annotated[str, AfterValidator(_check_name)]


def unsupported(param: str, why: str) -> PydanticCustomError:
    """A refusal of ``param`` (errors.py turns it into a 400 with code unsupported_parameter and this param)."""
    return PydanticCustomError("unsupported_parameter", "{why}", {"param": param, "why": why})


class _Strict(BaseModel):
    # Unknown fields are refused (as OpenAI does: "Unrecognized request argument supplied"), never ignored.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    # OpenAI's default is true, but only for what asks: an "obfuscation" field of random length on each chunk, so
    # the length of the encrypted stream does not tell the length of its tokens.
    include_obfuscation: bool = False


class FunctionDefinition(_Strict):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # decoding is always constrained to the schema: strict or not, calls validate



class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(_Strict):
    name: Name
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None



class ResponseFormatIn(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormatIn":
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


class _SamplingFields(_Strict):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # The end user, for abuse tracking: kept with the request's usage record (requests.end_user).
    user: str | None = Field(None, max_length=256)
    # vLLM-style extensions
    top_k: int = Field(0, ge=0, le=INT32_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens may be biased")
        for token, bias in v.items():
            if not token.isdigit() or int(token) > INT32_MAX:
                raise ValueError(f"keys are token ids (non-negative integers), got {token!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases are between -100 and 100, got {bias}")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise unsupported("stream_options", "stream_options is only allowed when stream is true.")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def end_user(self) -> str | None:
        return self.user

    @property
    def include_obfuscation(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_obfuscation)

    def _sampling(self, max_tokens: int | None, logprobs: bool, top_logprobs: int, n: int | None = None,
                  echo: bool = False) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=list(self.stop or []),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            n=n or self.n,
            logit_bias={int(t): b for t, b in self.logit_bias.items()} if self.logit_bias else None,
            echo=echo,
        )


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
    def _tool_fields_where_they_belong(self) -> "ChatMessageIn":
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


SERVICE_TIERS = ("auto", "default", "flex", "priority")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormatIn | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Which tier runs it (gateway/service_tiers.py); the response says which did.
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    # Kept with the request's usage record (requests.metadata), as OpenAI keeps it with a stored completion.
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = Field(None, max_length=256)  # OpenAI's newer name for `user`
    # Refused by name: what this platform cannot do (see _refuse_unsupported).
    store: bool | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict | None = None
    functions: list | None = None
    function_call: Any = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None

    @model_validator(mode="after")
    def _checks(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.metadata is not None:
            if len(self.metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in self.metadata.items()):
                raise unsupported("metadata", "metadata holds at most 16 pairs, keys of at most 64 characters "
                                              "and values of at most 512.")
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
        for param, why in refused.items():
            if getattr(self, param) is not None:
                raise unsupported(param, why)

    @property
    def end_user(self) -> str | None:
        return self.safety_identifier or self.user

    def wire_messages(self) -> list[ChatMessage]:
        return [m.wire() for m in self.messages]

    def tool_use(self) -> ToolUse | None:
        if not self.tools:
            return None
        choice, function = self.tool_choice or "auto", None
        if isinstance(choice, NamedToolChoice):
            choice, function = "function", choice.function.name
        specs = [ToolSpec(t.function.name, t.function.description or "", t.function.parameters or {},
                          bool(t.function.strict)) for t in self.tools]
        return ToolUse(specs, choice, function, parallel=self.parallel_tool_calls is not False)

    def sampling(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens
        return self._sampling(max_tokens, self.logprobs, self.top_logprobs or 0)

    def wire_fields(self) -> dict:
        """Everything of a wire ``GenerateRequest`` that comes from the body."""
        return {"messages": self.wire_messages(), "sampling": self.sampling(),
                "response_format": self.response_format.wire() if self.response_format else None,
                "tool_use": self.tool_use()}

    def num_chars(self) -> int:
        return sum(len(m.text()) for m in self.messages)

    def routing_text(self) -> str:
        """What ``auto`` routing judges the request by: the last user message (the ask; the history is context)."""
        return next((m.text() for m in reversed(self.messages) if m.role == "user"), "")


Prompt = str | list[int]


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        prompts = [v] if isinstance(v, str) or (isinstance(v, list) and v and isinstance(v[0], int)) else v
        if not prompts:
            raise ValueError("at least one prompt is required")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        for p in prompts:
            if isinstance(p, list) and any(t < 0 or t > INT32_MAX for t in p):
                raise ValueError("token ids are non-negative integers")
        return v

    @model_validator(mode="after")
    def _checks(self) -> "CompletionRequest":
        if self.suffix:  # an empty suffix asks for nothing
            raise unsupported("suffix", "suffix is not supported: the models served here have no fill-in-the-"
                                        "middle mode.")
        if self.best_of is not None and self.best_of < self.n:
            raise unsupported("best_of", f"best_of must be at least n ({self.n}).")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise unsupported("best_of", "best_of greater than n cannot be streamed.")
        if self.echo and self.logprobs is not None:
            raise unsupported("echo", "echo with logprobs (the prompt's own logprobs) is not supported.")
        return self

    @property
    def prompts(self) -> list[Prompt]:
        v = self.prompt
        return [v] if isinstance(v, str) or (v and isinstance(v[0], int)) else list(v)

    @property
    def num_generated(self) -> int:
        """Choices generated per prompt: best_of, of which the best n are returned."""
        return self.best_of or self.n

    def sampling(self) -> SamplingParams:
        # The legacy completions API defaults max_tokens to 16. With best_of the choices are ranked by their
        # log-probability, so the worker reports it for every token.
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        ranked = self.num_generated > self.n
        return self._sampling(max_tokens, self.logprobs is not None or ranked, self.logprobs or 0,
                              n=self.num_generated, echo=self.echo)

    def wire_fields(self, prompt: Prompt) -> dict:
        """The wire fields of the request for one of the prompts."""
        text = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)}
        return {**text, "sampling": self.sampling()}

    def num_chars(self) -> int:
        # A token id is about four characters (limits.estimate_tokens divides by four).
        return sum(len(p) if isinstance(p, str) else 4 * len(p) for p in self.prompts)

    def routing_text(self) -> str:
        return "\n".join(p for p in self.prompts if isinstance(p, str))
