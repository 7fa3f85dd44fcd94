"""``memguard demo``: train a small model under a memory budget, starting too big.

On the best device present (CUDA, MPS, else the CPU) a small network trains on synthetic data
(nothing is downloaded) inside ``memory_limit(budget)``, starting at a batch size that does
not fit: ``oom_retry`` finds one that does, printing each retry as it happens; every epoch
runs in a ``memory_scope`` that tracks tensors, and a ``MemoryMonitor`` records the timeline.
The exit code says whether everything held: a size was found, the epochs finished, memory
did not creep up after the first epoch (64 MiB of slack for the allocators' noise), and no
epoch left a tensor behind. A budget too small for the kernels themselves ends with a message
that says so and what to try, not a traceback.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, Callable, Optional

from ._units import format_bytes, format_table
from .backends import level_field
from .config import memory_limit
from .loop import Attempt
from .monitor import MemoryMonitor
from .retry import oom_retry
from .scope import MemoryScope, memory_scope

FEATURES, HIDDEN, CLASSES = 128, 2048, 10
SAMPLES = 32768
START_BATCH = SAMPLES  # the whole data set in one batch: too big for the default budget
CREEP_TOLERANCE = 64 << 20
# Errors that, under a tight budget, are a failed allocation in disguise: oneDNN (torch's CPU
# kernels) reports scratch memory it could not get as a primitive it could not create.
DISGUISED_OOM = ("could not create a primitive",)


def _say(text: str = "", end: str = "\n") -> None:
    sys.stdout.write(text + end)
    sys.stdout.flush()


def _progress(epoch: int, epochs: int, done: int, total: int, loss: float) -> None:
    width = 24
    filled = int(width * done / total)
    line = (f"  epoch {epoch}/{epochs} [{'#' * filled}{'.' * (width - filled)}] "
            f"{done}/{total} batches  loss {loss:.3f}")
    if sys.stdout.isatty():
        _say("\r" + line, end="" if done < total else "\n")
    elif done == total:
        _say(line)


class _Torch:
    """The torch flavour: an MLP, SGD, cross-entropy."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        if torch.cuda.is_available():  # pragma: gpu
            self.device = "cuda"
        elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            self.device = "mps"
        else:
            self.device = "cpu"
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, HIDDEN), torch.nn.GELU(), torch.nn.Dropout(0.1),
            torch.nn.Linear(HIDDEN, CLASSES)).to(self.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        generator = torch.Generator().manual_seed(0)
        weights = torch.randn(FEATURES, CLASSES, generator=generator)
        self.x = torch.randn(SAMPLES, FEATURES, generator=generator).to(self.device)
        self.y = (self.x.cpu() @ weights).argmax(dim=1).to(self.device)

    @property
    def limit_device(self) -> str:
        return "host" if self.device in ("cpu", "mps") else "cuda"

    def step(self, start: int, stop: int) -> float:
        torch = self.torch
        loss = torch.nn.functional.cross_entropy(self.model(self.x[start:stop]),
                                                 self.y[start:stop])
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


class _TensorFlow:
    """The TensorFlow flavour: the same network in Keras layers, a GradientTape loop."""

    def __init__(self) -> None:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        # oneDNN's CPU allocator pools memory and waits 10 s before reporting an
        # out-of-memory; the plain one fails at once and returns memory to the system.
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
        import tensorflow as tf

        self.tf = tf
        self.device = "GPU" if tf.config.list_physical_devices("GPU") else "cpu"
        tf.random.set_seed(0)
        self.model = tf.keras.Sequential([
            tf.keras.Input((FEATURES,)), tf.keras.layers.Dense(HIDDEN, activation="gelu"),
            tf.keras.layers.Dropout(0.1), tf.keras.layers.Dense(CLASSES)])
        self.optimizer = tf.keras.optimizers.SGD(0.05)
        self.loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        weights = tf.random.normal((FEATURES, CLASSES), seed=1)
        self.x = tf.random.normal((SAMPLES, FEATURES), seed=2)
        self.y = tf.argmax(self.x @ weights, axis=1)

    @property
    def limit_device(self) -> str:
        return "host"

    def step(self, start: int, stop: int) -> float:
        tf = self.tf
        with tf.GradientTape() as tape:
            loss = self.loss(self.y[start:stop], self.model(self.x[start:stop], training=True))
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables, strict=True))
        return float(loss)


def explain_failure(exc: BaseException, budget: int, batch_size: int) -> Optional[str]:
    """What the demo says when ``exc`` is a failed allocation in disguise (see
    ``DISGUISED_OOM``) at ``batch_size`` under ``budget`` bytes; None for any other error.

    >>> text = explain_failure(RuntimeError("could not create a primitive"), 32 << 20, 512)
    >>> text.endswith("a 32.0 MiB budget is too small for this demo; try --budget 256MiB "
    ...               "or more (the default is 768MiB)")
    True
    """
    if not any(text in str(exc) for text in DISGUISED_OOM):
        return None
    larger = max(2 * budget, 256 << 20) >> 20
    return (f"gave up at batch_size={batch_size}: {exc} (oneDNN, torch's CPU kernels, most "
            f"likely could not get scratch memory): a {format_bytes(budget)} budget is too "
            f"small for this demo; try --budget {larger}MiB or more (the default is 768MiB)")


def retry_line(attempt: Attempt) -> str:
    """What the demo prints when ``oom_retry`` retries after ``attempt`` failed.

    >>> retry_line(Attempt(size=4096, ok=False, error="out of memory", seconds=1.5,
    ...                    next_size=1024))
    '  out of memory at batch_size=4096 after 1.50 s; memory freed, retrying at batch_size=1024'
    """
    return (f"  out of memory at batch_size={attempt.size} after {attempt.seconds:.2f} s; "
            f"memory freed, retrying at batch_size={attempt.next_size}")


