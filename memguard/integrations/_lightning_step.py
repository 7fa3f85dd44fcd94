"""The microbatched ``training_step`` that ``MemguardCallback(microbatch=True)`` puts in place
of a ``LightningModule``'s for a fit.

Lightning runs ``training_step``, then ``zero_grad``, then backward. So the replacement runs
:func:`memguard.auto_microbatch` with the gradients moved aside, takes the new gradients,
puts the old ones back and returns a *carrier*: the loss, whose backward hands the new
gradients to the parameters (scaled and reduced as Lightning's backward would)."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import types
from typing import Any, Callable, Iterator, Optional

import torch

from ..backends.steps import torch_fsdp, torch_training
from ..loop import Attempt
from ..microbatch import auto_microbatch
from ._core import (
    SAMPLES_OR_LABELLED,
    RungCounts,
    causal_lm,
    failure_text,
    labelled_samples,
    padded_labels,
    padded_paths,
    probing,
    read_mean,
    samples_in,
    token_weight,
)
from ._torchmetrics_compat import bookkeeping, set_bookkeeping, state_names

log = logging.getLogger("memguard")


def check_options(options: dict[str, Any]) -> None:
    """Refuse bad :func:`memguard.auto_microbatch` options when the callback is made."""
    auto_microbatch(torch.nn.Linear(1, 1), **options)


class MicrobatchedTrainingStep:
    """The module's own step under :func:`memguard.auto_microbatch`, returning the carrier of
    the gradients it wrote.

    Attributes:
        step: the :func:`memguard.auto_microbatch` step over the module's ``training_step``.
        last_size: the slice size of the last step, until the callback has logged it.

    >>> from memguard.integrations._lightning_step import MicrobatchedTrainingStep
    >>> MicrobatchedTrainingStep.__name__
    'MicrobatchedTrainingStep'
    """

    def __init__(self, pl_module: Any, trainer: Any, options: dict[str, Any]) -> None:
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
        options = dict(options)
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

        weight = options.get("weight")
        whole: list[Any] = [None]  # the step's batch, as the step is given it

        def training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
            logged = len(logs.calls)
            output = original(batch, *args, **kwargs)
            if output is None:  # Lightning's way to skip a batch
                raise _Skipped
            if weight is not None and batch is not whole[0] and not float(weight(batch)) > 0:
                # a slice with nothing its loss averages over adds nothing to the step, nor
                # do its logged values (its loss, a mean over nothing, NaN: the epoch's mean
                # of the logged loss read NaN)
                del logs.calls[logged:]
            if isinstance(output, dict) and "loss" in output:
                extras.clear()
                extras.update((k, v.detach() if isinstance(v, torch.Tensor) else v)
                              for k, v in output.items() if k != "loss")
                return output["loss"]
            return output

        training_step.__name__ = training_step.__qualname__ = (
            f"{type(pl_module).__name__}.training_step")
        step = auto_microbatch(pl_module, **options)(training_step)
        this = self

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
                whole[0] = batch
                with logs.held(), torch_training.hooks_held(params):
                    loss = step(batch, *args, **kwargs)
                grads = [p.grad for p in params]
            except _Skipped:  # the step returned None: Lightning skips the batch
                logs.replay()
                return None
            finally:
                whole[0] = None  # not kept past the step
                for p, grad in zip(params, entry, strict=True):
                    p.grad = grad
            logs.replay()
            history = step.history
            this.last_size = history[-1].size if history else None
            this.rungs.add(history)
            # memguard's backward was scaled by the scaler's scale; Lightning's backward of
            # the carrier scales it again
            scale = float(scaler.get_scale()) if scaler is not None else 1.0
            carrier = _carrier(loss, params, grads, scale)
            if extras:
                return dict(extras, loss=carrier)
            return carrier

        self.step = step
        self.last_size: Optional[int] = None
        self.rungs = RungCounts()  # this fit's batches that recomputed or offloaded
        self._module: Any = pl_module
        pl_module.training_step = types.MethodType(replaced, pl_module)

    @property
    def microbatch_size(self) -> Optional[int]:
        """The slice size that fitted (``None`` until a batch had to be split)."""
        size: Optional[int] = self.step.microbatch_size
        return size

    def reset(self, size: Optional[int]) -> None:
        """Start the next batch from slices of ``size``."""
        self.step.reset(size)

    def remove(self) -> None:
        """Give the module its own ``training_step`` back (once)."""
        module, self._module = self._module, None
        if module is not None and "training_step" in vars(module):
            del module.training_step


class _Skipped(Exception):
    """``training_step`` returned ``None``: the whole batch is skipped, as Lightning does."""


class _Carrier(torch.autograd.Function):
    """The loss whose backward hands ready gradients (scaled by ``scale``) to the parameters,
    times the incoming gradient over ``scale``."""

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
    """``loss`` (detached), carrying ``grads`` into ``params`` at its backward."""
    used = [(p, g) for p, g in zip(params, grads, strict=True) if g is not None]
    if not used:
        return loss
    return _Carrier.apply(loss.detach(), [g for _, g in used], scale,
                          *(p for p, _ in used))


class _HeldLogs:
    """A step's ``self.log`` calls, held back: a failed pass's dropped, the good pass's made
    once it ends, in order."""

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
    """The module's torchmetrics states, put back before a failed pass is redone (each sample
    counts once)."""

    def __init__(self, module: Any) -> None:
        self.metrics: list[Any] = []
        if "torchmetrics" in sys.modules:
            from torchmetrics import Metric

            self.metrics = [m for m in module.modules() if isinstance(m, Metric)]
        self.saved: list[tuple[Any, dict[str, Any], tuple]] = []

    def save(self) -> None:
        self.saved = [(m, {name: _copied(getattr(m, name)) for name in state_names(m)},
                       bookkeeping(m))
                      for m in self.metrics]

    def load(self) -> None:
        for metric, states, kept in self.saved:
            for name, value in states.items():
                setattr(metric, name, _copied(value))
            set_bookkeeping(metric, kept)


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
    """The ``weight`` chosen at the first split where none is given: where the batch holds labels
    padded with -100, the loss's own mean is read off ``training_step`` (see
    :func:`~memguard.integrations._core.averaged_over`): tokens or samples."""
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
    """The weight :func:`_default_weight` chooses for ``batch``, and whether it holds for later
    batches (``False`` where this batch cannot tell)."""
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
