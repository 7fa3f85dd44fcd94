"""``MemguardCallback`` for PyTorch Lightning (``pip install "memguard-ml[lightning]"``).

>>> import pytorch_lightning as pl                                      # doctest: +SKIP
>>> from memguard.integrations.lightning import MemguardCallback        # doctest: +SKIP
>>> trainer = pl.Trainer(callbacks=[MemguardCallback(max_leak="256MiB")])  # doctest: +SKIP

With ``microbatch=True`` an out-of-memory in ``training_step`` or its backward redoes the batch
in slices within the same optimizer step. Lightning's automatic optimisation runs
``training_step``, then ``zero_grad`` (on the first batch of an accumulation window), then
backward of the returned loss. The callback therefore replaces the module's ``training_step``
for the run with one that runs :func:`memguard.auto_microbatch` (forward and backward of every
slice) with the parameters' gradients moved aside, takes the new gradients away, puts the old
ones back and returns the whole batch's loss as a *carrier*: a tensor whose backward hands the
new gradients to the parameters. Lightning's ``zero_grad`` then clears what it always clears,
and its backward (scaled by ``1 / accumulate_grad_batches``, inside DDP's reducer where DDP
averages) writes exactly what backward of the unsplit loss would have.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import types
from typing import Any, Callable, Iterator, Optional

from .._units import Size
from ..backends.steps import torch_fsdp
from ..cleanup import Cleanup
from ..distributed import Sync
from ..loop import Attempt, Factor
from ..microbatch import Reduction, auto_microbatch
from ._core import (
    SAMPLES_OR_LABELLED,
    TRAIN,
    VAL,
    CallbackBase,
    causal_lm,
    failure_text,
    labelled_samples,
    missing,
    padded_labels,
    padded_paths,
    probing,
    read_mean,
    samples_in,
    token_weight,
)

try:  # the standalone package first: it is what memguard-ml[lightning] installs
    import pytorch_lightning as _pl
except ImportError:
    try:
        import lightning.pytorch as _pl  # type: ignore[no-redef]
    except ImportError:
        raise missing("pytorch-lightning", "lightning", "PyTorch Lightning") from None

import torch

log = logging.getLogger("memguard")
#: The key of the microbatch size in the module's logged metrics.
MICROBATCH_KEY = "memory/microbatch_size"
#: ``auto_microbatch``'s options that ``MemguardCallback(microbatch=True, ...)`` passes on.
MICROBATCH_OPTIONS = ("min_batch_size", "factor", "max_attempts", "on_retry", "sync",
                      "reduction", "weight", "grow_every", "recompute", "cost")


class MemguardCallback(CallbackBase, _pl.Callback):
    """Memory of every training epoch and validation run, logged through
    ``LightningModule.log`` (so every Lightning logger gets it).

    Each training epoch and each validation run (not the sanity check) is a
    :func:`memguard.memory_scope`; at its end ``memory/<device>/peak``, ``.../retained`` and
    ``.../allocated`` (MiB; ``val_memory/...`` for validation) are logged. ``log_every_n_steps``
    adds ``memory/<device>/step_allocated`` and ``step_reserved`` every N optimizer steps
    (readings that cost microseconds). ``max_leak`` (bytes or ``"256MiB"``): from the second
    epoch on (the first is the warm-up), an epoch that retains more raises
    :class:`memguard.MemoryLeakError`, naming the biggest leaked tensors and their holders with
    ``track_tensors=True``. ``cleanup`` is the scope's policy at each epoch's end (``"auto"``,
    ``"always"`` or ``"never"``, as for ``memory_scope``); nothing is done per step.

    An out-of-memory during ``fit`` is kept in ``failures`` with the memory at the failure,
    the batch size and the step, and logged once: at WARNING on the ``memguard`` logger, or at
    DEBUG inside an ``oom_retry``, whose WARNING retry line reports it; the open
    scopes are closed and the warm-up starts again, so ``oom_retry`` around ``fit`` can run
    again. Pass ``on_retry=callback.on_retry`` to ``oom_retry``: it readies the callback (the
    next ``fit`` would too). ``scopes`` holds every finished scope.

    Args:
        max_leak: from the second epoch on, the most an epoch may retain on a device, in bytes
            or a size such as ``"256MiB"``; ``None`` judges nothing.
        track_tensors: name the biggest leaked tensors and their holders in the error.
            Default ``False``.
        cleanup: the epoch scope's policy at each epoch's end: ``"auto"``, ``"always"`` or
            ``"never"``.
        log_every_n_steps: also log ``step_allocated`` and ``step_reserved`` every N steps;
            ``None`` for epochs only.
        microbatch: recover from an out-of-memory inside each training step: the batch is
            redone in slices within the same optimizer step, with the unsplit step's
            gradients (see below). Needs automatic optimisation. Default ``False``.
        min_batch_size: with ``microbatch=True``, the smallest slice size tried, in samples.
            Default ``None``: :func:`memguard.auto_microbatch`'s (1).
        factor: with ``microbatch=True``, the next slice size is ``floor(size * factor)``;
            ``"auto"`` measures it; a callable ``size -> next size`` decides. Default
            ``None``: :func:`memguard.auto_microbatch`'s (0.5).
        max_attempts: with ``microbatch=True``, the most passes over one batch. Default
            ``None``: until ``min_batch_size``.
        on_retry: with ``microbatch=True``, called with each failed :class:`memguard.Attempt`
            after the cleanup. Default ``None``: nothing is called.
        sync: with ``microbatch=True``, agree with the other ranks after each pass
            (``"auto"``, ``True``, ``False``). Default ``None``: ``"auto"``.
        reduction: with ``microbatch=True``, ``"mean"`` or ``"sum"``, what the loss is over
            its samples. Default ``None``: ``"mean"``.
        weight: with ``microbatch=True``, a callable taking a slice and returning the count
            its loss averages over (tokens). Default ``None``: see below.
        grow_every: with ``microbatch=True``, try the next larger slice size after this many
            steps without an out-of-memory. Default ``None``: never.
        recompute: with ``microbatch=True``, recompute activations when one slice of
            ``min_batch_size`` still runs out of memory. Default ``None``:
            :func:`memguard.auto_microbatch`'s (``True``).
        cost: with ``microbatch=True``, a callable taking a batch and returning what it costs
            in memory (its tokens, say): slices are planned in it. Default ``None``: the
            elements of the batch's tensors.

    With ``microbatch=True``, for the length of each ``fit`` the module's ``training_step``
    runs under :func:`memguard.auto_microbatch`: an out-of-memory (:func:`memguard.is_oom_error`)
    in ``training_step`` or in backward drops the pass's gradients, frees memory and redoes
    the same batch in slices along dim 0 (the size that fitted is kept for later batches);
    the gradients written are those of backward of the whole batch's loss, with
    ``accumulate_grad_batches``, gradient clipping, ``precision="bf16-mixed"``,
    ``"16-mixed"`` (memguard's backward scaled by the precision plugin's ``GradScaler``) and
    ``strategy="ddp"`` (ranks agree after every pass on memguard's gloo group, so one rank's
    out-of-memory hangs no one; DDP averages the gradients once, in Lightning's backward).
    ``training_step`` must return the loss (a scalar tensor, or a dict with ``"loss"``; the
    dict's other entries are those of the last slice; ``None`` skips the whole batch), a
    mean over the batch's samples (``reduction="mean"``), a sum (``"sum"``) or a mean over
    what ``weight`` counts (tokens). Without ``weight``, where the batch holds labels padded
    with -100 (``labels``, over ``labels[..., 1:]`` for a Hugging Face causal language model
    in the module, or the one integer tensor with -100 in it), what the loss's own mean is
    over is read at the first split from ``training_step`` on four samples alone and together
    (the first four from the first two neighbours whose label counts differ; a batch whose
    samples all count as many waits for the next split; eval mode, no gradients, its logs,
    metric updates and random draws undone): a mean over
    tokens weighs each slice by its labels that are not -100, a mean over samples by its
    samples (logged at INFO); other batches are weighted by samples. The trained parameters
    are read at every step (a layer unfrozen during the fit trains). Values the step logs with
    ``self.log`` are held back: a pass that ran out of memory logs nothing (and the module's
    torchmetrics states are put back before it is redone); the pass that counts logs once
    per slice (pass ``batch_size=`` the slice's size for exact epoch means). The slice size of
    each step (the batch's size when unsplit) is logged as ``memory/microbatch_size``
    through the module's ``log``; ``microbatch_size`` holds the size that fitted. That size
    is kept in the callback's state in every checkpoint (``state_dict``), and a fit resumed
    from one (``ckpt_path=``), or a later ``fit`` with the same callback, starts from it.

    Raises:
        MemoryLeakError: at the end of an epoch (after the first) that retained more than
            ``max_leak``.
        ValueError: a bad ``max_leak``, ``cleanup`` or ``log_every_n_steps`` (a ``TypeError``
            for one of the wrong type), named with its
            value; with ``microbatch=True``, a module with ``automatic_optimization = False``
            (at ``fit``: call :func:`memguard.auto_microbatch` in its ``training_step``).
        TypeError: ``auto_microbatch``'s options without ``microbatch=True``.
        OutOfMemoryError: during ``fit``, when the smallest slice runs out of memory too.

    >>> from memguard.integrations.lightning import MemguardCallback
    >>> callback = MemguardCallback(max_leak="256MiB", log_every_n_steps=50)
    >>> callback.failures
    []
    >>> steps = MemguardCallback(microbatch=True, min_batch_size=2, factor=0.5)
    >>> steps.microbatch_size is None
    True
    """

    _framework = "lightning"
    _run_links = ("log", "log_dict")  # the LightningModule's, attached by Lightning at fit

    def __init__(self, max_leak: Optional[Size] = None, track_tensors: bool = False,
                 cleanup: Cleanup = "auto", log_every_n_steps: Optional[int] = None, *,
                 microbatch: bool = False, min_batch_size: Optional[int] = None,
                 factor: Optional[Factor] = None, max_attempts: Optional[int] = None,
                 on_retry: Optional[Callable[[Attempt], object]] = None,
                 sync: Optional[Sync] = None, reduction: Optional[Reduction] = None,
                 weight: Optional[Callable[[Any], Any]] = None,
                 grow_every: Optional[int] = None,
                 recompute: Optional[bool] = None,
                 cost: Optional[Callable[[Any], Any]] = None) -> None:
        super().__init__(max_leak, track_tensors, cleanup, log_every_n_steps)
        if not isinstance(microbatch, bool):
            raise TypeError(f"MemguardCallback: microbatch must be True or False, got "
                            f"{microbatch!r}")
        given = dict(min_batch_size=min_batch_size, factor=factor, max_attempts=max_attempts,
                     on_retry=on_retry, sync=sync, reduction=reduction, weight=weight,
                     grow_every=grow_every, recompute=recompute, cost=cost)
        options: dict[str, Any] = {name: value for name, value in given.items()
                                   if value is not None}
        if options and not microbatch:
            raise TypeError(f"MemguardCallback: {', '.join(sorted(options))} are "
                            f"auto_microbatch's options: pass microbatch=True with them")
        if microbatch:  # checked now, not at fit: auto_microbatch checks its options early
            auto_microbatch(torch.nn.Linear(1, 1), **options)
        self.microbatch = microbatch
        self._options = dict(options)

    def _init_state(self) -> None:
        self._step: Any = None  # this fit's auto_microbatch step
        self._module: Any = None  # the module whose training_step is replaced
        self._last_size: Optional[int] = None
        self._size: Optional[int] = None  # the size that fitted, kept after the fit

    def __getstate__(self) -> dict[str, Any]:
        return dict(super().__getstate__(), _step=None, _module=None)

    @property
    def microbatch_size(self) -> Optional[int]:
        """The slice size that fitted (``None`` until a batch had to be split, or without
        ``microbatch=True``)."""
        if self._step is not None and self._step.microbatch_size is not None:
            return self._step.microbatch_size
        return self._size

    def state_dict(self) -> dict[str, Any]:
        """Lightning's callback state, saved with each checkpoint: the slice size learned, so
        that a fit resumed from the checkpoint starts from it."""
        return {"microbatch_size": self.microbatch_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Start from the slice size a checkpoint kept (see :meth:`state_dict`).

        Args:
            state_dict: what :meth:`state_dict` returned when the checkpoint was saved; a
                ``microbatch_size`` that is not a positive int is ignored.
        """
        size = state_dict.get("microbatch_size")
        if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
            self._size = size
            if self._step is not None:
                self._step.reset(size)

    # -- Lightning's hooks ---------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._tracker.start_run()
        self._tracker.batch_size = _batch_size(trainer, pl_module)
        if self.microbatch:
            self._install(pl_module, trainer)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._uninstall()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._uninstall()

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._tracker.begin(TRAIN)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._end(TRAIN, pl_module)

    def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self._tracker.begin(VAL)

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self._end(VAL, pl_module)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._last_size is not None:
            pl_module.log(MICROBATCH_KEY, float(self._last_size), on_step=True,
                          on_epoch=False, batch_size=1)
            self._last_size = None
        if self._tracker.step_due(trainer.global_step):
            for key, value in self._tracker.step_metrics().items():
                pl_module.log(key, value, on_step=True, on_epoch=False, batch_size=1)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._uninstall()
        self._tracker.failed(exception, step=trainer.global_step,
                             batch_size=_batch_size(trainer, pl_module))

    def _end(self, kind: str, pl_module: Any) -> None:
        metrics, error = self._tracker.end(kind)
        for key, value in metrics.items():
            pl_module.log(key, value, on_step=False, on_epoch=True)
        if error is not None:
            raise error

    # -- microbatch=True -----------------------------------------------------------------------
    def _install(self, pl_module: Any, trainer: Any = None) -> None:
        """Replace ``pl_module.training_step`` (an attribute of the instance, shadowing the
        class's method) for this fit."""
        self._uninstall()
        if not getattr(pl_module, "automatic_optimization", True):
            raise ValueError(
                f"MemguardCallback(microbatch=True) needs automatic optimisation, but "
                f"{type(pl_module).__name__}.automatic_optimization is False: there the "
                f"step runs backward itself; decorate the loss computation inside "
                f"training_step with memguard.auto_microbatch(self) and call "
                f"optimizer.step() after it")
        original = pl_module.training_step
        extras: dict[str, Any] = {}
        logs = _HeldLogs(pl_module)
        metrics = _MetricStates(pl_module)
        options = dict(self._options)
        # 16-mixed: memguard's backward is scaled as Lightning scales its own
        plugin = getattr(trainer, "precision_plugin", None)
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None:
            options["scaler"] = scaler
        call: list[tuple[tuple, dict]] = [((), {})]  # the step's other arguments, for probes
        if options.get("reduction", "mean") == "mean" and options.get("weight") is None:
            options["weight"] = _default_weight(pl_module, original, logs, call)
        user_retry = options.get("on_retry")

        def on_retry(attempt: Attempt) -> None:
            logs.drop()  # the failed pass leaves no trace in what is logged
            metrics.load()
            if user_retry is not None:
                user_retry(attempt)

        options["on_retry"] = on_retry

        def training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
            output = original(batch, *args, **kwargs)
            if output is None:  # Lightning's way to skip a batch
                raise _Skipped
            if isinstance(output, dict) and "loss" in output:
                extras.clear()
                extras.update((k, v.detach() if isinstance(v, torch.Tensor) else v)
                              for k, v in output.items() if k != "loss")
                return output["loss"]
            return output

        training_step.__name__ = training_step.__qualname__ = (
            f"{type(pl_module).__name__}.training_step")
        step = auto_microbatch(pl_module, **options)(training_step)
        if self._size is not None:  # learned in an earlier fit, or kept in the checkpoint
            step.reset(self._size)
        callback = self

        def replaced(module: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
            extras.clear()
            # read at every step: a layer unfrozen during the fit trains from then on
            params = [p for p in module.parameters() if p.requires_grad]
            entry = [p.grad for p in params]
            for p in params:
                p.grad = None
            call[0] = (args, kwargs)
            try:
                metrics.save()
                with logs.held():
                    loss = step(batch, *args, **kwargs)
                grads = [p.grad for p in params]
            except _Skipped:  # the step returned None: Lightning skips the batch
                logs.replay()
                return None
            finally:
                for p, grad in zip(params, entry, strict=True):
                    p.grad = grad
            logs.replay()
            history = step.history
            callback._last_size = history[-1].size if history else None
            # memguard's backward was scaled by the scaler's scale; Lightning's backward of
            # the carrier scales it again
            scale = float(scaler.get_scale()) if scaler is not None else 1.0
            carrier = _carrier(loss, params, grads, scale)
            if extras:
                return dict(extras, loss=carrier)
            return carrier

        pl_module.training_step = types.MethodType(replaced, pl_module)
        self._step, self._module = step, pl_module

    def _uninstall(self) -> None:
        """Give the module its own ``training_step`` back."""
        module, self._module = self._module, None
        if self._step is not None and self._step.microbatch_size is not None:
            self._size = self._step.microbatch_size
        if module is not None and "training_step" in vars(module):
            del module.training_step


class _Skipped(Exception):
    """``training_step`` returned ``None`` (for any slice): the whole batch is skipped, its
    slices' gradients dropped, as Lightning skips a batch whose step returns ``None``."""


class _Carrier(torch.autograd.Function):
    """The whole batch's loss (its value) whose backward hands gradients computed already
    (scaled by ``scale``, a GradScaler's) to the parameters, scaled by the gradient that
    reaches it divided by ``scale``."""

    @staticmethod
    def forward(ctx: Any, loss: Any, grads: list[Any], scale: float, *params: Any) -> Any:
        ctx.grads, ctx.scale = grads, scale
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        grads, ctx.grads = ctx.grads, None  # handed over once: the carrier frees them
        if grads is None:
            raise RuntimeError("the loss MemguardCallback(microbatch=True) returned from "
                               "training_step was backpropagated twice: its gradients are "
                               "handed to the parameters once")
        if ctx.scale != 1.0:
            grad = grad / ctx.scale
        if bool((grad == 1).all()):
            return (None, None, None, *grads)
        return (None, None, None, *(g * grad.to(g.dtype) for g in grads))


def _carrier(loss: Any, params: list[Any], grads: list[Any], scale: float = 1.0) -> Any:
    """``loss`` (detached), carrying ``grads`` (scaled by ``scale``) into ``params`` at its
    backward."""
    used = [(p, g) for p, g in zip(params, grads, strict=True) if g is not None]
    if not used:
        return loss
    return _Carrier.apply(loss.detach(), [g for _, g in used], scale,
                          *(p for p, _ in used))


class _HeldLogs:
    """The ``self.log`` calls of a step's passes, held back: those of a pass that ran out of
    memory are dropped, those of the pass that succeeded are made once it ends, in order, so
    that what is logged (epoch means, ``batch_size`` weights) is what the slices that count
    logged. ``log_dict`` goes through ``log``."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.calls: list[tuple[tuple, dict]] = []

    def record(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("enable_graph", False):
            value = _detached(value)
        self.calls.append(((name, value, *args), kwargs))

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """While the step's passes run, ``module.log`` records."""
        self.calls.clear()
        module = self.module
        had = "log" in vars(module)
        before = vars(module).get("log")
        module.log = self.record
        try:
            yield
        finally:
            if had:
                module.log = before
            else:
                del module.log

    def drop(self) -> None:
        """Forget the calls of a failed pass."""
        self.calls.clear()

    def replay(self) -> None:
        """Make the recorded calls, through the module's own ``log``."""
        calls, self.calls = self.calls, []
        for args, kwargs in calls:
            self.module.log(*args, **kwargs)


class _MetricStates:
    """The states of the module's torchmetrics ``Metric`` s, saved when a step starts and
    put back before a pass that ran out of memory is redone, so that a metric updated in
    ``training_step`` counts each sample once (nothing where torchmetrics is not in use)."""

    def __init__(self, module: Any) -> None:
        self.metrics: list[Any] = []
        if "torchmetrics" in sys.modules:
            from torchmetrics import Metric

            self.metrics = [m for m in module.modules() if isinstance(m, Metric)]
        self.saved: list[tuple[Any, dict[str, Any], tuple]] = []

    def save(self) -> None:
        self.saved = [(m, {name: _copied(getattr(m, name)) for name in m._defaults},  # noqa: SLF001
                       (m._update_count, m._computed, m._forward_cache))  # noqa: SLF001
                      for m in self.metrics]

    def load(self) -> None:
        for metric, states, (count, computed, cache) in self.saved:
            for name, value in states.items():
                setattr(metric, name, _copied(value))
            metric._update_count, metric._computed = count, computed  # noqa: SLF001
            metric._forward_cache = cache  # noqa: SLF001


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_copied(v) for v in value]
    return value


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def _default_weight(module: Any, step: Callable[..., Any], logs: _HeldLogs,
                    call: list[tuple[tuple, dict]]) -> Callable[[Any], Any]:
    """What ``weight`` is when none is given, chosen at the first split from the whole
    batch: where it holds labels padded with -100 (``labels``, shifted when the module holds
    a Hugging Face causal language model, or the one integer tensor with -100 in it), the
    loss's own mean is read off ``training_step`` (``step``, run in eval mode without
    gradients on four samples alone and together, its ``self.log`` calls and metric updates
    undone; see :func:`~memguard.integrations._core.averaged_over`): by the labels that
    are not -100 for a mean over tokens, by samples for a mean over samples. Logged."""
    shifts = any(causal_lm(m) for m in module.modules())
    named = token_weight(shifts)
    chosen: list[Callable[[Any], Any]] = []
    # a step's batch that could not tell (no padding, equal counts): its call and weight,
    # read again at the next split
    undecided: list[tuple[Any, Callable[[Any], Any]]] = []
    known: list[str] = []  # SAMPLES_OR_LABELLED once a batch said so

    def weight(piece: Any) -> Any:
        if chosen:
            return chosen[0](piece)
        if undecided and undecided[0][0] is call[0]:
            return undecided[0][1](piece)
        counted, final = _weight_for(module, step, logs, call[0], piece, named, shifts, known)
        if final:
            chosen.append(counted)
        else:
            undecided[:] = [(call[0], counted)]
        return counted(piece)

    return weight


def _weight_for(module: Any, step: Callable[..., Any], logs: _HeldLogs,
                call: tuple[tuple, dict], batch: Any, named: Callable[[Any], Any],
                shifts: bool, known: Optional[list[str]] = None
                ) -> tuple[Callable[[Any], Any], bool]:
    """The weight :func:`_default_weight` chooses for ``batch``, and whether it holds for
    later batches (``False`` where this batch weights its slices alike either way: no labels
    padded with -100, or every sample as many tokens)."""
    from .._slices import plan_batch

    name = type(module).__name__
    labelled = hasattr(batch, "keys") and ("shift_labels" in batch or (
        "labels" in batch and hasattr(batch["labels"], "ne")))
    tokens = named if labelled else padded_labels(batch)
    if tokens is None:
        if not labelled and len(padded_paths(batch)) > 1:
            # which one a loss over tokens counts is not known: said once, for the fit
            log.warning("MemguardCallback: %s's batch holds several integer tensors with -100 "
                        "in them; a split step weights each slice by its samples, which is "
                        "exact only for a mean over samples. Pass weight= (the count the "
                        "loss averages over) or reduction= to say", name)
            return samples_in, True
        return samples_in, False
    if torch_fsdp.units(module):  # a sharded forward gathers: never on some ranks only
        return (tokens if labelled else samples_in), True
    counted = ("the integer tensor with -100 in it" if not labelled else "shift_labels"
               if "shift_labels" in batch else "labels[..., 1:]" if shifts and
               batch["labels"].dim() > 1 else "labels") + " that are not -100"
    plan = plan_batch(batch)
    args, kwargs = call
    metrics = _MetricStates(module)

    def loss(i: int, j: int) -> float:
        kept = len(logs.calls)
        metrics.save()
        try:
            with probing(module):
                output = step(plan.cut(batch, i, j), *args, **kwargs)
        finally:
            del logs.calls[kept:]
            metrics.load()
        if isinstance(output, dict):
            output = output.get("loss")
        return float(output) if isinstance(output, torch.Tensor) else math.nan

    try:
        unit = read_mean(loss, lambda i, j: float(tokens(plan.cut(batch, i, j))),
                         int(plan.length or 0), known[0] if known else None)
    except Exception as error:  # noqa: BLE001 - the step itself runs next and raises its own
        # training_step cannot run one sample in eval mode (a BatchNorm without running
        # statistics, say): undecided, as below
        log.warning("MemguardCallback: reading what %s's loss is a mean over failed (%s)",
                    name, failure_text(error))
        unit = None
    if unit is None:
        log.warning("MemguardCallback: could not tell whether %s's loss is a mean over tokens, "
                    "over all samples or over the samples with any label that is not -100 "
                    "(this batch weights its slices differently by each); a split step weights "
                    "each slice by its %s. Pass weight= (the count the loss averages over) or "
                    "reduction= to say", name, counted if labelled else "samples")
        return (tokens if labelled else samples_in), True
    if unit == "either":
        return tokens, False
    if unit == SAMPLES_OR_LABELLED:  # no sample without labels yet: read again at one
        if known is not None:
            known[:] = [unit]
        return samples_in, False
    if unit == "labelled":
        log.info("MemguardCallback: %s's loss is a mean over the samples with any label that "
                 "is not -100: a split step weights each slice by those samples", name)
        return labelled_samples(tokens), True
    if unit == "samples":
        log.info("MemguardCallback: %s's loss is a mean over samples: a split step weights "
                 "each slice by its samples", name)
        return samples_in, True
    log.info("MemguardCallback: %s's loss is a mean over tokens: a split step weights each "
             "slice by its %s; pass weight= or reduction= to change it", name, counted)
    return tokens, True


def _batch_size(trainer: Any, pl_module: Any) -> Optional[int]:
    """The training batch size: the train DataLoader's, else the module's ``batch_size``
    hyperparameter; ``None`` when neither says."""
    loader = getattr(trainer, "train_dataloader", None)
    size = getattr(loader, "batch_size", None)
    if isinstance(size, int):
        return size
    hparams = getattr(pl_module, "hparams", None) or {}
    size = hparams.get("batch_size") if hasattr(hparams, "get") else None
    return size if isinstance(size, int) else None
