"""The strategies by name (``REGISTRY``), filled by the package's ``__init__`` (``register``);
a strategy module that asks about another strategy reads it here, never from ``__init__``."""
from __future__ import annotations

from .base import Strategy

REGISTRY: dict = {}


def register(strategy: Strategy) -> Strategy:
    """Add ``strategy`` under its name."""
    REGISTRY[strategy.name] = strategy
    return strategy
