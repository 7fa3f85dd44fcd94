"""``memguard demo``: train a small model under a memory budget, starting too big.

A small network trains on synthetic data on the best device present inside
``memory_limit(budget)``; ``oom_retry`` finds a batch size that fits, each epoch runs in a
``memory_scope`` and a ``MemoryMonitor`` records the timeline. The exit code says whether
everything held: a size found, the epochs finished, no creep after the first epoch, no
tensor left behind."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Any, Callable, Optional

from ._units import format_bytes, format_table
from .backends import level_field
from .config import memory_limit
from .errors import is_oom_error, requested_bytes
from .loop import Attempt
from .monitor import MemoryMonitor
from .retry import oom_retry
from .scope import MemoryScope, memory_scope

FEATURES, HIDDEN, CLASSES = 128, 2048, 10
SAMPLES = 32768
START_BATCH = SAMPLES  # the whole data set in one batch: too big for the default budget
CREEP_TOLERANCE = 64 << 20
# Below this the demo's own kernels cannot get the scratch memory they need: measured, 4 MiB
# ends with a clear "too small" at batch 256, 1 KiB now and then crashed inside torch (SIGSEGV)
SMALLEST_BUDGET = 4 << 20
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


def _disguised(exc: BaseException) -> bool:
    return any(text in str(exc) for text in DISGUISED_OOM)


def _out_of_memory(exc: BaseException) -> bool:
    return is_oom_error(exc) or _disguised(exc)


def explain_failure(exc: BaseException, budget: int, batch_size: int) -> Optional[str]:
    """What the demo says when ``exc`` is a failed allocation in disguise (``DISGUISED_OOM``);
    ``None`` for any other error.

    >>> text = explain_failure(RuntimeError("could not create a primitive"), 32 << 20, 512)
    >>> text.endswith("a 32.0 MiB budget is too small for this demo; try --budget 256MiB "
    ...               "or more (the default is 768MiB)")
    True
    """
    if not _disguised(exc):
        return None
    return (f"gave up at batch_size={batch_size}: {exc} (oneDNN, torch's CPU kernels, most "
            f"likely could not get scratch memory): {too_small(budget)}")


def too_small(budget: int) -> str:
    """What the demo suggests when ``budget`` bytes cannot train its smallest batch."""
    larger = max(2 * budget, 256 << 20) >> 20
    return (f"a {format_bytes(budget)} budget is too small for this demo; try --budget "
            f"{larger}MiB or more (the default is 768MiB)")


def retry_line(attempt: Attempt) -> str:
    """What the demo prints when ``oom_retry`` retries after ``attempt`` failed.

    >>> retry_line(Attempt(size=4096, ok=False, error="out of memory", seconds=1.5,
    ...                    next_size=1024))
    '  out of memory at batch_size=4096 after 1.50 s; memory freed, retrying at batch_size=1024'
    """
    return (f"  out of memory at batch_size={attempt.size} after {attempt.seconds:.2f} s; "
            f"memory freed, retrying at batch_size={attempt.next_size}")


@dataclasses.dataclass
class DemoRun:
    """What :func:`train` did: ``ok``, the batch size that fit (or ``None``), the epochs' scopes,
    the ``monitor``, the marks and the horizontal lines for the timeline."""

    framework: str
    device: str
    budget: int
    ok: bool
    batch_size: Optional[int]
    scopes: list[MemoryScope]
    monitor: MemoryMonitor
    marks: list[tuple[float, str]]
    lines: dict[str, list[tuple[int, str]]]


def check_budget(budget: int) -> int:
    """``budget`` if the demo can run under it, else a ``ValueError`` that says why.

    >>> check_budget(1024)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: 1.0 KiB is too small for this demo: under 4.0 MiB torch's own kernels ...
    """
    if budget < SMALLEST_BUDGET:
        raise ValueError(f"{format_bytes(budget)} is too small for this demo: under "
                         f"{format_bytes(SMALLEST_BUDGET)} torch's own kernels cannot get "
                         f"their scratch memory (a crash, not an out-of-memory, at times); the "
                         f"default is 768MiB")
    return budget


def check_plot_path(path: str) -> str:
    """``path`` if the timeline can be written there (checked before training), else a
    ``ValueError`` that says why.

    >>> check_plot_path("/no/such/folder/demo.png")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: cannot write the timeline to '/no/such/folder/demo.png': the folder '/no/su...
    """
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        why = "it is a folder; name a file in it, such as memguard-demo.png"
    elif not os.path.isdir(folder):
        why = f"the folder {folder!r} does not exist; create it first or choose another --plot PATH"
    elif not os.access(folder, os.W_OK):
        why = f"the folder {folder!r} is not writable; choose another --plot PATH"
    else:
        return path
    raise ValueError(f"cannot write the timeline to {path!r}: {why}")


def run(budget: int, framework: str = "torch", plot: str = "memguard-demo.png",
        epochs: int = 3, say: Callable[..., None] = _say) -> int:
    """Run the demo and write its timeline to ``plot`` (if given); the exit code (0: all held)."""
    started = time.perf_counter()
    if plot:
        check_plot_path(plot)
    result = train(budget, framework, epochs, say)
    if plot:
        try:
            timeline(result).savefig(plot, dpi=100)
            say(f"timeline written to {plot}")
        except ImportError as exc:
            say(f"no timeline: {exc}")
    say(f"{'everything held' if result.ok else 'something did not hold'} "
        f"({time.perf_counter() - started:.1f} s)")
    return 0 if result.ok else 1


def train(budget: int, framework: str = "torch", epochs: int = 3,
          say: Callable[..., None] = _say) -> DemoRun:
    """Train under ``budget`` bytes with ``framework`` (``"torch"`` or ``"tensorflow"``) for
    ``epochs``, starting too big, printing through ``say``; a :class:`DemoRun`."""
    check_budget(budget)
    flavour: Any = _Torch() if framework == "torch" else _TensorFlow()
    say(f"memguard demo: {framework} on {flavour.device}, a {format_bytes(budget)} budget, "
        f"{SAMPLES} samples, starting at batch_size={START_BATCH} (too big on purpose)")
    if flavour.limit_device == "host":
        say(f"  (the budget counts address space above the program's size now; the host peak "
            f"reported below is resident memory of the whole process, so it can exceed "
            f"{format_bytes(budget)})")
    flavour.step(0, 64)  # warm up: kernels, thread pools and their arenas exist from here on
    scopes: list[MemoryScope] = []
    epoch_number, attempted = [0], [START_BATCH]
    tries: list[list[Any]] = []  # [epoch, batch size, outcome] for every attempt, in order
    monitor = MemoryMonitor(interval=0.05)

    @oom_retry(batch_size=START_BATCH, on_retry=lambda attempt: say(retry_line(attempt)))
    def train_epoch(batch_size: int) -> float:
        epoch, attempted[0] = epoch_number[0], batch_size
        tries.append([epoch, batch_size, "failed"])
        batches = math.ceil(SAMPLES / batch_size)
        loss = float("nan")
        try:
            with memory_scope(f"epoch {epoch}, batch {batch_size}", track_tensors=True) as scope:
                try:
                    for index in range(batches):
                        loss = flavour.step(index * batch_size,
                                            min(SAMPLES, (index + 1) * batch_size))
                        _progress(epoch, epochs, index + 1, batches, loss)
                except Exception as exc:
                    # Marked where it happens, inside the epoch: oom_retry's own mark comes
                    # after the scope's exit.
                    if _out_of_memory(exc):
                        asked = requested_bytes(exc)
                        monitor.mark(f"out of memory: batch {batch_size}" + (
                            f" asked {format_bytes(asked)}" if asked is not None else ""))
                    raise
        except Exception as exc:  # the scope's own entry or exit may run out of memory too
            if _out_of_memory(exc):
                tries[-1][2] = OOM_MARK
            raise
        tries[-1][2] = "fits"
        scopes.append(scope)
        return loss

    ok = True
    with monitor, memory_limit(budget, flavour.limit_device):
        for epoch in range(1, epochs + 1):
            epoch_number[0] = epoch
            try:
                train_epoch()
            except MemoryError as exc:
                say(f"  gave up: {exc}")
                if attempted[0] == 1:
                    say("  " + too_small(budget))
                ok = False
                break
            except RuntimeError as exc:
                reason = explain_failure(exc, budget, attempted[0])
                if reason is None:
                    raise
                say("  " + reason)
                ok = False
                break
    _summary(say, scopes, monitor, tries)
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
    # The timeline shows each out-of-memory where it happened (inside its epoch), not where
    # oom_retry noted it, after the epoch's exit.
    marks = [mark for mark in monitor.marks if not mark[1].startswith("OOM at ")]
    return DemoRun(framework, flavour.device, budget, ok, train_epoch.batch_size, scopes, monitor,
                   marks, _ceiling(flavour.limit_device, budget))


def timeline(result: DemoRun) -> Any:
    """The demo's timeline (:func:`train`'s ``result``) as a matplotlib ``Figure``: memory per
    device, the host's virtual size against the budget, every mark in order."""
    title = (f"memguard demo: {result.framework} on {result.device}, "
             f"memory_limit {format_bytes(result.budget)}")
    figure = result.monitor.figure(title=title, lines=result.lines, marks=result.marks)
    _highlight_oom(figure, result)
    return figure


