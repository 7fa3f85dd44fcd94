"""What ``auto_microbatch`` needs from torch: a model's gradients set aside and merged back,
a weighted backward, and, under ``DistributedDataParallel``, gradients kept local while slices
run and averaged once afterwards.

Gradients on entry are *moved* aside (``p.grad = None``), not copied: a pass then writes fresh
gradients, which are dropped whole when the pass fails and added to the entry gradients when
the step succeeds (one addition per parameter). Where the parameters hold gradients on entry
(accumulation across steps, or zeros left by ``zero_grad(set_to_none=False)``), both sets are
alive during the step: one gradient buffer more at the peak than plain accumulation.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

BUCKET_BYTES = 25 << 20  # DDP's default bucket size: the most the averaging concatenates


def parameters(model: Any) -> list[Any]:
    """The parameters of ``model`` that take gradients; ``TypeError`` for a non-module."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"auto_microbatch needs the torch.nn.Module being trained, got "
                        f"{type(model).__name__}: {model!r:.80}")
    return [p for p in model.parameters() if p.requires_grad]


def stash(params: list[Any]) -> list[Any]:
    """Move each parameter's gradient aside; the parameters are left with none."""
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    return saved


def drop(params: list[Any]) -> None:
    """Forget the gradients written since :func:`stash`."""
    for p in params:
        p.grad = None


def restore(params: list[Any], saved: list[Any]) -> None:
    """Put the stashed gradients back, dropping any written since."""
    for p, grad in zip(params, saved, strict=True):
        p.grad = grad


def merge(params: list[Any], saved: list[Any]) -> None:
    """Each parameter's gradient becomes stashed + new (in the stashed tensor)."""
    import torch

    with torch.no_grad():
        for p, old in zip(params, saved, strict=True):
            if old is None:
                continue
            if p.grad is not None:
                old.add_(p.grad)
            p.grad = old


def check_loss(loss: Any, who: str) -> None:
    """A clear error unless ``loss`` is a scalar tensor that backward can run from."""
    import torch

    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"{who} must return the loss as a torch.Tensor, got "
                        f"{type(loss).__name__}")
    if loss.numel() != 1:
        raise TypeError(f"{who} must return a scalar loss, got a tensor of shape "
                        f"{tuple(loss.shape)}; reduce it (loss.mean() or loss.sum())")
    if not loss.requires_grad:
        raise RuntimeError(f"{who} returned a loss that does not require grad: is the call "
                           f"inside torch.no_grad() or inference_mode, or is the loss "
                           f"detached?")


def outside(loss: Any, params: list[Any]) -> list[Any]:
    """The leaf tensors that backward of ``loss`` writes gradients into and that are not
    among ``params`` (a head kept out of the model, an input that requires grad)."""
    known = {id(p) for p in params}
    found, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if variable is not None and id(variable) not in known:
            known.add(id(variable))
            found.append(variable)
        stack.extend(fn for fn, _ in node.next_functions)
    return found


def is_parameter(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.nn.Parameter``."""
    import torch

    return isinstance(tensor, torch.nn.Parameter)


def describe(tensor: Any) -> str:
    """``"float32[16, 1]"``."""
    return f"{str(tensor.dtype).replace('torch.', '')}{list(tensor.shape)}"


def backward(loss: Any, weight: float, scaler: Any, total: Any) -> Any:
    """``(loss * weight).backward()`` (through ``scaler`` when given); returns ``total`` plus
    the weighted loss, detached. ``loss`` has passed :func:`check_loss`."""
    if weight != 1.0:
        loss = loss * weight
    (scaler.scale(loss) if scaler is not None else loss).backward()
    value = loss.detach().reshape(())
    return value if total is None else total + value


def reset_scaler(scaler: Any) -> None:
    """Forget what ``scaler`` recorded for the optimizers during a failed pass."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if states:
        states.clear()


def ddp_of(model: Any) -> Optional[Any]:
    """``model`` when it is a ``DistributedDataParallel``, else ``None``."""
    import torch

    ddp = torch.nn.parallel.DistributedDataParallel
    return model if isinstance(model, ddp) else None


def sharded(model: Any) -> bool:
    """Whether ``model`` is (or holds) an FSDP module, whose collectives run inside forward
    and backward."""
    return any(cls.__name__ in ("FullyShardedDataParallel", "FSDPModule")
               for module in model.modules() for cls in type(module).__mro__)


def group_size(ddp: Any) -> int:
    """The number of ranks of ``ddp``'s process group."""
    import torch.distributed as dist

    return dist.get_world_size(ddp.process_group)


@contextlib.contextmanager
def local_gradients(ddp: Optional[Any]) -> Iterator[bool]:
    """Run the block with ``ddp`` neither reducing gradients in backward nor broadcasting
    buffers in forward (collectives that a peer's out-of-memory would leave unmatched).

    Yields whether DDP would have synchronised this step (``False`` inside the user's own
    ``no_sync()``). Buffers are broadcast from the group's first rank on entry, where DDP's
    first forward of the step would have: every rank is at the same point there.
    """
    if ddp is None:
        yield False
        return
    import torch.distributed as dist

    syncs = bool(ddp.require_backward_grad_sync)
    forward_sync = ddp.require_forward_param_sync
    if syncs and forward_sync and getattr(ddp, "broadcast_buffers", False):
        source = dist.get_global_rank(ddp.process_group, 0)
        for buffer in ddp.module.buffers():
            dist.broadcast(buffer, src=source, group=ddp.process_group)
    ddp.require_backward_grad_sync = False
    ddp.require_forward_param_sync = False
    try:
        yield syncs
    finally:
        ddp.require_backward_grad_sync = syncs
        ddp.require_forward_param_sync = forward_sync


def presence(params: list[Any], saved: list[Any]) -> list[int]:
    """1 for each parameter that has a gradient (stashed or new), else 0."""
    return [int(p.grad is not None or old is not None)
            for p, old in zip(params, saved, strict=True)]


def average(params: list[Any], present: list[int], group: Any) -> None:
    """Average the gradients over ``group`` as DDP would: a parameter that has a gradient on
    some rank gets one on every rank (zeros where it had none); one that has none anywhere
    keeps none. Gradients travel in buckets of at most ``BUCKET_BYTES``, by device and dtype.
    """
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    grads = []
    with torch.no_grad():
        for p, anywhere in zip(params, present, strict=True):
            if not anywhere:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if p.grad.is_sparse:
                raise NotImplementedError("auto_microbatch cannot average sparse gradients "
                                          "over DDP ranks; use dense embeddings")
            grads.append(p.grad)
        buckets: dict[tuple, list[list[Any]]] = {}
        filled: dict[tuple, int] = {}
        for grad in grads:
            key, size = (grad.device, grad.dtype), grad.numel() * grad.element_size()
            chain = buckets.setdefault(key, [[]])
            if chain[-1] and filled[key] + size > BUCKET_BYTES:
                chain.append([])
                filled[key] = 0
            chain[-1].append(grad)
            filled[key] = filled.get(key, 0) + size
        for chain in buckets.values():
            for bucket in chain:
                flat = torch.cat([g.reshape(-1) for g in bucket])
                flat.div_(world)
                dist.all_reduce(flat, group=group)
                offset = 0
                for g in bucket:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
