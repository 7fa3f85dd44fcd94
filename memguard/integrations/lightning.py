"""``MemguardCallback`` for PyTorch Lightning (``pip install "memguard-ml[lightning]"``): the
memory of every epoch and validation run in the module's logs, a leak verdict per epoch, and
with ``microbatch=True`` a training step (``_lightning_step``) that redoes a batch in slices
on out-of-memory."""

from __future__ import annotations

from typing import Any, Callable, Optional

from .._units import Size
from ..cleanup import Cleanup
from ..distributed import Sync
from ..loop import Attempt, Factor
from ..microbatch import Reduction
from ._core import TRAIN, VAL, CallbackBase, missing
from ._lightning_step import MicrobatchedTrainingStep, check_options

try:  # the standalone package first: it is what memguard-ml[lightning] installs
    import pytorch_lightning as _pl
except ImportError:
    try:
        import lightning.pytorch as _pl  # type: ignore[no-redef]
    except ImportError:
        raise missing("pytorch-lightning", "lightning", "PyTorch Lightning") from None

#: The key of the microbatch size in the module's logged metrics.
MICROBATCH_KEY = "memory/microbatch_size"
#: ``auto_microbatch``'s options that ``MemguardCallback(microbatch=True, ...)`` passes on.
MICROBATCH_OPTIONS = ("min_batch_size", "factor", "max_attempts", "on_retry", "sync",
                      "reduction", "weight", "grow_every", "recompute", "cost", "offload")