OOM_MARK = "out of memory"


def _highlight_oom(figure: Any, result: DemoRun) -> None:
    """Draw each out-of-memory as a red line and label across every panel."""
    start = result.monitor.started or min((t for t, _ in result.marks), default=0.0)
    times = [t - start for t, label in result.marks if label.startswith(OOM_MARK)]
    if not times or not figure.axes:
        return
    from matplotlib.collections import LineCollection

    for ax in figure.axes:  # a collection, not lines: the panels' lines stay the data's
        ax.add_collection(LineCollection(
            [[(x, 0), (x, 1)] for x in times], colors="tab:red", linewidths=1.8, alpha=0.85,
            transform=ax.get_xaxis_transform(), zorder=3, label=OOM_MARK), autolim=False)
    top = figure.axes[0]
    for x in times:
        label = top.annotate(f"\u25bc {OOM_MARK}", xy=(x, 1), xycoords=top.get_xaxis_transform(),
                             xytext=(3, 2), textcoords="offset points", color="tab:red",
                             fontsize=8, fontweight="bold", ha="left", va="bottom")
        label.set_in_layout(False)


def _ceiling(limit_device: str, budget: int) -> dict[str, list[tuple[int, str]]]:
    """The budget as a horizontal line where it caps what is drawn (CUDA's reserved memory; the
    host's address-space limit is drawn by the monitor itself)."""
    if limit_device == "host":
        return {}
    from .snapshot import snapshot  # pragma: gpu

    devices = [d for d in snapshot().devices if d.startswith("cuda")]  # pragma: gpu
    return ({devices[0]: [(budget, f"memory_limit {format_bytes(budget)} (caps reserved)")]}
            if devices else {})  # pragma: gpu


