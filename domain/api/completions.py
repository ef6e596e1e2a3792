"""OpenAI's legacy completions request body (``POST /v1/completions``, a batch line): one or several prompts, as
text or token ids, with ``echo`` and ``best_of``."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from switchyard.domain.api.fields import INT32_MAX, MAX_N, MAX_PROMPTS, SamplingFields, first_is, unsupported
from switchyard.shared.messages import SamplingParams

Prompt = str | list[int]
PromptField = str | list[str] | list[int] | list[list[int]]  # one prompt, or several; each text or token ids


class CompletionRequest(SamplingFields):
    service_tier: ClassVar[None] = None  # the legacy API has none: the tenant's tier runs it
    prompt: PromptField
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: PromptField) -> PromptField:
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
    def _checks(self) -> CompletionRequest:
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
        return [v] if isinstance(v, str) or first_is(v, int) else list(v)

    @property
    def num_generated(self) -> int:
        """Choices generated per prompt: best_of, of which the best n are returned."""
        return self.best_of or self.n

    @property
    def max_output_tokens(self) -> int:
        """The legacy completions API defaults max_tokens to 16."""
        return 16 if self.max_tokens is None else self.max_tokens

    @property
    def num_choices(self) -> int:
        """Every prompt's choices, best_of's included: what the request generates."""
        return self.num_generated * len(self.prompts)

    def sampling(self) -> SamplingParams:
        # With best_of the choices are ranked by their log-probability, so the worker reports it for every token.
        ranked = self.num_generated > self.n
        return self._sampling(self.max_output_tokens, self.logprobs is not None or ranked, self.logprobs or 0,
                              n=self.num_generated, echo=self.echo)

    def wire_fields(self, prompt: Prompt) -> dict[str, Any]:
        """The wire fields of the request for one of the prompts."""
        text = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)}
        return {**text, "sampling": self.sampling()}

    def num_chars(self) -> int:
        # A token id is about four characters (limits.estimate_tokens divides by four).
        return sum(len(p) if isinstance(p, str) else 4 * len(p) for p in self.prompts)

    def routing_text(self) -> str:
        return "\n".join(p for p in self.prompts if isinstance(p, str))

    def screened_texts(self) -> tuple[list[str], str]:
        """What the input filter judges: each prompt given as text (token ids cannot be read without a tokenizer)."""
        return [p for p in self.prompts if isinstance(p, str)], "prompt"
