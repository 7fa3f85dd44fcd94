"""What ``auto_microbatch`` does to a model sharded with FSDP2 (``fully_shard``).

FSDP2 all-gathers a unit's parameters before its forward and its backward, and
reduce-scatters after its backward: a rank that runs out of memory mid-pass would leave its
peers waiting in the next all-gather. So, while a step runs: gradient reduction is held
back (``reduce_grads`` off, as ``set_requires_gradient_sync(False)``); a flag exchange runs
before every unit's forward pre-hook and pre-backward hook, so a peer's failure is learned
before any further collective; a failed pass is undone with FSDP's ``reset_iter_state()``;
after the last pass the accumulated gradients are reduce-scattered once through FSDP's own
end-of-backward path. FSDP2 has no public call for that last step, hence the private
attributes used here."""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

from .. import _torch_compat as compat
from .._torch_compat import UNSHARDED_PARAM as UNSHARDED


def fsdp1(model: Any) -> Optional[Any]:
    """The first ``FullyShardedDataParallel`` (FSDP1) module in ``model``, or ``None``."""
    for module in model.modules():
        if any(cls.__name__ == "FullyShardedDataParallel"
               and cls.__module__.startswith("torch.distributed.fsdp")
               for cls in type(module).__mro__):
            return module
    return None


def units(model: Any) -> list[Any]:
    """The modules of ``model`` that ``fully_shard`` was applied to, in ``modules()`` order."""
    if "torch.distributed.fsdp" not in sys.modules:
        # never imported, so nothing is sharded; importing it here would pull in hundreds of
        # modules (sympy, mpmath: tens of MiB of address space) at every plain model's wrap
        return []
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a build without torch.distributed
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


Saved = list[tuple[Any, Any, Any]]
"""Unsharded gradients set aside: ``(FSDP parameter, its unsharded grad, accumulated grad)``."""


class Sharding:
    """FSDP2's state for one ``auto_microbatch`` step on ``model``.

    Args:
        model: the module the step trains, holding at least one ``fully_shard`` module.
    """

    def __init__(self, model: Any) -> None:
        self.units = units(model)
        self.states: list[Any] = []
        self.groups: list[Any] = []
        for unit in self.units:
            state = compat.fsdp_state(unit)
            if any(state is s for s in self.states):
                continue
            self.states.append(state)
            self.groups.extend(compat.fsdp_param_groups(state))
        # the user's own reduction flags (off inside their accumulation steps)
        self.flags = [(g.reduce_grads, g.all_reduce_grads) for g in self.groups]
        self.syncs = any(reduce for reduce, _ in self.flags)
        self.handles: list[Any] = []

    # -- reduction held back --------------------------------------------------------------
    def hold(self) -> None:
        """No reduce-scatter (nor HSDP all-reduce) inside the passes."""
        for group in self.groups:
            group.reduce_grads = False
            group.all_reduce_grads = False

    def release(self) -> None:
        """The user's reduction flags back."""
        for group, (reduce, all_reduce) in zip(self.groups, self.flags, strict=True):
            group.reduce_grads = reduce
            group.all_reduce_grads = all_reduce

    def reduce(self) -> None:
        """Reduce-scatter the accumulated gradients once, as FSDP's last backward would (after
        :meth:`release`). A collective."""
        for state in self._roots():
            # after a backward, every group is idle: the end-of-backward callback runs each
            # group's post-backward, which reduces what the group accumulated
            compat.fsdp_final_callback(state)  # FSDP2's own path

    def _roots(self) -> list[Any]:
        return [s for s in self.states if compat.fsdp_is_root(s)]  # set by lazy init

    def reset(self) -> None:
        """After a pass that raised: every root's iteration state reset (``reset_iter_state()``)."""
        for state in self._roots():
            compat.fsdp_reset_iter_state(state)

    # -- unsharded gradients ---------------------------------------------------------------
    def _params(self) -> list[Any]:
        return [p for g in self.groups for p in g.fsdp_params]

    def stash(self) -> Saved:
        """Move the unsharded gradients aside; the parameters are left with none."""
        saved: Saved = []
        for param in self._params():
            unsharded = getattr(param, UNSHARDED, None)
            grad = unsharded.grad if unsharded is not None else None
            accumulated = param.unsharded_accumulated_grad
            if grad is None and accumulated is None:
                continue
            saved.append((param, grad, accumulated))
            if unsharded is not None:
                unsharded.grad = None
            param.unsharded_accumulated_grad = None
        return saved

    def drop(self) -> None:
        """Forget the unsharded gradients written since :meth:`stash`."""
        for param in self._params():
            unsharded = getattr(param, UNSHARDED, None)
            if unsharded is not None:
                unsharded.grad = None
            param.unsharded_accumulated_grad = None

    def restore(self, saved: Saved) -> None:
        """Put the stashed unsharded gradients back, dropping any written since."""
        self.drop()
        for param, grad, accumulated in saved:
            if grad is not None:
                getattr(param, UNSHARDED).grad = grad
            param.unsharded_accumulated_grad = accumulated

    def merge(self, saved: Saved) -> None:
        """Each unsharded gradient becomes stashed + new."""
        import torch

        with torch.no_grad():
            for param, grad, accumulated in saved:
                if grad is not None:
                    unsharded = getattr(param, UNSHARDED)
                    if unsharded.grad is not None:
                        grad.add_(unsharded.grad)
                    unsharded.grad = grad
                if accumulated is not None:
                    if param.unsharded_accumulated_grad is not None:
                        accumulated.add_(param.unsharded_accumulated_grad)
                    param.unsharded_accumulated_grad = accumulated

    # -- check points ----------------------------------------------------------------------
    def watch(self, check: Callable[[], None]) -> None:
        """Call ``check()`` before each unit's forward and pre-backward hooks, until unwatched."""
        def before_forward(module: Any, args: Any) -> None:
            check()

        def after_forward(module: Any, args: Any, output: Any) -> None:
            import torch

            if not torch.is_grad_enabled():
                return
            tensors = [t for t in _tensors(output) if t.requires_grad]
            if not tensors:
                return
            fired = [False]

            def before_backward(grad: Any) -> None:
                if not fired[0]:
                    fired[0] = True
                    check()

            for tensor in tensors:
                tensor.register_hook(before_backward)

        for unit in self.units:
            # in front of FSDP's own hooks: its pre-forward all-gathers, and its post-forward
            # registers the pre-backward hook that all-gathers again
            self.handles.append(unit.register_forward_pre_hook(before_forward, prepend=True))
            self.handles.append(unit.register_forward_hook(after_forward, prepend=True))

    def unwatch(self) -> None:
        """Remove what :meth:`watch` registered."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _tensors(output: Any) -> list[Any]:
    """The tensors in a module's output (nested tuples, lists and dicts)."""
    import torch

    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []
