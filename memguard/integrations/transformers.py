"""memguard for the Hugging Face ``Trainer`` (``pip install "memguard-ml[transformers]"``):
``MemguardCallback`` logs the memory of every epoch and evaluation; ``auto_microbatch`` makes
the trainer's step redo a batch in slices on out-of-memory."""

from __future__ import annotations

import sys
import threading
import types
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

from .._units import Size
from ..cleanup import Cleanup
from ..distributed import Sync
from ..loop import Attempt, Factor
from ..microbatch import Reduction, auto_microbatch as _auto_microbatch
from ._core import TRAIN, VAL, CallbackBase, missing
from ._transformers_step import MicrobatchedTrainingStep, MicrobatchState

try:
    import transformers as _transformers
    from transformers import TrainerCallback as _TrainerCallback
except ImportError:
    raise missing("transformers", "transformers", "Hugging Face transformers") from None

if TYPE_CHECKING:
    import transformers

TrainerT = TypeVar("TrainerT", bound="_transformers.Trainer")


class MemguardCallback(CallbackBase, _TrainerCallback):
    """Memory of every training epoch and evaluation, logged into the trainer's
    ``state.log_history`` and its reporters (TensorBoard, W&B, ...).

    Each epoch and evaluation is a :func:`memguard.memory_scope`; at its end
    ``memory/<device>/peak``, ``.../retained`` and ``.../allocated`` (MiB; ``val_memory/...``
    for an evaluation) join the Trainer's own log entry. The Trainer tells callbacks nothing
    about an exception: pass ``on_retry=callback.on_retry`` to the ``oom_retry`` around
    ``train`` to record failures in ``failures``.

    Args:
        max_leak: from the second epoch on (the first is the warm-up), the most an epoch may
            retain on a device, in bytes or a size such as ``"256MiB"``; ``None`` (the
            default) judges nothing.
        track_tensors: name the biggest leaked tensors and their holders in the error.
            Default ``False``.
        cleanup: the epoch scope's policy at each epoch's end: ``"auto"`` (the default),
            ``"always"`` or ``"never"``.
        log_every_n_steps: also log ``step_allocated`` and ``step_reserved`` every N steps;
            ``None`` (the default) for epochs only.
        trainer: the ``Trainer`` this callback serves (also :meth:`attach`); ``None`` (the
            default): found on the call stack when training begins.

    Raises:
        MemoryLeakError: at the end of an epoch (after the first) that retained more than
            ``max_leak``.
        ValueError: a bad ``max_leak``, ``cleanup`` or ``log_every_n_steps`` (``TypeError``
            for the wrong type).

    >>> from memguard.integrations.transformers import MemguardCallback
    >>> callback = MemguardCallback(max_leak="256MiB")
    >>> callback.failures
    []
    """

    _framework = "transformers"
    _run_links = ("_trainer",)  # a weak reference, found again at the next train
    _run = "train"

    def __init__(self, max_leak: Optional[Size] = None, track_tensors: bool = False,
                 cleanup: Cleanup = "auto", log_every_n_steps: Optional[int] = None,
                 trainer: Optional[transformers.Trainer] = None) -> None:
        super().__init__(max_leak=max_leak, track_tensors=track_tensors, cleanup=cleanup,
                         log_every_n_steps=log_every_n_steps)
        if trainer is not None:
            self.attach(trainer)

    def _init_state(self) -> None:
        self._trainer: Optional[weakref.ReferenceType] = None
        self._given = False  # the trainer was given: no looking on the stack

    def attach(self, trainer: Any) -> "MemguardCallback":
        """Serve ``trainer``: log through its ``log``. The callback must still be among the
        trainer's callbacks.

        Args:
            trainer: a ``transformers.Trainer`` (or a subclass).

        Returns:
            This callback.

        Raises:
            TypeError: ``trainer`` is not a ``transformers.Trainer``.

        >>> MemguardCallback().attach("a trainer")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        TypeError: MemguardCallback.attach needs a transformers.Trainer, got str ...
        """
        _check_trainer(trainer, "MemguardCallback.attach")
        self._trainer = weakref.ref(trainer)
        self._given = True
        _joiner(trainer)
        return self

    def _current_trainer(self) -> Optional[Any]:
        return self._trainer() if self._trainer is not None else None

    # -- the Trainer's events ------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._tracker.start_run()
        self._tracker.step = state.global_step
        self._tracker.batch_size = args.per_device_train_batch_size
        if not (self._given and self._current_trainer() is not None):
            trainer = _calling_trainer()
            self._trainer = None if trainer is None else weakref.ref(trainer)
            if trainer is not None:
                _joiner(trainer)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush(state, control)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush(state, control)
        self._tracker.begin(TRAIN)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        metrics, error = self._tracker.end(TRAIN)
        self._log(state, metrics, control)
        if error is not None:
            raise error

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush(state, control)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._tracker.step_due(state.global_step):
            self._log(state, self._tracker.step_metrics(), control)

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if VAL not in self._tracker.open:
            self._tracker.begin(VAL)

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None,
                    **kwargs: Any) -> None:
        found, error = self._tracker.end(VAL)
        if isinstance(metrics, dict):
            metrics.update(found)  # what evaluate() returns
        self._log(state, found, control)
        if error is not None:
            raise error

    def on_predict(self, args: Any, state: Any, control: Any, metrics: Any = None,
                   **kwargs: Any) -> None:
        self._tracker.end(VAL)  # a prediction run is not a validation: measured, not logged

    def _log(self, state: Any, metrics: dict[str, float], control: Any = None,
             join: bool = True) -> None:
        """Log ``metrics``: joined to the Trainer's own entry when it is about to log, else through
        ``Trainer.log`` with ``control.should_log`` kept (``Trainer.log`` clears it)."""
        if not metrics:
            return
        trainer = self._current_trainer()
        if trainer is None:
            state.log_history.append({**metrics, "epoch": state.epoch,
                                      "step": state.global_step})
            return
        should_log = bool(getattr(control, "should_log", False))
        if should_log and join:
            _joiner(trainer).pending.update(metrics)  # into the Trainer's entry, next
            return
        trainer.log(dict(metrics))  # log_history and every reporter
        if control is not None:
            control.should_log = should_log

    def _flush(self, state: Any, control: Any) -> None:
        """Log on their own the figures that waited for a Trainer entry that never came."""
        trainer = self._current_trainer()
        if trainer is None:
            return
        join = _joiner(trainer)
        if join.pending:
            pending = dict(join.pending)
            join.pending.clear()
            self._log(state, pending, control, join=False)


