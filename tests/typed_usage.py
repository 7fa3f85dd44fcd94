"""A user's program that CI's mypy step checks (``files`` in setup.cfg), never run: with
unused ignores as errors, every line without a ``# type: ignore[...]`` must type-check (a
decorated function keeps its parameters and return type, a decorated method binds ``self``),
and every line with one must be an error of that code (a call that breaks the parameters, a
result of the wrong type); a decorator that turned the function into ``Any`` leaves those
ignores unused, which is an error."""

from __future__ import annotations

from typing import Any, Coroutine, Iterator, Optional

import torch
import transformers

import memguard
from memguard.integrations.transformers import auto_microbatch as hf_auto_microbatch

model = torch.nn.Linear(4, 1)


# -- oom_retry: the function's parameters and return type; the size may be left out
@memguard.oom_retry(batch_size=64)
def train(batch_size: int) -> float:
    return 0.5 * batch_size


loss: float = train()
loss = train(32)
loss = train(batch_size=32)
size: Optional[int] = train.batch_size
records: list[memguard.Attempt] = train.history
train.reset()
wrong: str = train()  # type: ignore[assignment]
train("64")  # type: ignore[call-overload]
train(64, 2)  # type: ignore[call-overload]


@memguard.oom_retry
def evaluate(data: list[int], batch_size: int = 8) -> dict[str, float]:
    return {"n": float(len(data[:batch_size]))}


scores: dict[str, float] = evaluate([1, 2, 3])
evaluate(batch_size=4)  # type: ignore[call-overload]


async def infer(batch_size: int) -> int:
    return batch_size


coroutine = memguard.oom_retry(infer)
later: Coroutine[Any, Any, int] = coroutine(8)
infer_history: list[memguard.Attempt] = coroutine.history


class Loop:
    @memguard.oom_retry(batch_size=8)
    def fit(self, batch_size: int) -> int:
        return batch_size

    @memguard.frees_memory
    def step(self, x: int) -> str:
        return str(x)

    @memguard.auto_microbatch(model)
    def loss_of(self, batch: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return model(batch).pow(2).mean() * scale


trainer = Loop()
fitted: int = trainer.fit()
fitted = trainer.fit(4)
trainer.fit("4")  # type: ignore[call-overload]
fit_size: Optional[int] = trainer.fit.batch_size
stepped: str = trainer.step(1)
trainer.step("1")  # type: ignore[arg-type]
step_loss: torch.Tensor = trainer.loss_of(torch.ones(8, 4))
trainer.loss_of(torch.ones(8, 4), "2")  # type: ignore[arg-type]
slice_size: Optional[int] = trainer.loss_of.microbatch_size


# -- frees_memory, bare and with options
@memguard.frees_memory
def step(x: int, *, scale: float = 1.0) -> float:
    return x * scale


@memguard.frees_memory(every=2, max_leak="1GiB")
def step_every(x: int) -> list[int]:
    return [x]


@memguard.frees_memory
def batches(n: int) -> Iterator[int]:
    yield from range(n)


stepped_f: float = step(1, scale=2.0)
step("1")  # type: ignore[arg-type]
step(1, scales=2.0)  # type: ignore[call-arg]
wrong_f: str = step(1)  # type: ignore[assignment]
kept: list[int] = step_every(3)
step_every(3, 4)  # type: ignore[call-arg]
produced: Iterator[int] = batches(3)


# -- memory_scope as a decorator, bare and with options; as a context manager
@memguard.memory_scope
def scoped(x: int) -> bytes:
    return bytes(x)


@memguard.memory_scope("load", cleanup="never")
def loaded(path: str) -> bytes:
    return path.encode()


raw: bytes = scoped(4)
scoped("4")  # type: ignore[arg-type]
read: bytes = loaded("x")
wrong_b: int = loaded("x")  # type: ignore[assignment]
with memguard.memory_scope("block") as scope:
    pass
retained: dict[str, int] = scope.retained


# -- inference_mode as a decorator, bare and with models; as a context manager
@memguard.inference_mode
def predict(x: torch.Tensor) -> torch.Tensor:
    return model(x)


@memguard.inference_mode(model, cleanup="never")
def predict_with(x: torch.Tensor, k: int = 1) -> list[torch.Tensor]:
    return [model(x)] * k


out: torch.Tensor = predict(torch.ones(1, 4))
predict(torch.ones(1, 4), 2)  # type: ignore[call-arg]
outs: list[torch.Tensor] = predict_with(torch.ones(1, 4), k=2)
predict_with(torch.ones(1, 4), k="2")  # type: ignore[arg-type]
mode: memguard.InferenceMode = memguard.inference_mode(model)
with memguard.inference_mode(model):
    pass


# -- auto_microbatch(model): the step's parameters and return type
@memguard.auto_microbatch(model, grow_every=50)
def loss_of(batch: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
    return model(batch).pow(2).mean() * weight


total: torch.Tensor = loss_of(torch.ones(8, 4))
loss_of(torch.ones(8, 4), weight="1")  # type: ignore[arg-type]
wrong_t: str = loss_of(torch.ones(8, 4))  # type: ignore[assignment]
micro: Optional[int] = loss_of.microbatch_size
loss_of.reset(4)


# -- map_batches: a list of fn's results, or what collate returns
lengths: memguard.BatchResults[int] = memguard.map_batches(len, [[1], [2, 3]], batch_size=1)
first: int = lengths[0]
history: list[memguard.Attempt] = lengths.history
joined: str = memguard.map_batches(str, [1, 2, 3], batch_size=2, collate=" ".join)
wrong_m: str = memguard.map_batches(len, [[1]], batch_size=1)  # type: ignore[assignment]


# -- auto_microbatch(trainer): the trainer back, as the class given
class MyTrainer(transformers.Trainer):
    pass


def wrap(trainer: MyTrainer) -> MyTrainer:
    return hf_auto_microbatch(trainer, min_batch_size=2, reduction="sum")


def wrap_wrongly(trainer: MyTrainer) -> None:
    hf_auto_microbatch(trainer, min_size=2)  # type: ignore[call-arg]
    hf_auto_microbatch(trainer, reduction="median")  # type: ignore[arg-type]
