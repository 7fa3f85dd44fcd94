"""memguard.integrations.keras.MemguardCallback against real Keras 3 on TensorFlow."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import memguard

from frameworks import deferred, lazy, requires

keras = lazy("keras")
MemguardCallback = deferred("memguard.integrations.keras", "MemguardCallback")
pytestmark = [pytest.mark.slow, requires("keras")]  # importing TensorFlow takes seconds
LEAKS: list = []
X = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
Y = X.sum(axis=1, keepdims=True)


def tiny():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


def test_epochs_and_validation_go_into_history_and_batch_logs():
    seen = []

    class Batches(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append("memory/host/step_allocated" in logs)

    callback = MemguardCallback(log_every_n_steps=2)
    history = tiny().fit(X, Y, batch_size=16, epochs=2, validation_data=(X, Y), verbose=0,
                         callbacks=[callback, Batches()]).history
    assert len(history["memory/host/peak"]) == 2 and len(history["val_memory/host/peak"]) == 2
    for peak, kept, allocated in zip(history["memory/host/peak"],
                                     history["memory/host/retained"],
                                     history["memory/host/allocated"], strict=True):  # MiB
        assert 50 < peak < 1e6 and 0 <= kept < peak and allocated > 10
    assert seen == [False, True, False, True] * 2  # steps 2, 4, 6, 8 of 4 batches an epoch
    assert [s.name for s in callback.scopes] == [
        "keras validation 1", "keras epoch 1", "keras validation 2", "keras epoch 2"]


def test_max_leak_spares_the_warm_up_epoch_and_names_the_holder():
    class Leaky(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            LEAKS.append(np.ones(25 << 20))  # 200 MiB an epoch, in numpy: the host's

    LEAKS.clear()
    callback = MemguardCallback(max_leak="100MiB")
    with pytest.raises(memguard.MemoryLeakError, match=r"memory_scope 'keras epoch 2' "
                                                        r"retained .* on host"):
        tiny().fit(X, Y, batch_size=32, epochs=3, verbose=0, callbacks=[callback, Leaky()])
    LEAKS.clear()
    assert callback.scopes[0].retained["host"] > 150 << 20  # the warm-up, unjudged


def test_max_leak_sees_a_tensor_kept_in_tensorflows_pool_each_epoch():
    import tensorflow as tf

    class Leaky(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            LEAKS.append(tf.random.normal((1 << 20,)))  # 4 MiB an epoch, in TensorFlow's pool

    LEAKS.clear()
    quiet = MemguardCallback()
    tiny().fit(X, Y, batch_size=16, epochs=4, verbose=0, callbacks=[quiet])
    callback = MemguardCallback(max_leak="1MiB")
    with pytest.raises(memguard.MemoryLeakError, match=r"'keras epoch 2' retained"):
        tiny().fit(X, Y, batch_size=16, epochs=3, verbose=0, callbacks=[callback, Leaky()])
    LEAKS.clear()
    assert all(s.retained["host"] < 1 << 20 for s in quiet.scopes[1:]), quiet.scopes
    assert callback.scopes[1].retained["host"] > 3.5 * (1 << 20)


def test_a_failed_fit_leaves_the_callback_ready_for_the_next(caplog):
    class Fails(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                raise MemoryError("simulated by the test: Keras has no exception hook")

    callback = MemguardCallback()
    model = tiny()

    @memguard.oom_retry(batch_size=32, on_retry=callback.on_retry)
    def fit(batch_size):
        extra = [Fails()] if batch_size == 32 else []
        return model.fit(X, Y, batch_size=batch_size, epochs=1, verbose=0,
                         callbacks=[callback, *extra])

    with caplog.at_level(logging.DEBUG, "memguard"):
        history = fit()
    assert [a.size for a in fit.history] == [32, 16]
    # logged once, at WARNING by oom_retry; the callback's line (DEBUG) adds the step
    [line] = [r.getMessage() for r in caplog.records
              if r.levelno >= logging.WARNING and "out of memory" in r.getMessage()]
    assert "retrying at batch_size=16" in line
    assert "keras: out of memory during fit at step 2, batch_size=32" in caplog.text
    [failure] = callback.failures
    assert failure["batch_size"] == 32 and failure["step"] == 2
    assert [s.name for s in callback.scopes] == ["keras epoch 1"]
    assert "memory/host/peak" in history.history


def test_without_keras_the_import_error_names_the_package():
    code = ("import sys; sys.modules['keras'] = None\n"
            "try:\n    import memguard.integrations.keras\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60).stdout
    assert 'pip install "memguard-ml[keras]"' in out


def test_a_budgeted_fit_on_numpy_arrays_recovers_with_the_callback(python_in_subprocess):
    """The callback adds nothing at the failure (Keras calls no callback when ``fit`` raises;
    ``on_retry`` runs after ``oom_retry``'s cleanup): the fit that recovers without it
    recovers with it, each failure recorded once."""
    from budget import ENV, script

    out = python_in_subprocess(script("""
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
        import numpy as np, keras, memguard
        from memguard.integrations.keras import MemguardCallback
        model = keras.Sequential([keras.Input((256,)),
                                  keras.layers.Dense(8192, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        x = np.random.rand(8192, 256).astype("float32")
        y = np.random.rand(8192, 1).astype("float32")
        callback = MemguardCallback()
        model.fit(x[:64], y[:64], batch_size=64, epochs=1, verbose=0, callbacks=[callback])
        memguard.free_memory()
        set_budget(400)

        @memguard.oom_retry(batch_size=8192, on_retry=callback.on_retry)
        def train(batch_size):
            return model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0,
                             callbacks=[callback]).history

        history = train()
        print(json.dumps({"tried": [a.size for a in train.history],
                          "failures": [f["batch_size"] for f in callback.failures],
                          "errors": [f["error"] for f in callback.failures],
                          "logged": sorted(history)}))
    """), env=ENV, timeout=300)
    assert len(out["tried"]) >= 2 and out["tried"][0] == 8192
    assert out["failures"] == out["tried"][:-1]
    assert all("OOM when allocating tensor" in e for e in out["errors"])
    assert "memory/host/peak" in out["logged"]
