"""The strategy registry: one file per strategy, looked up by name (``registry.py``)."""
from __future__ import annotations

from .base import Strategy
from .colossal import Colossal
from .metp import METP
from .ring import Ring
from .tp_sp import TPSP
from .registry import REGISTRY, register
from .ulysses import Ulysses

_ORDER = ("tp_sp", "ulysses", "ring", "colossal", "metp")

for _cls in (TPSP, Ulysses, Ring, Colossal, METP):
    register(_cls())

STRATEGIES = tuple(n for n in _ORDER if n in REGISTRY)


def get(name: str) -> Strategy:
    """The strategy called ``name``; a ValueError naming the known ones otherwise."""
    if name not in REGISTRY:
        raise ValueError(f"unknown ParaDySe strategy {name!r}; known: {', '.join(STRATEGIES)}")
    return REGISTRY[name]


def supports(name: str, config, p: int) -> tuple[bool, str]:
    """(True, "") if strategy ``name`` can run ``config`` over ``p`` ranks, else (False, reason)."""
    return get(name).supports(config, p)