def _creep(scopes: list[MemoryScope]) -> dict[str, int]:
    """Devices whose level grew by more than ``CREEP_TOLERANCE`` from the first epoch's end to
    the last's."""
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


def tried_lines(tries: list[list[Any]]) -> list[str]:
    """The summary's account of every attempt, one line per epoch (alike epochs share one):
    ``epoch 2: 64 out of memory; 32 fits``."""
    epochs: dict[int, list[tuple[int, str]]] = {}
    for epoch, size, outcome in tries:
        epochs.setdefault(epoch, []).append((size, outcome))
    lines: list[tuple[list[int], str]] = []
    for epoch, attempts in epochs.items():
        runs: list[tuple[list[int], str]] = []
        for size, outcome in attempts:
            if runs and runs[-1][1] == outcome:
                runs[-1][0].append(size)
            else:
                runs.append(([size], outcome))
        text = "; ".join(", ".join(map(str, sizes)) + " " + outcome for sizes, outcome in runs)
        if lines and lines[-1][1] == text and lines[-1][0][-1] == epoch - 1:
            lines[-1][0].append(epoch)
        else:
            lines.append(([epoch], text))
    return [(f"  epoch {numbers[0]}: " if len(numbers) == 1 else
             f"  epochs {numbers[0]}-{numbers[-1]}: ") + text for numbers, text in lines]


def _summary(say: Callable[..., None], scopes: list[MemoryScope], monitor: MemoryMonitor,
             tries: list[list[Any]]) -> None:
    say()
    say("batch sizes tried:")
    for line in tried_lines(tries):
        say(line)
    rows = [("epoch", "peak", "retained", "leaked tensors")]
    for scope in scopes:
        peak = ", ".join(f"{d} {format_bytes(v)}" for d, v in scope.peak.items())
        retained = ", ".join(f"{d} {format_bytes(v)}" for d, v in scope.retained.items())
        big = [leak for leak in scope.leaks if leak.nbytes > 1 << 20]
        rows.append((str(scope.name), peak, retained,
                     "none" if not big else f"{len(big)}: {scope.biggest_leak()}"))
    say(format_table(rows, left=len(rows[0])))
    say("monitor peak: " + ", ".join(f"{d} {format_bytes(v)}" for d, v in monitor.peak.items()))
