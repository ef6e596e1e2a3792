"""What OpenAI's chat and legacy completions request bodies share: the sampling parameters, their ranges and the
refusal of a parameter by name, translated to the wire's ``SamplingParams``.

Every parameter of OpenAI's chat and legacy completions requests is either honoured or refused with a 400 naming
it (README, "Parameters"); a parameter OpenAI does not have is refused as an unrecognized argument, as OpenAI
does. vLLM's common extensions are honoured too (top_k, min_p, repetition_penalty, ignore_eos).

A body also tells admission what it asks for (domain/admission/ticket.py): ``num_chars``, ``max_output_tokens``,
``num_choices``, ``routing_text`` and ``screened_texts``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Self, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from switchyard.domain.api.text import StoredText, check_encodable
from switchyard.shared.messages import SamplingParams

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # in typing from Python 3.13

MAX_STOP_SEQUENCES = 4
MAX_N = 16  # choices per prompt (best_of included), as the worker allows
MAX_PROMPTS = 16  # prompts in one legacy completions request
MAX_TOOLS = 128
MAX_LOGIT_BIAS = 300
INT32_MAX = 2**31 - 1  # counts (tokens, top_k): beyond any context, and within what every layer below carries
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # OpenAI's seed is a signed 64-bit integer
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")

ModelT = TypeVar("ModelT", bound=BaseModel)
ItemT = TypeVar("ItemT")


def first_is(value: list[Any], kind: type[ItemT]) -> TypeIs[list[ItemT]]:
    """Whether a list a body gives in one of several shapes (texts, token ids, lists of token ids) is the one of
    ``kind``: pydantic has validated that its items are all alike, so the first one says."""
    return bool(value) and isinstance(value[0], kind)


def _check_name(name: str) -> str:
    """A function's or schema's name, as OpenAI allows them."""
    if not _NAME.match(name):
        raise ValueError("a name has 1 to 64 letters, digits, underscores and dashes")
    return name


Name = Annotated[str, AfterValidator(_check_name)]


def unsupported(param: str, why: str) -> PydanticCustomError:
    """A refusal of ``param`` (errors.py turns it into a 400 with code unsupported_parameter and this param)."""
    return PydanticCustomError("unsupported_parameter", "{why}", {"param": param, "why": why})


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's bounds on ``metadata``: at most 16 pairs, keys of at most 64 characters, values of at most 512."""
    if metadata is not None and (len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items())):
        raise unsupported("metadata", "metadata holds at most 16 pairs, keys of at most 64 characters and values of "
                                      "at most 512.")


def validated(model: type[ModelT], value: object, where: str) -> ModelT:
    """``value`` as ``model``, validated inside another body's validator: a mistake is refused naming ``where``
    (``tools[2].name``), not the nested model's own field alone."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise unsupported(f"{where}.{field}" if field else where, f"{where}: {first['msg']}") from None


def refuse_given(body: BaseModel, refused: dict[str, str]) -> None:
    """Refuse the first parameter of ``refused`` (name → why) that ``body`` sets."""
    for param, why in refused.items():
        if getattr(body, param) is not None:
            raise unsupported(param, why)


class Strict(BaseModel):
    # Unknown fields are refused (as OpenAI does: "Unrecognized request argument supplied"), never ignored.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(Strict):
    include_usage: bool = False
    # OpenAI's default is true, but only for what asks: an "obfuscation" field of random length on each chunk, so
    # the length of the encrypted stream does not tell the length of its tokens.
    include_obfuscation: bool = False



class SamplingFields(Strict):
    model: StoredText = Field(min_length=1)
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
    user: StoredText | None = Field(None, max_length=256)
    # vLLM-style extensions
    top_k: int = Field(0, ge=0, le=INT32_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    ignore_eos: bool = False

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: Any) -> Any:
        # Before any field: a lone surrogate anywhere would fail msgpack (NATS) and Postgres alike (api/text.py).
        return check_encodable(data)

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
    def _stream_options_need_stream(self) -> Self:
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
