"""The offload rung of :func:`memguard.auto_microbatch`, the one after recompute: a batch's
passes keep the tensors autograd saves for backward in pinned host memory
(``torch.autograd.graph.save_on_cpu(pin_memory=True)``) instead of on the accelerator, and
copy each back when backward needs it.

Only where the step's tensors are on an accelerator with pinned host memory (CUDA, ROCm,
which torch names ``cuda`` too, and XPU): on the CPU a saved tensor is already in host memory
and the rung would change nothing.

With recompute (``torch_recompute``, non-reentrant ``torch.utils.checkpoint``) the two nest
(checked with torch 2.13.0): inside a checkpointed block, checkpoint's own saved-tensor hooks
are the innermost and keep nothing but placeholders, so its activations are recomputed, not
offloaded; the inputs each checkpoint keeps for its recomputation are saved under the
enclosing hooks, so they go to host memory, as does everything outside the blocks (the
embeddings, the head, the loss). Backward's recomputation runs under checkpoint's hooks, on
the device. What stays on the accelerator: the parameters, their gradients, and one block's
activations at a time.

Exactness: the saved tensors come back bit for bit (a copy, no conversion), so the gradients
are the plain pass's.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

ACCELERATORS = ("cuda", "xpu")
"""Device types whose saved tensors the rung moves to pinned host memory."""


def device_type(model: Any) -> Optional[str]:
    """The accelerator the model's parameters are on (``"cuda"``, also for ROCm, or
    ``"xpu"``), where it is available; ``None`` on the CPU (or MPS, whose memory the host
    shares) or for a model without parameters."""
    import torch

    for param in model.parameters():
        kind = param.device.type
        if kind in ACCELERATORS:
            module = getattr(torch, kind, None)
            return kind if module is not None and module.is_available() else None
    return None


@contextlib.contextmanager
def offloading(kind: str) -> Iterator[None]:
    """While inside: tensors saved for backward are kept in pinned host memory of the
    ``kind`` accelerator's host. The pinned blocks the pass used go back to the system when
    it ends (the host cache emptied), whatever ends it."""
    import torch

    save_on_cpu = torch.autograd.graph.save_on_cpu
    # device_type: torch 2.4 on (XPU); CUDA is its default
    hooks = save_on_cpu(pin_memory=True) if kind == "cuda" else \
        save_on_cpu(pin_memory=True, device_type=kind)
    try:
        with hooks:
            yield
    finally:
        release()


def release() -> None:
    """Give the pinned host blocks no tensor uses back to the system (torch keeps them
    cached otherwise: page-locked memory out of the host's reach)."""
    import torch

    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if callable(empty) and torch.accelerator.is_available():
        empty()
