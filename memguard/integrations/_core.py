"""What the three callbacks share, free of any framework: an epoch (or validation run) is a
``memory_scope`` whose end gives the metrics: ``memory/<device>/peak``, ``.../retained``,
``.../allocated`` (MiB; ``val_memory/...`` for validation), and ``.../step_allocated``,
``.../step_reserved`` for ``log_every_n_steps``."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import sys
from typing import Any, Callable, ClassVar, Iterator, Optional

from .._checks import flag, optional_positive_int
from .._units import Size, parse_optional_size
from ..backends import Backend, resolve_devices
from ..cleanup import Cleanup, cleanup_mode
from ..errors import MemoryLeakError, is_oom_error
from ..loop import Attempt, error_text, memory_summary
from ..scope import MemoryScope, memory_scope
from ..snapshot import MemorySnapshot, snapshot

log = logging.getLogger("memguard")
MiB = float(1 << 20)
TRAIN, VAL = "train", "val"
PREFIX = {TRAIN: "memory", VAL: "val_memory"}


def check_options(max_leak: Optional[Size], track_tensors: Any, cleanup: Any,
                  log_every_n_steps: Any) -> tuple[Optional[int], bool, Cleanup, Optional[int]]:
    """The callbacks' parameters, checked (``ValueError`` or ``TypeError`` naming the value).

    >>> check_options("64MiB", False, "auto", None)
    (67108864, False, 'auto', None)
    """
    who = "MemguardCallback"
    return (parse_optional_size(max_leak, f"{who}: max_leak"),
            flag(track_tensors, "track_tensors", who=who),
            cleanup_mode(cleanup, who),
            optional_positive_int(log_every_n_steps, "log_every_n_steps", who=who))


class Tracker:
    """The scopes of one callback: the open ones by kind (``"train"``, ``"val"``), the count of
    each that ended (the first is the warm-up), the last step and the failures.

    >>> tracker = Tracker("demo", None, False, "auto", None)
    >>> tracker.begin("train")
    >>> sorted(tracker.end("train")[0])[:1]
    ['memory/host/allocated']
    """

    def __init__(self, framework: str, max_leak: Optional[Size], track_tensors: bool,
                 cleanup: Cleanup, log_every_n_steps: Optional[int], run: str = "fit") -> None:
        (self.max_leak, self.track_tensors, self.cleanup,
         self.log_every_n_steps) = check_options(max_leak, track_tensors, cleanup,
                                                 log_every_n_steps)
        self.framework = framework
        self.run = run  # what the framework calls a training run: "fit", "train"
        self.open: dict[str, MemoryScope] = {}
        self.ended: dict[str, int] = {TRAIN: 0, VAL: 0}
        self.scopes: list[MemoryScope] = []  # every closed scope, in order
        self.failures: list[dict[str, Any]] = []
        self.step: Optional[int] = None
        self.batch_size: Optional[int] = None
        self._failed = False  # a failure logged since the last begin of a run
        self._pairs: list[tuple[Backend, str]] = []

    def __getstate__(self) -> dict[str, Any]:
        """Options, finished scopes and failures; not the backends nor an open scope."""
        return dict(self.__dict__, _pairs=[], open={})

    # -- scopes --------------------------------------------------------------------------------
    def begin(self, kind: str) -> None:
        """Open the scope of a training epoch or a validation run."""
        stale = self.open.pop(kind, None)
        if stale is not None:  # its end never came (an exception elsewhere): close it quietly
            self._close_quietly(stale)
        warm = self.ended[kind] >= 1
        number = self.ended[kind] + 1
        name = f"{self.framework} {'epoch' if kind == TRAIN else 'validation'} {number}"
        scope = memory_scope(name, cleanup=self.cleanup, track_tensors=self.track_tensors,
                             max_leak=self.max_leak if warm else None)
        scope.__enter__()
        self.open[kind] = scope
        if not self._pairs:
            self._pairs = resolve_devices(None)

    def end(self, kind: str) -> tuple[dict[str, float], Optional[MemoryLeakError]]:
        """Close the scope of ``kind``: its metrics, and the leak error to raise after logging."""
        scope = self.open.pop(kind, None)
        if scope is None:
            return {}, None
        error: Optional[MemoryLeakError] = None
        try:
            scope.__exit__(None, None, None)
        except MemoryLeakError as exc:
            error = exc
        self.ended[kind] += 1
        self.scopes.append(scope)
        return metrics_of(scope, PREFIX[kind]), error

    def _close_quietly(self, scope: MemoryScope) -> None:
        """Close a failed run's scope: measured, unjudged, no cleanup (Lightning calls
        ``on_exception`` inside ``except``: a collection there frees nothing)."""
        try:
            scope.close(cleanup="never", judge=False)
        except Exception as exc:  # noqa: BLE001 - closing after a failure must not fail
            log.warning("closing %s after a failure failed: %s", scope.name, exc)

    def close_all(self) -> None:
        """Close every open scope unjudged (a failed run)."""
        while self.open:
            self._close_quietly(self.open.popitem()[1])

    # -- steps ---------------------------------------------------------------------------------
    def step_due(self, step: int) -> bool:
        """Whether ``log_every_n_steps`` asks for a reading at ``step``."""
        self.step = step
        n = self.log_every_n_steps
        return n is not None and step % n == 0

    def step_metrics(self) -> dict[str, float]:
        """The cheap readings (``allocated``, ``reserved``: microseconds each), in MiB."""
        if not self._pairs:
            self._pairs = resolve_devices(None)
        out: dict[str, float] = {}
        for backend, device in self._pairs:
            try:
                allocated, reserved = backend.read_fast(device)
            except Exception:  # noqa: BLE001 - a reading never breaks training
                continue
            if allocated is not None:
                out[f"memory/{device}/step_allocated"] = allocated / MiB
            if reserved is not None:
                out[f"memory/{device}/step_reserved"] = reserved / MiB
        return out

    # -- failures ------------------------------------------------------------------------------
    def start_run(self) -> None:
        """A new ``fit``/``train``: close what a failed one left open; warm-up again."""
        if self.open:
            log.warning("%s: the previous run ended inside %s without reaching its end (an "
                        "exception); its measurements are dropped", self.framework,
                        ", ".join(s.name or "" for s in self.open.values()))
            self.close_all()
        self.ended = {TRAIN: 0, VAL: 0}
        self._failed = False

    def failed(self, exc: Optional[BaseException], *, step: Optional[int] = None,
               batch_size: Optional[int] = None, memory: Optional[MemorySnapshot] = None,
               error: Optional[str] = None) -> Optional[dict[str, Any]]:
        """Record an out-of-memory (``exc``, or ``oom_retry``'s ``error``): log it, close the open
        scopes unjudged, warm up again. DEBUG where an ``oom_retry`` logs it already, else WARNING.
        Returns the record, or ``None`` when ``exc`` is not an out-of-memory."""
        oom = exc is None or is_oom_error(exc)
        self.close_all()
        self.ended = {TRAIN: 0, VAL: 0}
        if not oom:
            return None
        if memory is None:
            try:
                memory = snapshot()
            except Exception:  # noqa: BLE001
                memory = None
        step = self.step if step is None else step
        batch_size = self.batch_size if batch_size is None else batch_size
        text = error if error is not None else _error_text(exc)
        record = {"step": step, "batch_size": batch_size, "error": text,
                  "memory": memory.to_dict() if memory is not None else None}
        self.failures.append(record)
        self._failed = True
        level = logging.DEBUG if exc is None or retry_running() else logging.WARNING
        log.log(level, "%s: out of memory during %s at step %s, batch_size=%s (%s); memory at "
                "the failure: %s", self.framework, self.run, _unknown(step),
                _unknown(batch_size), text, memory_summary(memory))
        return record

    def on_retry(self, attempt: Attempt) -> None:
        """For ``oom_retry(on_retry=...)``: record the failure unless seen, at DEBUG."""
        if self._failed:
            self._failed = False
            self.close_all()
            return
        self.failed(None, batch_size=attempt.size, memory=attempt.memory,
                    error=attempt.error or "out of memory")
        self._failed = False


class CallbackBase:
    """What the three ``MemguardCallback`` classes share: parameters, :class:`Tracker`,
    ``scopes``, ``failures``, ``on_retry`` and pickling. Listed before the framework's callback
    base; ``_framework`` names the framework in the log.

    >>> class Demo(CallbackBase):
    ...     _framework = "demo"
    >>> Demo(max_leak="64MiB").failures
    []
    """

    _framework = "memguard"
    #: The framework's objects of the current run that the framework links to the callback
    #: (the trainer, the model): a pickled or copied callback leaves them out (``None``) and
    #: the framework links them again on the next run.
    _run_links: tuple[str, ...] = ()
    _run = "fit"

    def __init__(self, max_leak: Optional[Size] = None, track_tensors: bool = False,
                 cleanup: Cleanup = "auto",
                 log_every_n_steps: Optional[int] = None) -> None:
        super().__init__()
        self._tracker = Tracker(self._framework, max_leak, track_tensors, cleanup,
                                log_every_n_steps, self._run)
        self._init_state()

    def _init_state(self) -> None:
        """Set the subclass's own attributes (nothing here)."""

    def __getstate__(self) -> dict[str, Any]:
        """Options, finished scopes and failures, not the run's links: a copy is ready for a run."""
        state = dict(self.__dict__)
        state.update({name: None for name in self._run_links if name in state})
        return state

    @property
    def scopes(self) -> list[MemoryScope]:
        """Every finished training epoch's and validation run's scope, in order."""
        return self._tracker.scopes

    @property
    def failures(self) -> list[dict[str, Any]]:
        """Every out-of-memory seen, in order, each a dict of ``step``, ``batch_size``,
        ``error`` and ``memory``."""
        return self._tracker.failures

    def on_retry(self, attempt: Attempt) -> None:
        """For ``oom_retry(on_retry=callback.on_retry)``: record the failure and be ready for the
        next attempt.

        Args:
            attempt: the failed :class:`memguard.Attempt` that ``oom_retry`` hands its
                ``on_retry``.
        """
        self._tracker.on_retry(attempt)


class RungCounts:
    """How many batches of a run fitted only with :func:`memguard.auto_microbatch`'s recompute
    or offload rung, for the trainers' logs: ``memory/recomputed_batches`` and
    ``memory/offloaded_batches``, each from the first such batch on. A batch is one call of the
    training step: under gradient accumulation, each of an optimizer step's batches counts.
    Counts, not the last batch's rung, so that a batch between two log entries is not missed.

    >>> from memguard import Attempt
    >>> counts = RungCounts()
    >>> counts.add([Attempt(size=1, ok=False), Attempt(size=1, ok=True, recompute=True)])
    >>> counts.figures()
    {'memory/recomputed_batches': 1.0}
    """

    KEYS: ClassVar[dict[str, str]] = {"recompute": "memory/recomputed_batches",
                                      "offload": "memory/offloaded_batches"}

    def __init__(self) -> None:
        self.counts = dict.fromkeys(self.KEYS, 0)

    def add(self, history: list[Attempt]) -> None:
        """Count the batch whose attempts are ``history`` (the last is the pass that fitted)."""
        if history and history[-1].ok:
            for rung in self.counts:
                self.counts[rung] += bool(getattr(history[-1], rung))

    def figures(self) -> dict[str, float]:
        """The log entries: each count that is not zero, under its key."""
        return {key: float(self.counts[rung]) for rung, key in self.KEYS.items()
                if self.counts[rung]}


def metrics_of(scope: MemoryScope, prefix: str = "memory") -> dict[str, float]:
    """``{"memory/host/peak": MiB, ...}`` of a closed scope; unknown figures left out."""
    out: dict[str, float] = {}
    for device, peak in scope.peak.items():
        if peak is not None:
            out[f"{prefix}/{device}/peak"] = peak / MiB
    for device, kept in scope.retained.items():
        out[f"{prefix}/{device}/retained"] = kept / MiB
    if scope.after is not None:
        for device, mem in scope.after.devices.items():
            if mem.allocated is not None:
                out[f"{prefix}/{device}/allocated"] = mem.allocated / MiB
    return dict(sorted(out.items()))


def retry_running() -> bool:
    """Whether an ``oom_retry`` call (which logs each out-of-memory) runs in this thread or task."""
    from ..loop import running

    return running()


def _error_text(exc: Optional[BaseException]) -> str:
    """The out-of-memory's text as ``oom_retry`` writes it into ``Attempt.error``."""
    return "out of memory" if exc is None else error_text(exc)


def _unknown(value: Any) -> str:
    return "unknown" if value is None else str(value)


def missing(package: str, extra: str, what: str) -> ImportError:
    """The ``ImportError`` of an integration whose framework is not installed."""
    return ImportError(f"memguard.integrations.{extra} needs {what}, which is not installed: "
                       f'pip install "memguard-ml[{extra}]" (or pip install {package})')


# -- what a split step's slices are weighted by ------------------------------------------------
def token_weight(shifts: bool, told: Optional[Callable[[str], None]] = None
                 ) -> Callable[[Any], Any]:
    """The trainers' default ``weight``: in a mapping batch, the ``shift_labels`` (else
    ``labels``, shifted when ``shifts``) that are not -100; otherwise the samples. ``told`` is
    called once with what is counted.

    >>> import torch
    >>> weight = token_weight(shifts=True)
    >>> int(weight({"labels": torch.tensor([[1, 2, 5, -100], [3, 4, -100, -100]])}))
    3
    """
    said: list[bool] = []

    def weight(batch: Any) -> Any:
        if not hasattr(batch, "keys"):
            return samples_in(batch)
        if "shift_labels" in batch:
            what, labels = "shift_labels", batch["shift_labels"]
        elif "labels" in batch and hasattr(batch["labels"], "ne"):
            what, labels = "labels", batch["labels"]
            if shifts and labels.dim() > 1:
                what, labels = "labels[..., 1:]", labels[..., 1:]
        else:
            return samples_in(batch)
        if told is not None and not said:
            said.append(True)
            told(what)
        return labels.ne(-100).sum()

    return weight


@contextlib.contextmanager
def probing(module: Any) -> Iterator[None]:
    """``module`` in eval mode, without gradients, the RNGs (torch, ``random``, numpy) forked:
    a forward the run does not see. Each submodule's mode is put back."""
    import torch

    modes = [(m, m.training) for m in module.modules()]
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    python = random.getstate()
    numpy = sys.modules.get("numpy")
    drawn = numpy.random.get_state() if numpy is not None else None
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        module.eval()
        try:
            yield
        finally:
            for m, training in modes:
                m.training = training
            random.setstate(python)
            if numpy is not None:
                numpy.random.set_state(drawn)


def padded_labels(batch: Any) -> Optional[Callable[[Any], Any]]:
    """A count of the entries not -100 of the one integer tensor (2+ dimensions) holding -100 in
    ``batch``, for it and its slices; ``None`` where there is none or several.

    >>> import torch
    >>> count = padded_labels({"x": torch.ones(2, 3), "y": torch.tensor([[1, -100], [2, 3]])})
    >>> int(count({"x": torch.ones(1, 3), "y": torch.tensor([[2, 3]])}))
    2
    """
    found = padded_paths(batch)
    if len(found) != 1:
        return None
    path = found[0]

    def count(piece: Any) -> Any:
        for attribute, key in path:
            piece = getattr(piece, key) if attribute else piece[key]
        return piece.ne(-100).sum()

    return count


def padded_paths(batch: Any) -> list[tuple[Any, ...]]:
    """The paths (``(is_attribute, key)`` steps) of such tensors; the first two at most.

    >>> import torch
    >>> padded_paths({"x": torch.ones(2, 3), "y": torch.tensor([[1, -100], [2, 3]])})
    [((False, 'y'),)]
    """
    found: list[tuple[Any, ...]] = []

    def walk(value: Any, path: tuple[Any, ...]) -> None:
        if len(path) > 3 or len(found) > 1:
            return
        if hasattr(value, "dtype") and hasattr(value, "ne") and hasattr(value, "dim"):
            if value.dim() >= 2 and not value.is_floating_point() \
                    and not value.is_complex() and bool((value == -100).any()):
                found.append(path)
            return
        if hasattr(value, "keys") and hasattr(value, "__getitem__"):
            for key in list(value.keys()):
                walk(value[key], (*path, (False, key)))
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, (*path, (False, index)))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                walk(getattr(value, field.name), (*path, (True, field.name)))

    walk(batch, ())
    return found


