"""The offload rung of :func:`memguard.auto_microbatch`, after recompute: a batch's passes keep
the tensors saved for backward in pinned host memory
(``torch.autograd.graph.save_on_cpu(pin_memory=True)``). Only on an accelerator with pinned
host memory (CUDA, ROCm, XPU).

With recompute the two nest (checked with torch 2.13.0): checkpoint's own hooks are the
innermost, so block activations are recomputed on the device while the checkpoints' inputs
and everything outside the blocks go to the host. Saved tensors come back bit for bit."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

ACCELERATORS = ("cuda", "xpu")
"""Device types whose saved tensors the rung moves to pinned host memory."""


def device_type(model: Any) -> Optional[str]:
    """The accelerator of the model's parameters (``"cuda"`` or ``"xpu"``); ``None`` on the CPU,
    MPS or without parameters."""
    import torch

    for param in model.parameters():
        kind = param.device.type
        if kind in ACCELERATORS:
            module = getattr(torch, kind, None)
            return kind if module is not None and module.is_available() else None
    return None


@contextlib.contextmanager
def offloading(kind: str) -> Iterator[None]:
    """While inside: tensors saved for backward go to pinned host memory of ``kind``'s host; the
    pinned blocks are given back when it ends."""
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
    """Give unused pinned host blocks back to the system (torch would keep them cached)."""
    import torch

    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if callable(empty) and torch.accelerator.is_available():
        empty()
