"""What the torchrun workers of tests/test_torchrun.py share: a small real model whose
forward (or backward) raises a CUDA-style out-of-memory when the samples it is given, plus
what its process already holds, exceed a simulated device's capacity.

The error is injected, not a real allocation failure, so that a size ladder is exhausted
at the same step, on the same rank, in every run: the tests are about what the launcher, the
size files and the ranks' agreement do with it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch

CAPACITY = 40
"""Samples the simulated device holds at once (the model's activations for a batch)."""
MiB_PER_SAMPLE = 96


def record_pid(out: str) -> None:
    """Write this worker's pid where the test finds it, so it can end it whatever happens
    (torch.distributed.run starts each worker in a session of its own)."""
    folder = os.path.join(out, "pids")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, str(os.getpid())), "w") as f:
        f.write(str(os.getpid()))


def out_of_memory(samples: int, held: int) -> RuntimeError:
    """The error a CUDA allocation of ``samples`` samples' activations raises."""
    return RuntimeError(
        f"CUDA out of memory. Tried to allocate {samples * MiB_PER_SAMPLE} MiB (GPU 0; "
        f"{CAPACITY * MiB_PER_SAMPLE} MiB total capacity; {held * MiB_PER_SAMPLE} MiB "
        f"already allocated)")


class Hungry(torch.autograd.Function):
    """Identity in value; raises the device's out-of-memory in ``where`` ("forward" or
    "backward") when the samples passing plus ``held`` exceed :data:`CAPACITY`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, where: Optional[str], held: int) -> torch.Tensor:
        ctx.where, ctx.held = where, held
        if where == "forward" and x.shape[0] + held > CAPACITY:
            raise out_of_memory(x.shape[0], held)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.where == "backward" and grad.shape[0] + ctx.held > CAPACITY:
            raise out_of_memory(grad.shape[0], ctx.held)
        return grad, None, None


class Net(torch.nn.Module):
    """Two linear layers; between them the simulated device's limit, where ``where`` says
    (``None``: no limit on this rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(16, 32)
        self.second = torch.nn.Linear(32, 1)
        self.where: Optional[str] = None
        self.held = 0  # samples' worth of memory the process holds besides (a leak, say)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = Hungry.apply(self.first(x), self.where, self.held)
        return self.second(torch.relu(hidden))


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(step: int, rank: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: the same in every run."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, 16, generator=g), torch.randn(size, 1, generator=g)


def write_result(out: str, name: str, data: dict) -> None:
    """``data`` as ``out/name.json``, written whole (a temporary file renamed over it)."""
    path = os.path.join(out, name + ".json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def environment() -> dict[str, int]:
    """What torch.distributed.run told this worker."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT")
    return {key.lower(): int(os.environ[key]) for key in keys}
