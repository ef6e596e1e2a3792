"""Priority tiers: one number end to end (subject, pull order, engine priority).

Lower ``priority`` is more important, matching the engine's (priority, arrival) ordering.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Tier:
    name: str
    priority: int


TIERS: tuple[Tier, ...] = (
    Tier("enterprise", 0),
    Tier("pro", 1),
    Tier("free", 2),
    Tier("batch", 3),
)

TIER_NAMES: tuple[str, ...] = tuple(t.name for t in TIERS)
_BY_NAME = {t.name: t for t in TIERS}


def get_tier(name: str) -> Tier:
    """Return the tier called ``name``; raise ``KeyError`` for an unknown tier."""
    return _BY_NAME[name]


def tiers_by_priority() -> list[Tier]:
    """Tiers from most to least important: the order a worker pulls in."""
    return sorted(TIERS, key=lambda t: t.priority)
