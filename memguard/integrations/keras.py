"""``MemguardCallback`` for Keras ``fit`` (``pip install "memguard-ml[keras]"``).

>>> import keras                                                     # doctest: +SKIP
>>> from memguard.integrations.keras import MemguardCallback         # doctest: +SKIP
>>> model.fit(x, y, callbacks=[MemguardCallback(), keras.callbacks.TensorBoard()])  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Optional

from ._core import TRAIN, VAL, CallbackBase, missing
from ._keras_compat import CALLBACK_MODEL

try:
    import keras as _keras
except ImportError:
    raise missing("keras", "keras", "Keras") from None


class MemguardCallback(CallbackBase, _keras.callbacks.Callback):
    """Memory of every training epoch and validation run, added to the epoch's ``logs`` (list
    it before ``TensorBoard`` so that it sees them).

    Each epoch and evaluation is a :func:`memguard.memory_scope`; at its end
    ``memory/<device>/peak``, ``.../retained`` and ``.../allocated`` (MiB; ``val_memory/...``
    for validation) join the logs. A bare ``evaluate()``'s figures are in ``scopes`` only.
    Keras tells callbacks nothing about an exception: pass ``on_retry=callback.on_retry`` to
    the ``oom_retry`` around ``fit`` to record failures in ``failures``.

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

    Raises:
        MemoryLeakError: at the end of an epoch (after the first) that retained more than
            ``max_leak``.
        ValueError: a bad ``max_leak``, ``cleanup`` or ``log_every_n_steps`` (``TypeError``
            for the wrong type).

    >>> from memguard.integrations.keras import MemguardCallback
    >>> MemguardCallback(log_every_n_steps=100).failures
    []
    """

    _framework = "keras"
    _run_links = (CALLBACK_MODEL,)  # set by Keras at fit

    def _init_state(self) -> None:
        self._steps = 0
        self._validation: dict[str, float] = {}  # the last validation run's, for the epoch

    # -- Keras's hooks -------------------------------------------------------------------------
    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self._tracker.start_run()
        self._steps = 0
        self._tracker.step = 0

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self._validation = {}
        self._tracker.begin(TRAIN)

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        metrics, error = self._tracker.end(TRAIN)
        if logs is not None:  # the dict every later callback (History last) receives
            logs.update(self._validation)
            logs.update(metrics)
        self._validation = {}
        if error is not None:
            raise error

    def on_test_begin(self, logs: Optional[dict] = None) -> None:
        self._tracker.begin(VAL)

    def on_test_end(self, logs: Optional[dict] = None) -> None:
        metrics, error = self._tracker.end(VAL)
        # Keras hands callbacks a copy of evaluate()'s logs: during fit the figures go into
        # the epoch's logs at its end; after a bare evaluate() they are in ``scopes``.
        self._validation = metrics
        if error is not None:
            raise error

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self._steps += 1
        if self._tracker.step_due(self._steps) and logs is not None:
            logs.update(self._tracker.step_metrics())
