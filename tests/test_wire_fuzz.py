"""Hypothesis on the wire decoders: whatever bytes arrive on a subject, decoding either gives the struct or raises
msgspec's DecodeError/ValidationError (which every consumer catches and terminates), never anything else."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.shared.messages import (
    BatchResult,
    GenerateRequest,
    RoutedDelta,
    TokenDelta,
    UsageRecord,
    WorkerInfo,
    decode,
    decode_routed,
)

WIRE_TYPES = [GenerateRequest, TokenDelta, UsageRecord, BatchResult, WorkerInfo]

# msgpack values of any shape: what a buggy or hostile publisher could put on a subject.
values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=30)


@pytest.mark.parametrize("struct", WIRE_TYPES, ids=lambda t: t.__name__)
@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=200) | values.map(lambda v: msgspec.msgpack.encode(v)))
def test_decoding_anything_gives_the_struct_or_a_decode_error(struct, data):
    try:
        decoded = decode(data, struct)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    assert isinstance(decoded, struct)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200) | values.map(lambda v: msgspec.msgpack.encode(v)))
def test_a_gateways_token_subject_decodes_anything_to_routed_deltas_or_a_decode_error(data):
    try:
        batch = decode_routed(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    assert all(isinstance(r, RoutedDelta) and isinstance(r.request_id, str) for r in batch)
    for routed in batch:  # each delta is decoded on its request's turn, with the same two errors caught there
        try:
            decode(routed.delta, TokenDelta)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