def _calling_trainer() -> Optional[Any]:
    """The ``Trainer`` up the call stack (the first frame whose ``self`` is one), or ``None``."""
    frame: Optional[types.FrameType] = sys._getframe(1)  # noqa: SLF001 - the Trainer is found on the stack
    for _ in range(12):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, _transformers.Trainer):
            return owner
        frame = frame.f_back
    return None


def _check_trainer(trainer: Any, who: str) -> None:
    if not isinstance(trainer, _transformers.Trainer):
        raise TypeError(f"{who} needs a transformers.Trainer, got {type(trainer).__name__} "
                        f"({trainer!r:.60}): pass the Trainer instance itself")


class _LogJoin:
    """What memguard adds to a Trainer's log entries: ``pending`` figures for the next entry,
    ``each`` for every training entry; installed by wrapping the instance's ``log``."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original
        self.pending: dict[str, float] = {}
        self.each: dict[str, Callable[[], dict[str, float]]] = {}

    def __call__(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> Any:
        if isinstance(logs, dict):
            for key, value in self.pending.items():
                logs.setdefault(key, value)  # the Trainer's own figures win
            self.pending.clear()
            if "loss" in logs:
                for figures in self.each.values():
                    for key, value in figures().items():
                        logs.setdefault(key, value)
        return self.original(logs, *args, **kwargs)


_JOIN_LOCK = threading.Lock()


def _joiner(trainer: Any) -> _LogJoin:
    """The trainer's :class:`_LogJoin`, installed as its ``log`` on first use."""
    with _JOIN_LOCK:
        current = trainer.__dict__.get("log")
        if isinstance(current, _LogJoin):
            return current
        join = _LogJoin(trainer.log)
        trainer.log = join
        return join


