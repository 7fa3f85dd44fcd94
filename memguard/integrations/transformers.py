"""``MemguardCallback`` for the Hugging Face ``Trainer`` (``pip install
"memguard[transformers]"``).

>>> from transformers import Trainer                                        # doctest: +SKIP
>>> from memguard.integrations.transformers import MemguardCallback         # doctest: +SKIP
>>> trainer = Trainer(model, args, train_dataset=data,                      # doctest: +SKIP
...                   callbacks=[MemguardCallback()])
"""

from __future__ import annotations

import sys
import types
import weakref
from typing import Any, Optional

from ._core import TRAIN, VAL, CallbackBase, missing

try:
    import transformers as _transformers
    from transformers import TrainerCallback as _TrainerCallback
except ImportError:
    raise missing("transformers", "transformers", "Hugging Face transformers") from None


class MemguardCallback(CallbackBase, _TrainerCallback):
    """Memory of every training epoch and evaluation, logged into the trainer's
    ``state.log_history`` and its reporters (TensorBoard, W&B, ...), as ``Trainer.log`` does.

    Each training epoch and each evaluation is a :func:`memguard.memory_scope`; at its end
    ``memory/<device>/peak``, ``.../retained`` and ``.../allocated`` (MiB;
    ``val_memory/...`` for an evaluation, also added to the metrics ``evaluate()`` returns)
    are logged. ``log_every_n_steps`` adds ``memory/<device>/step_allocated`` and
    ``step_reserved`` every N optimizer steps (readings that cost microseconds). ``max_leak``
    (bytes or ``"256MiB"``): from the second epoch on (the first is the warm-up), an epoch
    that retains more raises :class:`memguard.MemoryLeakError`, naming the biggest leaked
    tensors and their holders with ``track_tensors=True``. ``cleanup`` is the scope's policy
    at each epoch's end (``"auto"``, ``"always"`` or ``"never"``, as for ``memory_scope``).

    The ``Trainer`` tells its callbacks nothing about an exception: pass
    ``on_retry=callback.on_retry`` to the ``oom_retry`` around ``train``, and an out-of-memory
    is kept in ``failures`` with the memory at the failure, the batch size and the last step
    (logged once: ``oom_retry``'s WARNING line; the callback's, "out of memory during train at
    step ...", is DEBUG), and the callback is ready for the next attempt. Without it, the next
    ``train`` closes what the failed one left open and starts the warm-up again. ``scopes``
    holds every finished scope.

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

    >>> from memguard.integrations.transformers import MemguardCallback
    >>> callback = MemguardCallback(max_leak="256MiB")
    >>> callback.failures
    []
    """

    _framework = "transformers"
    _run_links = ("_trainer",)  # a weak reference, found again at the next train
    _run = "train"

    def _init_state(self) -> None:
        self._trainer: Optional[weakref.ReferenceType] = None

    # -- the Trainer's events ------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._tracker.start_run()
        self._tracker.step = state.global_step
        self._tracker.batch_size = args.per_device_train_batch_size
        trainer = _calling_trainer()
        self._trainer = None if trainer is None else weakref.ref(trainer)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._tracker.begin(TRAIN)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        metrics, error = self._tracker.end(TRAIN)
        self._log(state, metrics)
        if error is not None:
            raise error

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._tracker.step_due(state.global_step):
            self._log(state, self._tracker.step_metrics())

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if VAL not in self._tracker.open:
            self._tracker.begin(VAL)

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None,
                    **kwargs: Any) -> None:
        found, error = self._tracker.end(VAL)
        if isinstance(metrics, dict):
            metrics.update(found)  # what evaluate() returns
        self._log(state, found)
        if error is not None:
            raise error

    def on_predict(self, args: Any, state: Any, control: Any, metrics: Any = None,
                   **kwargs: Any) -> None:
        self._tracker.end(VAL)  # a prediction run is not a validation: measured, not logged

    def _log(self, state: Any, metrics: dict[str, float]) -> None:
        if not metrics:
            return
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is not None:
            trainer.log(dict(metrics))  # log_history and every reporter
        else:
            state.log_history.append({**metrics, "epoch": state.epoch,
                                      "step": state.global_step})


def _calling_trainer() -> Optional[Any]:
    """The ``Trainer`` whose method runs the callbacks (the Trainer does not hand itself to
    them): the first frame up the stack whose ``self`` is one; ``None`` if none is."""
    frame: Optional[types.FrameType] = sys._getframe(1)  # noqa: SLF001 - the Trainer is found on the stack
    for _ in range(12):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, _transformers.Trainer):
            return owner
        frame = frame.f_back
    return None
