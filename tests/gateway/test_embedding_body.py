"""The embeddings body at the edge, without servers: each form of ``input`` reaches the worker as texts or token ids
in order, OpenAI's bounds are refused naming ``input``, and both encodings carry the worker's float32 bytes."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from pydantic import ValidationError

from switchyard.domain.api.embeddings import MAX_INPUTS, EmbeddingRequest
from switchyard.gateway.embeddings import embedding_json
from switchyard.shared.messages import EmbedInput


@pytest.mark.parametrize("value, wire", [
    ("hello", EmbedInput(texts=["hello"])),
    (["a", "b"], EmbedInput(texts=["a", "b"])),
    ([1, 2, 3], EmbedInput(token_ids=[[1, 2, 3]])),
    ([[1, 2], [3]], EmbedInput(token_ids=[[1, 2], [3]])),
])
def test_each_input_form_reaches_the_worker_in_order(value, wire):
    assert EmbeddingRequest(model="m", input=value).wire() == wire


def test_dimensions_travel_to_the_worker_which_decides():
    assert EmbeddingRequest(model="m", input="x", dimensions=64).wire().dimensions == 64


@pytest.mark.parametrize("value", ["", [], [""], ["ok", ""], [[]], [[1, -1]], [[2**31]], ["x"] * (MAX_INPUTS + 1)])
def test_out_of_bounds_inputs_are_refused_naming_input(value):
    with pytest.raises(ValidationError) as exc:
        EmbeddingRequest(model="m", input=value)
    (error,) = exc.value.errors()
    assert error["type"] == "unsupported_parameter" and error["ctx"]["param"] == "input"


@pytest.mark.parametrize("field", [{"encoding_format": "hex"}, {"dimensions": 0}, {"stream": True}])
def test_unknown_encodings_bad_dimensions_and_unknown_fields_are_refused(field):
    with pytest.raises(ValidationError):
        EmbeddingRequest(model="m", input="x", **field)


def test_base64_and_float_carry_the_same_float32_bytes():
    vector = np.array([0.5, -1.25, 3.0e-8, 1.0], dtype="<f4")
    as_float = embedding_json(3, vector.tobytes(), "float")
    as_base64 = embedding_json(3, vector.tobytes(), "base64")
    assert as_float["index"] == as_base64["index"] == 3
    assert as_float["embedding"] == vector.tolist()
    assert np.array_equal(np.frombuffer(base64.b64decode(as_base64["embedding"]), dtype="<f4"), vector)