#: What :func:`averaged_over` returns where a batch without unlabelled samples matches a mean
#: over samples: a mean over all samples and one over the samples with any label weight its
#: slices alike; the first batch with an unlabelled sample tells them apart.
SAMPLES_OR_LABELLED = "samples or labelled"


def averaged_over(loss: Callable[[int, int], float], tokens: Callable[[int, int], float],
                  length: int, most: int = 4, known: Optional[str] = None) -> Optional[str]:
    """What a loss's own mean is over, from ``loss(i, j)`` (samples ``i:j`` of ``length``) and
    ``tokens(i, j)``: the loss of up to ``most`` samples together is predicted from their single
    losses weighted by tokens, alike, or alike over the labelled ones; the match wins.
    ``"tokens"``, ``"samples"``, ``"labelled"``; ``"either"`` where this batch cannot tell
    them apart; :data:`SAMPLES_OR_LABELLED` (also ``known``, an earlier batch's answer, given
    back at once where this batch cannot tell more); ``None`` where none or several match.

    >>> values, counts = [2.0, 4.0], [1, 3]
    >>> def token_mean(i, j):
    ...     return sum(v * c for v, c in zip(values[i:j], counts[i:j])) / sum(counts[i:j])
    >>> averaged_over(token_mean, lambda i, j: sum(counts[i:j]), 2)
    'tokens'
    """
    n = min(length, most)
    if n < 2:
        return None
    counts = [tokens(i, i + 1) for i in range(length)]  # no forward: cheap
    if any(count < 0 for count in counts):
        return None
    if len(set(counts)) == 1:
        return "either"  # equal counts: every mean weights this batch alike
    mixed = 0 in counts  # a sample without tokens: all samples and labelled ones differ
    if known == SAMPLES_OR_LABELLED and not mixed:
        return known
    uneven = len({count for count in counts if count > 0}) > 1  # tokens and labelled differ

    def tells(part: list[float]) -> bool:
        return (len(set(part)) > 1 and (not mixed or (0 in part and max(part) > 0))
                and (not uneven or len({count for count in part if count > 0}) > 1))

    first = next((i for i in range(length - n + 1) if tells(counts[i:i + n])),
                 next(i for i in range(length - n + 1) if len(set(counts[i:i + n])) > 1))
    window = counts[first:first + n]
    singles = [loss(i, i + 1) for i in range(first, first + n)]
    whole = loss(first, first + n)
    counted = [(value, count) for value, count in zip(singles, window, strict=True)
               if count > 0]
    if not math.isfinite(whole) or not counted \
            or any(not math.isfinite(value) for value, _ in counted):
        return None
    scale = max(abs(whole), 1e-12)
    predicted = {"tokens": sum(v * c for v, c in counted) / sum(c for _, c in counted),
                 "labelled": sum(v for v, _ in counted) / len(counted)}
    if all(math.isfinite(value) for value in singles):
        # a sample without tokens may have no mean of its own (0/0): no mean over samples
        predicted["samples"] = sum(singles) / n
    matched = set()
    for unit, value in predicted.items():
        gaps = [abs(value - other) for other in predicted.values()
                if abs(value - other) > 1e-4 * scale]
        if abs(whole - value) <= (0.05 * min(gaps) if gaps else 1e-3 * scale):
            matched.add(unit)
    if len(matched) == 1:
        return matched.pop()
    # several match: where they weight every sample of the batch alike, this batch is
    # weighted right either way
    if matched == {"tokens", "labelled"} and not uneven:
        return "either"
    if matched == {"samples", "labelled"} and not mixed:
        return SAMPLES_OR_LABELLED
    return None


