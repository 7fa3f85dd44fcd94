"""The one collective memguard needs from ``torch.distributed``: a max over ranks.

It runs on a gloo group of memguard's own, created once (collectively, by every rank's first
call), so it never mixes with the training's NCCL collectives and never allocates on a GPU
that has just run out of memory. Where the default group already is gloo, that group serves.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Optional

_lock = threading.Lock()
_groups: dict[int, Any] = {}


def world() -> Optional[tuple[int, int]]:
    """``(rank, world_size)`` of the initialised default process group, or ``None``."""
    if "torch" not in sys.modules:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank(), dist.get_world_size()


def _side_group() -> Any:
    import torch.distributed as dist

    default = dist.group.WORLD
    with _lock:
        key = id(default)
        if key not in _groups:
            if dist.get_backend() == "gloo":
                _groups[key] = default
            else:
                _groups[key] = dist.new_group(backend="gloo")
        return _groups[key]


def all_max(values: list[int]) -> list[int]:
    """The element-wise maximum of ``values`` over every rank (a CPU tensor, gloo)."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_side_group())
    return [int(v) for v in tensor.tolist()]