class MemguardCallback(CallbackBase, _pl.Callback):
    """Memory of every training epoch and validation run, logged through
    ``LightningModule.log``; with ``microbatch=True``, recovery from out-of-memory inside
    each training step.

    Each epoch and validation run is a :func:`memguard.memory_scope`; at its end
    ``memory/<device>/peak``, ``.../retained`` and ``.../allocated`` (MiB; ``val_memory/...``
    for validation) are logged. An out-of-memory during ``fit`` is kept in ``failures`` and
    the callback is ready for the next ``fit``; pass ``on_retry=callback.on_retry`` to an
    ``oom_retry`` around ``fit``.

    With ``microbatch=True`` the module's ``training_step`` (automatic optimisation; it returns
    the loss or a dict with ``"loss"``) runs under :func:`memguard.auto_microbatch` for each
    fit: the batch is redone in slices within the same optimizer step, with the unsplit
    step's gradients, also with gradient accumulation, clipping, mixed precision and DDP. A
    failed pass's ``self.log`` values are dropped. The slice size is logged as
    ``memory/microbatch_size`` and kept in checkpoints; ``memory/recomputed_batches`` and
    ``memory/offloaded_batches`` count the batches of the fit that needed those rungs (each
    batch of an accumulated step), logged from the first. See the trainers guide.

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
        microbatch: recover from an out-of-memory inside each training step. Default
            ``False``. The options below need it; their default ``None`` means
            :func:`memguard.auto_microbatch`'s.
        min_batch_size: the smallest slice size tried, in samples. Default ``None``.
        factor: the next slice size is ``floor(size * factor)``; ``"auto"`` measures it; a
            callable ``size -> next size`` decides. Default ``None``.
        max_attempts: the most passes over one batch. Default ``None``.
        on_retry: called with each failed :class:`memguard.Attempt` after the cleanup.
            Default ``None``.
        sync: agree with the other ranks after each pass (``"auto"``, ``True``, ``False``).
            Default ``None``.
        reduction: ``"mean"`` or ``"sum"``, what the loss is over its samples. Default
            ``None``.
        weight: a callable ``slice -> count`` its loss averages over (tokens). Default
            ``None``: the labels not -100 where the loss is read to average over tokens,
            else samples.
        grow_every: try the next larger slice size after this many steps without an
            out-of-memory. Default ``None``.
        recompute: recompute activations when one slice of ``min_batch_size`` still runs
            out of memory. Default ``None``.
        cost: a callable ``batch -> number`` that grows with its memory (tokens): slices are
            planned in it. Default ``None``.
        offload: on a GPU, after recompute, keep the tensors saved for backward in pinned
            host memory. Default ``None``.

    Raises:
        MemoryLeakError: at the end of an epoch (after the first) that retained more than
            ``max_leak``.
        ValueError: a bad ``max_leak``, ``cleanup`` or ``log_every_n_steps`` (``TypeError``
            for the wrong type); with ``microbatch=True``, at ``fit``, a module with
            ``automatic_optimization = False`` (call :func:`memguard.auto_microbatch` in its
            ``training_step`` instead).
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
                 cost: Optional[Callable[[Any], Any]] = None,
                 offload: Optional[bool] = None) -> None:
        super().__init__(max_leak, track_tensors, cleanup, log_every_n_steps)
        if not isinstance(microbatch, bool):
            raise TypeError(f"MemguardCallback: microbatch must be True or False, got "
                            f"{microbatch!r}")
        given = dict(min_batch_size=min_batch_size, factor=factor, max_attempts=max_attempts,
                     on_retry=on_retry, sync=sync, reduction=reduction, weight=weight,
                     grow_every=grow_every, recompute=recompute, cost=cost, offload=offload)
        options: dict[str, Any] = {name: value for name, value in given.items()
                                   if value is not None}
        if options and not microbatch:
            names = sorted(options)
            raise TypeError(f"MemguardCallback: {', '.join(names)} "
                            f"{'are' if len(names) > 1 else 'is one of'} auto_microbatch's "
                            f"options: pass microbatch=True with "
                            f"{'them' if len(names) > 1 else 'it'}")
        if microbatch:  # checked now, not at fit
            check_options(options)
        self.microbatch = microbatch
        self._options = dict(options)

    def _init_state(self) -> None:
        self._step: Optional[MicrobatchedTrainingStep] = None  # the last fit's step
        self._size: Optional[int] = None  # the size that fitted, kept after the fit

    def __getstate__(self) -> dict[str, Any]:
        return dict(super().__getstate__(), _step=None)

    @property
    def microbatch_size(self) -> Optional[int]:
        """The slice size that fitted (``None`` until a batch was split or without microbatch)."""
        if self._step is not None and self._step.microbatch_size is not None:
            return self._step.microbatch_size
        return self._size

    def state_dict(self) -> dict[str, Any]:
        """Lightning's callback state, saved with each checkpoint: the slice size learned."""
        return {"microbatch_size": self.microbatch_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Start from the slice size a checkpoint kept.

        Args:
            state_dict: what :meth:`state_dict` returned; a ``microbatch_size`` that is not a
                positive int is ignored.
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
        step = self._step
        if step is not None and step.last_size is not None:
            pl_module.log(MICROBATCH_KEY, float(step.last_size), on_step=True,
                          on_epoch=False, batch_size=1)
            step.last_size = None
            for key, value in step.rungs.figures().items():
                pl_module.log(key, value, on_step=True, on_epoch=False, batch_size=1)
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
        """Shadow ``pl_module.training_step`` with the microbatched step for this fit."""
        self._uninstall()
        self._step = MicrobatchedTrainingStep(pl_module, trainer, self._options)
        if self._size is not None:  # learned in an earlier fit, or kept in the checkpoint
            self._step.reset(self._size)

    def _uninstall(self) -> None:
        """Give the module its own ``training_step`` back."""
        if self._step is None:
            return
        if self._step.microbatch_size is not None:
            self._size = self._step.microbatch_size
        self._step.remove()


def _batch_size(trainer: Any, pl_module: Any) -> Optional[int]:
    """The train DataLoader's batch size, else the module's ``batch_size`` hyperparameter."""
    loader = getattr(trainer, "train_dataloader", None)
    size = getattr(loader, "batch_size", None)
    if isinstance(size, int):
        return size
    hparams = getattr(pl_module, "hparams", None) or {}
    size = hparams.get("batch_size") if hasattr(hparams, "get") else None
    return size if isinstance(size, int) else None