def run(budget: int, framework: str = "torch", plot: str = "memguard-demo.png",
        epochs: int = 3, say: Callable[..., None] = _say) -> int:
    """Run the demo; returns the exit code (0: everything held)."""
    started = time.perf_counter()
    flavour: Any = _Torch() if framework == "torch" else _TensorFlow()
    say(f"memguard demo: {framework} on {flavour.device}, a {format_bytes(budget)} budget, "
        f"{SAMPLES} samples, starting at batch_size={START_BATCH} (too big on purpose)")
    flavour.step(0, 64)  # warm up: kernels, thread pools and their arenas exist from here on
    scopes: list[MemoryScope] = []
    epoch_number, attempted = [0], [START_BATCH]

    @oom_retry(batch_size=START_BATCH, on_retry=lambda attempt: say(retry_line(attempt)))
    def train_epoch(batch_size: int) -> float:
        epoch, attempted[0] = epoch_number[0], batch_size
        batches = math.ceil(SAMPLES / batch_size)
        loss = float("nan")
        with memory_scope(f"epoch {epoch}", track_tensors=True) as scope:
            for index in range(batches):
                loss = flavour.step(index * batch_size, min(SAMPLES, (index + 1) * batch_size))
                _progress(epoch, epochs, index + 1, batches, loss)
        scopes.append(scope)
        return loss

    ok = True
    ceiling = _ceiling(flavour.limit_device, budget)
    with MemoryMonitor(interval=0.05) as monitor, memory_limit(budget, flavour.limit_device):
        for epoch in range(1, epochs + 1):
            epoch_number[0] = epoch
            monitor.mark(f"epoch {epoch}")
            try:
                train_epoch()
            except MemoryError as exc:
                say(f"  gave up: {exc}")
                ok = False
                break
            except RuntimeError as exc:
                reason = explain_failure(exc, budget, attempted[0])
                if reason is None:
                    raise
                say("  " + reason)
                ok = False
                break
    _summary(say, scopes, monitor, train_epoch.batch_size)
    # The first epoch may keep one-time state (optimizer slots, kernel caches): creep is
    # judged from the end of the first epoch to the end of the last; leaked tensors in every
    # epoch.
    creep = _creep(scopes)
    leaked = [scope for scope in scopes if any(leak.nbytes > 1 << 20 for leak in scope.leaks)]
    if creep:
        say("memory crept up after the first epoch: " + ", ".join(
            f"{device} +{format_bytes(n)}" for device, n in creep.items()))
    ok = (ok and train_epoch.batch_size is not None and not creep and not leaked
          and len(scopes) == epochs)
    if plot:
        try:
            monitor.plot(plot, title=f"memguard demo: {framework} on {flavour.device}",
                         lines=ceiling)
            say(f"timeline written to {plot}")
        except ImportError as exc:
            say(f"no timeline: {exc}")
    say(f"{'everything held' if ok else 'something did not hold'} "
        f"({time.perf_counter() - started:.1f} s)")
    return 0 if ok else 1


def _ceiling(limit_device: str, budget: int) -> dict[str, list[tuple[int, str]]]:
    """The budget as a horizontal line for the timeline: on the host, the resident set at
    the start plus the budget (the limit is on address space, which the resident set cannot
    outgrow); on CUDA, the budget itself."""
    from .snapshot import snapshot

    if limit_device == "host":
        start = snapshot(["host"])["host"].reserved or 0
        return {"host": [(start + budget, f"budget: start + {format_bytes(budget)}")]}
    devices = [d for d in snapshot().devices if d.startswith("cuda")]  # pragma: gpu
    return {devices[0]: [(budget, f"budget {format_bytes(budget)}")]} if devices else {}


def _creep(scopes: list[MemoryScope]) -> dict[str, int]:
    """Devices whose level grew by more than ``CREEP_TOLERANCE`` from the end of the first
    epoch to the end of the last (the resident set on the host, ``allocated`` elsewhere)."""
    if len(scopes) < 2 or scopes[0].after is None or scopes[-1].after is None:
        return {}
    grown = {}
    for device, first in scopes[0].after.devices.items():
        last = scopes[-1].after.devices.get(device)
        field = level_field(device)
        start, end = getattr(first, field), getattr(last, field, None) if last else None
        if start is not None and end is not None and end - start > CREEP_TOLERANCE:
            grown[device] = end - start
    return grown


def _summary(say: Callable[..., None], scopes: list[MemoryScope], monitor: MemoryMonitor,
             final: Any) -> None:
    say()
    events = [label for _, label in monitor.marks if label.startswith("OOM")]
    tried = [label.split("=")[1] for label in events]
    say("batch sizes tried: " + ", ".join(tried + [f"{final} (fits)" if final is not None
                                                   else "none fits"]))
    rows = [("epoch", "peak", "retained", "leaked tensors")]
    for scope in scopes:
        peak = ", ".join(f"{d} {format_bytes(v)}" for d, v in scope.peak.items())
        retained = ", ".join(f"{d} {format_bytes(v)}" for d, v in scope.retained.items())
        big = [leak for leak in scope.leaks if leak.nbytes > 1 << 20]
        rows.append((str(scope.name), peak, retained,
                     "none" if not big else f"{len(big)}: {scope.biggest_leak()}"))
    say(format_table(rows, left=len(rows[0])))
    say("monitor peak: " + ", ".join(f"{d} {format_bytes(v)}" for d, v in monitor.peak.items()))
