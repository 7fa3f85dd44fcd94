"""The one collective memguard needs from ``torch.distributed``: a max over ranks, on a gloo
group of memguard's own (never mixed with the training's collectives, never allocating on
a GPU that just ran out)."""

from __future__ import annotations

import datetime
import os
import sys
import weakref
from typing import Any, Optional

from .._locks import ForkSafeLock
from ._torch_compat import default_group_reader

_lock = ForkSafeLock()
# default group -> memguard's gloo group for it. Weak keys: once the user destroys the default
# group, the side group goes with it. Holding either past ``destroy_process_group`` would leave
# their C++ destructors (gloo's threads) to interpreter shutdown, where they can abort.
_groups: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def world() -> Optional[tuple[int, int]]:
    """``(rank, world_size)`` of the initialised default process group, or ``None``."""
    dist = _DIST[0] if _DIST else _distributed()
    if dist is None:
        return None
    if _DEFAULT_GROUP:  # where torch keeps the default group: is_initialized() in four calls
        if _DEFAULT_GROUP[0]() is None:
            return None
    elif not dist.is_initialized():
        return None
    return dist.get_rank(), dist.get_world_size()


_DIST: list[Any] = []  # torch.distributed once torch is imported, None where unavailable
_DEFAULT_GROUP: list[Any] = []  # the default group's reader, where torch's record is as expected


def _distributed() -> Any:
    """``torch.distributed`` where available, else ``None`` (looked up once)."""
    if "torch" not in sys.modules:
        return None
    import torch.distributed as dist

    _DIST[:] = [dist if dist.is_available() else None]
    if _DIST[0] is not None:
        reader = default_group_reader(dist)
        if reader is not None:
            _DEFAULT_GROUP[:] = [reader]
    return _DIST[0]


def _side_group() -> Any:
    """memguard's gloo group, made once per default group (gloo too: a program's collective
    meeting memguard's on one group aborts the process); creation waits at most
    :func:`sync_timeout`."""
    import torch.distributed as dist

    default = dist.group.WORLD
    with _lock:
        group = _groups.get(default)
        if group is None:
            seconds = sync_timeout()
            try:
                group = dist.new_group(backend="gloo",
                                       timeout=datetime.timedelta(seconds=seconds))
            except RuntimeError as error:
                if "timed out" not in str(error).lower() and "timeout" not in \
                        str(error).lower():
                    raise
                raise SyncTimeout(seconds) from error
            _groups[default] = group
        return group


TIMEOUT_VARIABLE = "MEMGUARD_SYNC_TIMEOUT"
DEFAULT_TIMEOUT = 600.0
"""Seconds a rank waits for its peers in memguard's agreement before it raises."""


def sync_timeout() -> float:
    """Seconds to wait in the agreement: ``$MEMGUARD_SYNC_TIMEOUT`` or :data:`DEFAULT_TIMEOUT`."""
    text = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_VARIABLE} must be a positive number of seconds, "
                         f"got {text!r}")
    return seconds


class SyncTimeout(RuntimeError):
    """The peers did not reach memguard's agreement in time (raised as a MemguardError)."""


def all_max(values: list[int]) -> list[int]:
    """The element-wise maximum of ``values`` over the ranks, waiting at most :func:`sync_timeout`
    before :class:`SyncTimeout` (the group is unusable after: the error ends the job)."""
    import torch

    tensor = torch.tensor(values, dtype=torch.int64)
    _maximise(tensor)
    return [int(v) for v in tensor.tolist()]


def all_spread(values: list[float]) -> list[float]:
    """Each of ``values``' largest minus smallest value over the ranks (float64, gloo); the
    same wait as :func:`all_max`."""
    import torch

    tensor = torch.tensor([*values, *(-v for v in values)], dtype=torch.float64)
    _maximise(tensor)
    n = len(values)
    return [float(tensor[i] + tensor[n + i]) for i in range(n)]


def _maximise(tensor: Any) -> None:
    """All-reduce ``tensor`` with MAX on memguard's group, within :func:`sync_timeout`."""
    import torch.distributed as dist

    work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_side_group(), async_op=True)
    seconds = sync_timeout()
    try:
        work.wait(timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError as error:
        if "timed out" not in str(error).lower():
            raise
        raise SyncTimeout(seconds) from error
