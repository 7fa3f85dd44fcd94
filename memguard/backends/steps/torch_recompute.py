"""The recompute rung of :func:`memguard.auto_microbatch`: when a slice of ``min_batch_size``
still runs out of memory, that batch's passes run the model's repeated blocks (children of
its ``ModuleList``/``Sequential`` containers) under non-reentrant
``torch.utils.checkpoint``, or a Hugging Face model's ``gradient_checkpointing_enable()``.

Exact: checkpointing restores torch's global RNG state before recomputing (a model whose
modules keep a ``torch.Generator`` of their own is not recomputed), and buffers a block moves
in forward are put back after the recomputation, so they move once."""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Callable, Iterator, Optional

log = logging.getLogger("memguard")


def _inner(model: Any) -> Any:
    """The module under DDP's wrapper."""
    return getattr(model, "module", model) if type(model).__name__ == \
        "DistributedDataParallel" else model


def _blocks(model: Any) -> list[Any]:
    """The children of the model's containers, none inside another one listed."""
    import torch

    found: list[Any] = []
    taken: set[int] = set()

    def visit(module: Any) -> None:
        for child in module.children():
            if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) \
                    and id(child) not in taken and any(True for _ in child.parameters()):
                taken.add(id(child))
                found.append(child)
                continue  # its own containers run inside its checkpoint
            visit(child)

    visit(model)
    return found


def _checkpointed(block: Any, forward: Callable[..., Any]) -> Callable[..., Any]:
    import torch
    from torch.utils.checkpoint import checkpoint

    def run(*args: Any, **kwargs: Any) -> Any:
        calls = [0]

        def body(*inner: Any, **inner_kw: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                return forward(*inner, **inner_kw)
            # the recomputation: what forward moved in the buffers is put back after it
            with torch.no_grad():
                kept = [(b, b.detach().clone()) for b in block.buffers()]
            try:
                return forward(*inner, **inner_kw)
            finally:
                with torch.no_grad():
                    for buffer, value in kept:
                        buffer.copy_(value)

        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(body, *args, use_reentrant=False, **kwargs)

    return run


def own_generator(model: Any) -> Optional[str]:
    """Where a module of ``model`` keeps a ``torch.Generator`` of its own (``"blocks.3.gen"``),
    or ``None``: checkpointing restores only torch's global generators, so a block drawing
    from such a one would recompute with other numbers than its forward drew."""
    import torch

    for name, module in _inner(model).named_modules():
        for attribute, value in vars(module).items():
            if isinstance(value, torch.Generator):
                return f"{name}.{attribute}" if name else attribute
    return None


def available(model: Any) -> bool:
    """Whether the model has blocks to recompute (or its own gradient checkpointing), and none
    of its modules keeps a generator of its own (:func:`own_generator`: the rung is skipped,
    with a warning, rather than give gradients that are not the loss's)."""
    inner = _inner(model)
    where = own_generator(inner)
    if where is not None:
        log.warning("auto_microbatch: not recomputing %s's activations: its module attribute "
                    "%s is a torch.Generator of its own, which checkpointing does not restore "
                    "(the recomputed draws would differ from the forward's, and the gradients "
                    "from the loss's)", type(inner).__name__, where)
        return False
    if callable(getattr(inner, "gradient_checkpointing_enable", None)) \
            and getattr(inner, "supports_gradient_checkpointing", False):
        return True
    return bool(_blocks(inner))


def prepare(model: Any) -> None:
    """Import now what the first recomputed pass would import: non-reentrant
    ``torch.utils.checkpoint`` reads ``torch._dynamo``'s config, and that import brings about
    800 modules, about 70 MiB of address space and a second. The rung runs when memory has
    run out; an import that ran out of memory there left ``torch._dynamo`` half made ("cannot
    import name ... from torch._dynamo.utils"), and the step failed where the recomputed pass
    itself fitted. Every torch optimizer's first step imports it too, so a training program
    pays this once either way."""
    if "torch._dynamo" in sys.modules or not available(model):
        return
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - the rung imports it again when it runs, and says why
        pass


@contextlib.contextmanager
def recomputing(model: Any) -> Iterator[str]:
    """While inside, the model's blocks recompute activations in backward; yields what was
    checkpointed."""
    inner = _inner(model)
    hf = callable(getattr(inner, "gradient_checkpointing_enable", None)) \
        and getattr(inner, "supports_gradient_checkpointing", False)
    if hf:
        # the new name where the class has it: the old one warns on newer transformers
        named = "is_activation_checkpointing" if hasattr(type(inner),
                                                         "is_activation_checkpointing") \
            else "is_gradient_checkpointing"
        if getattr(inner, named, False):
            yield "the model's own gradient checkpointing (already on)"
            return
        if callable(getattr(inner, "activation_checkpointing_enable", None)):
            # newer transformers: the same switch under its new name
            inner.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False})
            off = inner.activation_checkpointing_disable
        else:
            inner.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
            off = inner.gradient_checkpointing_disable
        try:
            yield "the model's gradient checkpointing"
        finally:
            off()
        return
    blocks = _blocks(inner)
    saved: list[tuple[Any, bool, Any]] = []
    try:
        for block in blocks:
            own = "forward" in vars(block)
            saved.append((block, own, vars(block).get("forward")))
            block.forward = _checkpointed(block, block.forward)
        yield f"{len(blocks)} blocks checkpointed"
    finally:
        for block, own, forward in reversed(saved):
            if own:
                block.forward = forward
            else:
                del block.forward
