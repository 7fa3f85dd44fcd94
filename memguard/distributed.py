"""Agreement between the ranks of a distributed job at each attempt boundary: if any rank ran
out of memory, every rank retries at the same size (one rank retrying alone would hang the
job). Collectives inside the guarded function cannot be rescued: see the distributed guide."""

from __future__ import annotations

from typing import Any, Callable, Literal, Union

from .backends import torch_distributed
from .errors import MemguardError

Sync = Union[bool, Literal["auto"]]
OK, OOM, GAVE_UP, FAILED = 0, 1, 2, 3
"""A rank's status after an attempt, worst last: the worst over the ranks is their maximum."""


def check_sync(sync: object, who: str = "sync") -> Sync:
    """``sync`` if it is ``True``, ``False`` or ``"auto"`` (not 1 or 0), else a ``ValueError``.

    >>> check_sync("auto")
    'auto'
    """
    if not (sync is True or sync is False or sync == "auto"):
        raise ValueError(f"{who}: sync must be True, False or 'auto', got {sync!r}")
    return sync


class Agreement:
    """The ranks' common view of one attempt: the worst status and the smallest size
    (``sync="auto"``: when more than one rank is initialised)."""

    def __init__(self, sync: Sync = "auto") -> None:
        check_sync(sync)
        world = torch_distributed.world() if sync is not False else None
        if sync is True and world is None:
            raise RuntimeError("sync=True needs an initialised torch.distributed process group "
                               "(torch.distributed.init_process_group)")
        self.active = world is not None and (sync is True or world[1] > 1)
        self.rank = world[0] if world else 0

    def all_max(self, values: list[int]) -> list[int]:
        """Each of ``values`` maximised over the ranks (as they are when not active)."""
        if not self.active:
            return values
        return self._timed(torch_distributed.all_max, values)

    def spread(self, values: list[float]) -> list[float]:
        """Each of ``values``' largest minus smallest over the ranks (0 when not active)."""
        if not self.active:
            return [0.0] * len(values)
        return self._timed(torch_distributed.all_spread, values)

    def _timed(self, collective: Callable[[list[Any]], list[Any]], values: list[Any]
               ) -> list[Any]:
        try:
            return collective(values)
        except torch_distributed.SyncTimeout as timeout:
            raise MemguardError(
                f"rank {self.rank}: the other ranks did not reach memguard's agreement within "
                f"{timeout.args[0]:g} s (${torch_distributed.TIMEOUT_VARIABLE}). Likely causes: "
                "a collective of your own inside the guarded step (all_reduce, gather_for_metrics"
                "...) that a peer's out-of-memory left unmatched - move it out of the guarded "
                "code; or a guarded call made on some ranks only (if rank == 0: ...) - pass "
                "sync=False to that call. The process group is not reusable after this error: "
                "end the job.") from None

    def smallest(self, size: int) -> int:
        """The smallest ``size`` over the ranks (``size`` when not active)."""
        if not self.active:
            return size
        return -self.all_max([-size])[0]
