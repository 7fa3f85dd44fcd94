"""``MemguardCallback`` for PyTorch Lightning (``pip install "memguard[lightning]"``).

>>> import pytorch_lightning as pl                                      # doctest: +SKIP
>>> from memguard.integrations.lightning import MemguardCallback        # doctest: +SKIP
>>> trainer = pl.Trainer(callbacks=[MemguardCallback(max_leak="256MiB")])  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Optional

from ._core import TRAIN, VAL, CallbackBase, missing

try:  # the standalone package first: it is what memguard[lightning] installs
    import pytorch_lightning as _pl
except ImportError:
    try:
        import lightning.pytorch as _pl  # type: ignore[no-redef]
    except ImportError:
        raise missing("pytorch-lightning", "lightning", "PyTorch Lightning") from None


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
        cleanup: the epoch scope's policy at each epoch's end: ``"auto"``, ``"always"`` or
            ``"never"``.
        log_every_n_steps: also log ``step_allocated`` and ``step_reserved`` every N steps;
            ``None`` for epochs only.

    Raises:
        MemoryLeakError: at the end of an epoch (after the first) that retained more than
            ``max_leak``.
        ValueError: a bad ``max_leak``, ``cleanup`` or ``log_every_n_steps`` (a ``TypeError``
            for one of the wrong type), named with its
            value.

    >>> from memguard.integrations.lightning import MemguardCallback
    >>> callback = MemguardCallback(max_leak="256MiB", log_every_n_steps=50)
    >>> callback.failures
    []
    """

    _framework = "lightning"
    _run_links = ("log", "log_dict")  # the LightningModule's, attached by Lightning at fit

    # -- Lightning's hooks ---------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._tracker.start_run()
        self._tracker.batch_size = _batch_size(trainer, pl_module)

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
        if self._tracker.step_due(trainer.global_step):
            for key, value in self._tracker.step_metrics().items():
                pl_module.log(key, value, on_step=True, on_epoch=False, batch_size=1)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._tracker.failed(exception, step=trainer.global_step,
                             batch_size=_batch_size(trainer, pl_module))

    def _end(self, kind: str, pl_module: Any) -> None:
        metrics, error = self._tracker.end(kind)
        for key, value in metrics.items():
            pl_module.log(key, value, on_step=False, on_epoch=True)
        if error is not None:
            raise error


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