def auto_microbatch(trainer: TrainerT, *, min_batch_size: int = 1, factor: Factor = 0.5,
                    max_attempts: Optional[int] = None,
                    on_retry: Optional[Callable[[Attempt], object]] = None, sync: Sync = "auto",
                    reduction: Optional[Reduction] = None,
                    weight: Optional[Callable[[Any], Any]] = None,
                    grow_every: Optional[int] = None, scaler: Any = None,
                    recompute: bool = True,
                    cost: Optional[Callable[[Any], Any]] = None,
                    offload: bool = True) -> TrainerT:
    """Make a Hugging Face ``Trainer`` redo a batch in slices when it runs out of memory in
    forward or backward, inside ``train()``: no restart, no lost step.

    The instance's ``training_step`` is replaced by a :class:`MicrobatchedTrainingStep` that
    runs the original on each slice and hands its loss to :func:`memguard.auto_microbatch`.
    The Trainer still clips, steps, schedules and logs on the whole batch. Slice losses are
    exact against ``num_items_in_batch`` where the Trainer passes it, else weighted by what
    the loss averages over (read at the first split; see the trainers guide). Works under DDP
    and with gradient accumulation; the slice size is kept in every checkpoint
    (:class:`MicrobatchState`) and logged as ``memory/microbatch_size``.

    Args:
        trainer: a ``transformers.Trainer`` or a subclass, not yet training.
        min_batch_size: the smallest slice size tried, in samples (default 1).
        factor: the next slice size is ``floor(size * factor)`` (default 0.5); ``"auto"``
            measures it; a callable ``size -> next size`` decides.
        max_attempts: the most passes over one batch (default ``None``: until
            ``min_batch_size``).
        on_retry: called with each failed :class:`memguard.Attempt` after the cleanup, before
            the batch is redone (default ``None``).
        sync: agree with the other ranks after each pass (default ``"auto"``: when there is
            more than one rank; ``True``; ``False``).
        reduction: ``"mean"`` or ``"sum"``, what the loss is over its samples; default
            ``None``: chosen as above.
        weight: a callable ``slice -> count`` its loss averages over (tokens); default
            ``None``: the labels that are not -100 or the samples, as read from the loss.
        grow_every: after this many steps without an out-of-memory, try the next larger
            slice size; default ``None``: never.
        scaler: a ``torch.amp.GradScaler`` that scales each backward; default ``None``: the
            accelerator's, if it has one.
        recompute: when a slice of ``min_batch_size`` still runs out of memory, redo the
            batch with gradient checkpointing on, for that batch only; default ``True``.
        cost: a callable ``batch -> number`` that grows with its memory
            (``lambda b: b["attention_mask"].sum()``); default ``None``: the elements of the
            batch's tensors.
        offload: on a GPU, when the recomputed pass still runs out of memory, redo the batch
            with the tensors saved for backward in pinned host memory; default ``True``.

    Returns:
        The same trainer; ``trainer.training_step.microbatch_size`` and ``.history`` tell what
        the last step did. The log entries gain ``memory/microbatch_size``, and
        ``memory/recomputed_batches`` / ``memory/offloaded_batches`` once a batch needed that
        rung (each batch of a gradient accumulation counts).

    Raises:
        TypeError: ``trainer`` is not a ``Trainer``, or an option is unknown or of the wrong
            type.
        ValueError: an option's value is invalid.
        NotImplementedError: at the first step, under DeepSpeed, Megatron-LM or a LOMO
            optimizer.
        OutOfMemoryError: during ``train()``, when the smallest slice runs out of memory too.

    >>> import transformers                                                   # doctest: +SKIP
    >>> from memguard.integrations.transformers import auto_microbatch        # doctest: +SKIP
    >>> trainer = auto_microbatch(transformers.Trainer(model, args,           # doctest: +SKIP
    ...                                                train_dataset=data), grow_every=50)
    >>> trainer.train()                                                       # doctest: +SKIP
    >>> trainer.training_step.microbatch_size                                 # doctest: +SKIP
    4
    """
    _check_trainer(trainer, "auto_microbatch")
    options: dict[str, Any] = dict(
        min_batch_size=min_batch_size, factor=factor, max_attempts=max_attempts,
        on_retry=on_retry, sync=sync, weight=weight, grow_every=grow_every, scaler=scaler,
        recompute=recompute, cost=cost, offload=offload)
    if reduction is not None:  # else chosen at the first step (see above)
        options["reduction"] = reduction
    _auto_microbatch(trainer.model, **options)  # the options, checked now
    current = trainer.__dict__.get("training_step")
    original = current.original if isinstance(current, MicrobatchedTrainingStep) \
        else trainer.training_step
    step = MicrobatchedTrainingStep(trainer, original, dict(options))
    trainer.training_step = step  # type: ignore[method-assign]  # the instance's own step
    _joiner(trainer).each["microbatch"] = step.figures
    if not any(isinstance(c, MicrobatchState) for c in trainer.callback_handler.callbacks):
        trainer.add_callback(MicrobatchState())  # the size learned, kept with checkpoints
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, MemguardCallback):
            callback.attach(trainer)
    return trainer


__all__ = ["MemguardCallback", "MicrobatchState", "MicrobatchedTrainingStep", "auto_microbatch"]
