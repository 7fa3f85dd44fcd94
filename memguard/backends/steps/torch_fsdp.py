"""What ``auto_microbatch`` does to a model sharded with FSDP2 (``fully_shard``).

FSDP2 all-gathers a unit's parameters in the unit's forward pre-hook and again in the hook that
runs before the unit's backward, and reduce-scatters its gradients after the unit's backward.
A rank that runs out of memory inside a pass stops there; its peers would go on into the next
all-gather and wait for it until the process group's timeout. So, while a step runs:

- gradient reduction is held back (every parameter group's ``reduce_grads`` off, as
  ``set_requires_gradient_sync(False)`` sets it): the slices accumulate unsharded gradients
  locally, and no reduce-scatter runs inside a pass;
- a check runs before every unit's forward pre-hook (a forward pre-hook put in front of FSDP's)
  and before every unit's pre-backward hook (a tensor hook on the unit's outputs, registered
  before FSDP's by a forward hook put in front of FSDP's): the caller exchanges a flag there, the
  same exchange a rank makes when its pass ends, so a peer's failure is learned at the next
  check, before any further collective;
- after a failed pass every root is put back with FSDP's own ``reset_iter_state()`` and the
  pass's unsharded gradients are dropped;
- after the last pass succeeded on every rank, the accumulated gradients are reduce-scattered
  once, by FSDP's own end-of-backward path with reduction switched back on.

This module touches FSDP2's parameter groups (``_fsdp_param_groups``, ``reduce_grads``, each
parameter's ``_unsharded_param`` and ``unsharded_accumulated_grad``) and its root's
end-of-backward callback: FSDP2 offers no public call that reduces accumulated gradients.
"""

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
    """FSDP2's state for one ``auto_microbatch`` step on ``model`` (see the module's notes).

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
        """Reduce-scatter the accumulated unsharded gradients into the sharded parameters'
        gradients, once, as FSDP's own last backward would (the reduction flags must be back,
        :meth:`release`). A collective: every rank must call it."""
        for state in self._roots():
            # after a backward, every group is idle: the end-of-backward callback runs each
            # group's post-backward, which reduces what the group accumulated
            compat.fsdp_final_callback(state)  # FSDP2's own path

    def _roots(self) -> list[Any]:
        return [s for s in self.states if compat.fsdp_is_root(s)]  # set by lazy init

    def reset(self) -> None:
        """After a pass that raised: every root FSDP module's iteration state reset (its
        parameters resharded, its trackers cleared), as FSDP's ``reset_iter_state()`` does."""
        for state in self._roots():
            compat.fsdp_reset_iter_state(state)

    # -- unsharded gradients ---------------------------------------------------------------
    def _params(self) -> list[Any]:
        return [p for g in self.groups for p in g.fsdp_params]

    def stash(self) -> Saved:
        """Move the unsharded gradients aside (those left by the user's own steps without
        gradient sync); the parameters are left with none."""
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
        """Call ``check()`` before each unit's forward pre-hook and before each unit's
        pre-backward hook (once per unit and forward), until :meth:`unwatch`."""
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