def read_mean(loss: Callable[[int, int], float], tokens: Callable[[int, int], float],
              length: int, known: Optional[str] = None) -> Optional[str]:
    """:func:`averaged_over` on four samples, else two where four run out of memory."""
    for most in (4, 2):
        try:
            return averaged_over(loss, tokens, length, most, known)
        except Exception as error:
            if not is_oom_error(error):
                raise
    return None


def labelled_samples(tokens: Callable[[Any], Any]) -> Callable[[Any], int]:
    """The weight of a mean over the labelled samples: those whose ``tokens`` count is above 0.

    >>> import torch
    >>> weight = labelled_samples(token_weight(shifts=False))
    >>> weight({"labels": torch.tensor([[1, -100], [-100, -100], [2, 3]])})
    2
    """
    from .._slices import plan_batch

    def weight(piece: Any) -> int:
        plan = plan_batch(piece)
        return sum(1 for i in range(int(plan.length or 0))
                   if float(tokens(plan.cut(piece, i, i + 1))) > 0)

    return weight


def failure_text(error: BaseException) -> str:
    """A failed probe's error in one line (an out-of-memory as ``oom_retry`` writes it)."""
    if is_oom_error(error):
        return error_text(error)
    lines = str(error).strip().splitlines()
    line = lines[0] if lines else ""
    return f"{type(error).__name__}: {line[:200]}" if line else type(error).__name__


def causal_lm(module: Any) -> bool:
    """Whether ``module`` is a Hugging Face causal LM (its loss shifts the labels)."""
    if "transformers" not in sys.modules:
        return False
    try:
        from ._transformers_compat import causal_lm_loss

        config = getattr(module, "config", None)
        return (getattr(module, "loss_function", None) is causal_lm_loss()
                and not getattr(config, "is_encoder_decoder", False))
    except Exception:  # noqa: BLE001 - an unknown model: its labels are not shifted
        return False


def samples_in(batch: Any) -> int:
    """The samples of ``batch`` (its length along the batch dimension)."""
    from .._slices import plan_batch

    return int(plan_batch(batch).length or 0)


__all__ = ["SAMPLES_OR_LABELLED", "CallbackBase", "Tracker", "averaged_over", "causal_lm",
           "check_options", "failure_text", "labelled_samples", "metrics_of", "missing",
           "padded_labels", "padded_paths", "probing", "read_mean", "retry_running",
           "samples_in", "token_weight"]
