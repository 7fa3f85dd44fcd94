"""torch's data pipeline for ``map_batches``: map-style ``Dataset`` recognition and
``DataLoader``-style collation, without importing torch to look."""

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


_UNJOINABLE = object()


def concatenate(parts: list[Any]) -> Any:
    """One batch's slice results joined as the batch was cut (tensors, arrays, lists, tuples and
    dicts part by part); results of other kinds come back as their list.

    >>> concatenate([[1, 2], [3]]), concatenate([({"a": [1]}, 5), ({"a": [2]}, 6)])
    ([1, 2, 3], ({'a': [1, 2]}, [5, 6]))
    """
    joined = _join(parts)
    return list(parts) if joined is _UNJOINABLE else joined


def _join(parts: list[Any]) -> Any:
    first = parts[0]
    torch = sys.modules.get("torch")
    if torch is not None and all(isinstance(p, torch.Tensor) and p.dim() > 0 for p in parts):
        return torch.cat(parts)
    numpy = sys.modules.get("numpy")
    if numpy is not None and all(isinstance(p, numpy.ndarray) and p.ndim > 0 for p in parts):
        return numpy.concatenate(parts)
    if all(type(p) is list for p in parts):
        return [item for p in parts for item in p]
    if all(type(p) is tuple and len(p) == len(first) for p in parts):
        return tuple(concatenate([p[i] for p in parts]) for i in range(len(first)))
    if all(type(p) is dict and p.keys() == first.keys() for p in parts):
        return {key: concatenate([p[key] for p in parts]) for key in first}
    return _UNJOINABLE
