"""Tier changes refused before anything is written (domain/tier_admin.py): the pausing quantum's bad values, from
the CLI (``tiers set --pause-after-tokens``) and the admin API alike."""

from __future__ import annotations

import msgspec
import pytest
from pydantic import ValidationError

from switchyard.domain.tier_admin import MAX_PAUSE_AFTER_TOKENS, TierChangeError, change_tier
from switchyard.gateway.routes.admin import TierUpdate
from switchyard.shared.messages import decode, encode
from switchyard.shared.tiers import DEFAULT_POLICIES, TierPolicy


class _Untouched:
    """Stands for JetStream and Postgres: a refused change must not reach either."""

    def __getattr__(self, name):
        raise AssertionError(f"a refused change touched {name}")


@pytest.mark.parametrize(("tier", "value", "message"), [
    ("pro", -1, "0 \\(off\\) or a number of tokens"),
    ("pro", MAX_PAUSE_AFTER_TOKENS + 1, "up to 1,000,000"),
    ("pro", 2.5, "whole number of tokens"),
    ("pro", "256", "whole number of tokens"),
    ("pro", True, "whole number of tokens"),
    ("batch", 64, "batch tier is never paused"),
])
async def test_bad_pause_after_tokens_are_refused_with_the_reason(tier, value, message):
    with pytest.raises(TierChangeError, match=message):
        await change_tier(_Untouched(), _Untouched(), tier, "ops", pause_after_tokens=value)


def test_the_admin_api_refuses_a_negative_quantum_and_takes_zero_for_off():
    with pytest.raises(ValidationError):
        TierUpdate(pause_after_tokens=-5)
    assert TierUpdate(pause_after_tokens=0).pause_after_tokens == 0
    assert TierUpdate().model_dump()["pause_after_tokens"] is None  # not given: unchanged


def test_the_quantum_defaults_and_reads_back_from_a_policy_written_before_it_existed():
    assert DEFAULT_POLICIES["pro"].pause_after_tokens == 256 and DEFAULT_POLICIES["free"].pause_after_tokens == 256
    assert DEFAULT_POLICIES["enterprise"].pause_after_tokens == 0 and DEFAULT_POLICIES["batch"].pause_after_tokens == 0
    old = msgspec.structs.asdict(DEFAULT_POLICIES["pro"])
    del old["pause_after_tokens"]
    assert decode(msgspec.msgpack.encode(old), TierPolicy).pause_after_tokens == 0  # an older bucket: off
    policy = msgspec.structs.replace(DEFAULT_POLICIES["pro"], pause_after_tokens=64)
    assert decode(encode(policy), TierPolicy) == policy
    assert policy.describe_pausing() == "after 64 tokens" and DEFAULT_POLICIES["batch"].describe_pausing() == "off"


def test_tiers_set_takes_the_quantum_as_a_whole_number(capsys):
    from switchyard.cli.main import build_parser

    args = build_parser().parse_args(["tiers", "set", "pro", "--pause-after-tokens", "64"])
    assert args.pause_after_tokens == 64 and args.hedge_after_ms is None
    assert build_parser().parse_args(["tiers", "set", "pro"]).pause_after_tokens is None  # unchanged
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tiers", "set", "pro", "--pause-after-tokens", "lots"])
    assert "--pause-after-tokens: invalid int value: 'lots'" in capsys.readouterr().err
