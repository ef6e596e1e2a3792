"""The worker's pull order across tiers, without NATS: weighted shares, no saved credit, batch on idle."""

from __future__ import annotations

from collections import Counter

from switchyard.scheduler.tier_share import TierShare

PRIORITIES = {"enterprise": 0, "pro": 1, "free": 2, "batch": 3}
WEIGHTS = {"enterprise": 8.0, "pro": 4.0, "free": 1.0, "batch": 0.05}


def pull(share: TierShare, queued: dict[str, int], n: int) -> Counter:
    """Take ``n`` requests the way a worker does: first tier in ``order()`` that has work."""
    taken: Counter = Counter()
    for _ in range(n):
        for tier in share.order():
            if queued.get(tier, 0) > 0:
                queued[tier] -= 1
                share.charge(tier)
                taken[tier] += 1
                break
            share.note_empty(tier)
        else:
            share.note_idle()
    return taken


def test_highest_tier_first_when_all_are_fresh():
    share = TierShare(WEIGHTS, PRIORITIES)
    assert share.order()[:3] == ["enterprise", "pro", "free"]
    assert share.order()[-1] == "batch"


def test_backlogged_tiers_share_in_proportion_to_weight():
    share = TierShare(WEIGHTS, PRIORITIES)
    taken = pull(share, {"pro": 10_000, "free": 10_000}, 500)
    assert taken["pro"] == 400 and taken["free"] == 100  # 4 : 1


def test_free_progresses_under_sustained_pro_load():
    share = TierShare(WEIGHTS, PRIORITIES)
    taken = pull(share, {"enterprise": 10_000, "pro": 10_000, "free": 10_000}, 130)
    assert taken["free"] >= 9 and taken["enterprise"] > taken["pro"] > taken["free"]


def test_a_tier_back_from_idle_does_not_spend_saved_credit():
    share = TierShare(WEIGHTS, PRIORITIES)
    pull(share, {"free": 1000}, 200)  # free alone for a long time: its tag runs far ahead
    taken = pull(share, {"pro": 1000, "free": 1000}, 50)
    assert taken["free"] >= 7 and taken["pro"] <= 43  # about 4 : 1, free is not locked out
    share2 = TierShare(WEIGHTS, PRIORITIES)
    pull(share2, {"pro": 1000}, 200)  # pro alone: a returning free must not get a burst either
    taken = pull(share2, {"pro": 1000, "free": 1000}, 50)
    assert taken["free"] <= 11


def test_batch_takes_only_idle_capacity_plus_its_guaranteed_share():
    share = TierShare(WEIGHTS, PRIORITIES, batch_min_share=0.05)
    taken = pull(share, {"pro": 10_000, "batch": 10_000}, 1000)
    assert 40 <= taken["batch"] <= 60  # about 5 %, never starved
    idle = TierShare(WEIGHTS, PRIORITIES)
    assert pull(idle, {"batch": 100}, 100)["batch"] == 100  # alone, it takes everything


def test_weights_change_live():
    share = TierShare(WEIGHTS, PRIORITIES)
    share.set_weights({**WEIGHTS, "free": 4.0})
    taken = pull(share, {"pro": 10_000, "free": 10_000}, 400)
    assert taken["pro"] == taken["free"] == 200
