"""torch's data pipeline, for ``map_batches``: recognising a map-style ``Dataset`` and
collating its samples as a ``DataLoader`` would.

Nothing here imports torch to look: an object can only be a torch ``Dataset`` once the
program has imported ``torch.utils.data``.
"""

from __future__ import annotations

import sys
from typing import Any


def is_map_dataset(data: Any) -> bool:
    """Whether ``data`` is a map-style ``torch.utils.data.Dataset`` (indexable by position;
    an ``IterableDataset`` is not).

    >>> is_map_dataset([1, 2, 3])
    False
    """
    module = sys.modules.get("torch.utils.data")
    if module is None:
        return False
    return (isinstance(data, module.Dataset) and not isinstance(data, module.IterableDataset)
            and hasattr(data, "__len__"))


def collate(samples: list[Any]) -> Any:
    """``torch.utils.data.default_collate(samples)``: a ``TensorDataset``'s ``(x, y)``
    samples become one ``(x, y)`` of stacked tensors."""
    from torch.utils.data import default_collate

    return default_collate(samples)
