"""Every private torchmetrics API memguard uses, in one place, each with the version it was
checked against: where a torchmetrics release moves one, this is the module to change.

Nothing here imports torchmetrics: its callers pass the metrics they hold.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Callable

CHECKED_WITH = "1.9.0"
"""The torchmetrics version every entry below was checked against."""


# -- a Metric's state (checked with torchmetrics 1.9.0) -----------------------------------------
state_names: Callable[[Any], Any] = attrgetter("_defaults")
"""A ``Metric``'s states by name (their defaults, as ``add_state`` registered them): the
attributes ``update`` writes and ``reset`` puts back."""

BOOKKEEPING = ("_update_count", "_computed", "_forward_cache")
"""What a ``Metric`` keeps beside its states and ``update`` changes too: the count of updates,
the cached ``compute()`` value, the last ``forward`` value."""

bookkeeping: Callable[[Any], tuple] = attrgetter(*BOOKKEEPING)
"""A ``Metric``'s :data:`BOOKKEEPING`, as a tuple in that order."""


def set_bookkeeping(metric: Any, values: tuple) -> None:
    """Write back what :data:`bookkeeping` read."""
    for name, value in zip(BOOKKEEPING, values, strict=True):
        setattr(metric, name, value)
