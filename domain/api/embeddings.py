"""OpenAI's embeddings request body (``POST /v1/embeddings``) and its wire form (``EmbedInput``): one vector per
input, computed by an embedding model's worker (workers/engine/embeddings.py).

``input`` is a string, a list of strings, a list of token ids, or a list of such lists (at most 2048 inputs, none
empty, as OpenAI allows); ``encoding_format`` float or base64; ``dimensions`` only where the model allows it (the
worker knows, and refuses the others). Nothing is generated, so a request reserves only its input's tokens.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from switchyard.domain.api.fields import INT32_MAX, Strict, first_is, unsupported
from switchyard.shared.messages import EmbedInput

MAX_INPUTS = 2048


class EmbeddingRequest(Strict):
    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=INT32_MAX)
    user: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _checks(self) -> EmbeddingRequest:
        inputs = self._inputs()
        if not inputs:
            raise unsupported("input", "input must not be empty.")
        if len(inputs) > MAX_INPUTS:
            raise unsupported("input", f"input holds at most {MAX_INPUTS} inputs, got {len(inputs)}.")
        for i, item in enumerate(inputs):
            if len(item) == 0:
                raise unsupported("input", f"input[{i}] is empty.")
            if isinstance(item, list) and any(not 0 <= t <= INT32_MAX for t in item):
                raise unsupported("input", f"input[{i}] holds a negative or too large token id.")
        return self

    def _inputs(self) -> list[str] | list[list[int]]:
        value = self.input
        if isinstance(value, str):
            return [value]
        if first_is(value, int):
            return [value]  # one input of token ids
        return value

    def wire(self) -> EmbedInput:
        inputs = self._inputs()
        if first_is(inputs, str):
            return EmbedInput(texts=list(inputs), dimensions=self.dimensions)
        return EmbedInput(token_ids=[list(i) for i in inputs], dimensions=self.dimensions)

    # -- what admission reads (domain/admission/ticket.py) ---------------------------------------------------
    @property
    def service_tier(self) -> None:
        return None  # embeddings have no service_tier: the tenant's tier runs them

    @property
    def max_output_tokens(self) -> int | None:
        return None

    @property
    def num_choices(self) -> int:
        return 0  # nothing generated: only the input's tokens are reserved

    @property
    def end_user(self) -> str | None:
        return self.user

    def num_chars(self) -> int:
        # Token ids count as the ~4 characters a token stands for in the estimate.
        return sum(len(i) if isinstance(i, str) else 4 * len(i) for i in self._inputs())

    def routing_text(self) -> str:
        return ""

    def screened_texts(self) -> tuple[list[str], str]:
        # Not judged: an embedding's input is a document to index, never an instruction to a model, and what
        # comes back is vectors, not text.
        return [], "input"
