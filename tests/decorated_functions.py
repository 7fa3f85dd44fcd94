"""Module-level decorated functions of every kind, for the pickling tests (pickled by
reference: a child process imports this module by name)."""

from __future__ import annotations

import torch

import memguard

model = torch.nn.Linear(4, 1)


@memguard.oom_retry(batch_size=1024)
def shrinking_step(batch_size: int) -> int:
    """Runs out of memory for real above 100 samples (a petabyte-sized tensor)."""
    if batch_size > 100:
        torch.empty(batch_size, 2**40, dtype=torch.uint8)
    return batch_size


@memguard.frees_memory
def frees(x: int) -> int:
    return x + 1


@memguard.frees_memory(every=2, max_leak="1GiB")
def frees_with_options(x: int) -> int:
    return x + 2


@memguard.frees_memory
async def frees_async(x: int) -> int:
    return x + 3


@memguard.frees_memory
def frees_generator(n: int):
    yield from range(n)


@memguard.memory_scope
def scoped(x: int) -> int:
    return x * 2


@memguard.memory_scope("named", cleanup="never")
def scoped_named(x: int) -> int:
    return x * 3


@memguard.inference_mode
def inferred(x: torch.Tensor) -> bool:
    return torch.is_inference_mode_enabled()


@memguard.inference_mode(model)
def inferred_with_model(x: torch.Tensor) -> torch.Tensor:
    return model(x)


@memguard.auto_microbatch(model)
def microbatched(batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


@memguard.record_history("unused.pickle")
def recorded(x: int) -> int:
    return x - 1


class Trainer:
    @memguard.frees_memory
    def step(self, x: int) -> int:
        return x + 10

    @memguard.oom_retry(batch_size=8)
    def fit(self, batch_size: int) -> int:
        return batch_size


frees_lambda = memguard.frees_memory(lambda: 1)
