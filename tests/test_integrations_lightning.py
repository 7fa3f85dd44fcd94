"""memguard.integrations.lightning.MemguardCallback against real PyTorch Lightning."""

from __future__ import annotations

import csv
import functools
import glob
import logging
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import memguard

from budget import ENV, script
from frameworks import deferred, lazy, requires

pl = lazy("pytorch_lightning")
MemguardCallback = deferred("memguard.integrations.lightning", "MemguardCallback")
pytestmark = requires("pytorch_lightning")
LEAKS: list = []


@functools.cache
def tiny_class():
    """The tests' LightningModule, defined at first use (Lightning imported then)."""

    class Tiny(pl.LightningModule):
        def __init__(self, leak_bytes: int = 0) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)
            self.leak_bytes = leak_bytes

        def training_step(self, batch, index):
            x, y = batch
            if self.leak_bytes and index == 0:
                LEAKS.append(torch.ones(self.leak_bytes // 4))
            return torch.nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch, index):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Tiny


DATA = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))


def trainer(callback, **options):
    defaults = dict(max_epochs=2, callbacks=[callback], logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0)
    return pl.Trainer(**{**defaults, **options})


@pytest.mark.slow
def test_epochs_and_validation_reach_lightnings_logger(tmp_path):
    callback = MemguardCallback(log_every_n_steps=2)
    run = trainer(callback, logger=pl.loggers.CSVLogger(str(tmp_path)), log_every_n_steps=1,
                  num_sanity_val_steps=2)
    run.fit(tiny_class()(), DataLoader(DATA, batch_size=16), DataLoader(DATA, batch_size=32))
    assert [s.name for s in callback.scopes] == [
        "lightning validation 1", "lightning epoch 1", "lightning validation 2",
        "lightning epoch 2"]  # the sanity check is no validation run
    [path] = glob.glob(os.path.join(str(tmp_path), "lightning_logs", "*", "metrics.csv"))
    rows = list(csv.DictReader(open(path)))
    epochs = [r for r in rows if r.get("memory/host/peak")]
    assert len(epochs) == 2
    for row in epochs:  # MiB: a Python process with torch holds well over 50 MiB
        assert 50 < float(row["memory/host/peak"]) < 1e6
        assert 0 <= float(row["memory/host/retained"]) < float(row["memory/host/peak"])
        assert float(row["memory/host/allocated"]) > 10
    assert len([r for r in rows if r.get("val_memory/host/peak")]) == 2
    steps = [float(r["memory/host/step_allocated"]) for r in rows
             if r.get("memory/host/step_allocated")]
    assert steps and all(value > 10 for value in steps)


@pytest.mark.slow
def test_max_leak_spares_the_warm_up_epoch_and_names_the_holder():
    LEAKS.clear()
    callback = MemguardCallback(max_leak="100MiB", track_tensors=True)
    with pytest.raises(memguard.MemoryLeakError, match=r"epoch 2.*global LEAKS\[-1\]"):
        trainer(callback, max_epochs=3).fit(tiny_class()(leak_bytes=200 << 20),
                                            DataLoader(DATA, batch_size=16))
    LEAKS.clear()
    first, second = callback.scopes
    assert first.retained["host"] > 150 << 20  # the warm-up epoch leaked as much, unjudged
    assert second.max_leak == 100 << 20 and callback.failures == []


def test_cleanup_never_only_measures():
    callback = MemguardCallback(cleanup="never")
    trainer(callback, max_epochs=1).fit(tiny_class()(), DataLoader(DATA, batch_size=16))
    assert callback.scopes[0].freed == 0 and callback.scopes[0].cleanup == "never"


def test_an_oom_inside_fit_is_logged_and_the_callback_is_ready_again(caplog):
    class Fails(tiny_class()):
        def training_step(self, batch, index):
            if index == 2:
                torch.empty(1 << 42)  # a real DefaultCPUAllocator failure
            return super().training_step(batch, index)

    callback = MemguardCallback()
    with caplog.at_level(logging.WARNING, "memguard"), pytest.raises(RuntimeError):
        trainer(callback).fit(Fails(), DataLoader(DATA, batch_size=16))
    [failure] = callback.failures
    assert failure["batch_size"] == 16 and failure["step"] == 2
    assert "DefaultCPUAllocator" in failure["error"]
    assert failure["memory"]["devices"]["host"]["reserved"]
    assert "out of memory during fit at step 2, batch_size=16" in caplog.text
    trainer(callback, max_epochs=1).fit(tiny_class()(), DataLoader(DATA, batch_size=16))
    assert [s.name for s in callback.scopes] == ["lightning epoch 1"]  # warm-up again


def oom_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and "out of memory" in r.getMessage()]


def test_an_oom_under_oom_retry_is_logged_once(caplog):
    """Before: the callback's line at on_exception and oom_retry's retry line, both WARNING."""
    class FailsOnce(tiny_class()):
        def training_step(self, batch, index):
            if self.trainer.train_dataloader.batch_size == 16 and index == 2:
                torch.empty(1 << 42)  # a real DefaultCPUAllocator failure
            return super().training_step(batch, index)

    callback = MemguardCallback()

    @memguard.oom_retry(batch_size=16, on_retry=callback.on_retry)
    def fit(batch_size):
        trainer(callback, max_epochs=1).fit(FailsOnce(), DataLoader(DATA, batch_size=batch_size))

    with caplog.at_level(logging.DEBUG, "memguard"):
        fit()
    [line] = oom_lines(caplog)
    assert "DefaultCPUAllocator" in line and "retrying at batch_size=8" in line
    [failure] = callback.failures
    assert failure["batch_size"] == 16 and failure["step"] == 2
    assert "lightning: out of memory during fit at step 2, batch_size=16" in caplog.text


def test_on_exception_closes_the_epoch_without_cleanup_inside_lightnings_except(monkeypatch):
    import memguard.cleanup
    from memguard.loop import error_text

    settled = []
    real = memguard.cleanup.Settler.settle

    def settle(self, pairs, entry, *args, **kwargs):
        settled.append(self)
        return real(self, pairs, entry, *args, **kwargs)

    class Fails(tiny_class()):
        def training_step(self, batch, index):
            torch.empty(1 << 42)  # a real DefaultCPUAllocator failure

    monkeypatch.setattr(memguard.cleanup.Settler, "settle", settle)
    trainer(MemguardCallback(cleanup="always")).fit(tiny_class()(), DataLoader(DATA, batch_size=16))
    assert settled  # the positive control: a fit that ends cleans up through the spy
    settled.clear()
    callback = MemguardCallback(cleanup="always")
    with pytest.raises(RuntimeError) as caught:
        trainer(callback).fit(Fails(), DataLoader(DATA, batch_size=16))
    assert settled == []  # no gc.collect while the traceback holds the failed frames
    [failure] = callback.failures
    assert failure["error"] == error_text(caught.value)
    assert failure["error"].startswith("out of memory (")
    assert "DefaultCPUAllocator" in failure["error"]


@pytest.mark.parametrize("bad, message", [
    (dict(max_leak="lots"), "max_leak"), (dict(log_every_n_steps=0), "log_every_n_steps"),
    (dict(cleanup="sometimes"), "cleanup"), (dict(track_tensors="yes"), "track_tensors"),
])
def test_bad_parameters_are_refused_by_name(bad, message):
    with pytest.raises((ValueError, TypeError), match=message):
        MemguardCallback(**bad)


def test_without_lightning_the_import_error_names_the_package():
    code = ("import sys; sys.modules['pytorch_lightning'] = None; sys.modules['lightning'] = None\n"
            "try:\n    import memguard.integrations.lightning\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60).stdout
    assert 'pip install "memguard-ml[lightning]"' in out and "pytorch-lightning" in out


@pytest.mark.slow
def test_a_budgeted_fit_recovers_through_oom_retry(python_in_subprocess):
    out = python_in_subprocess(script("""
        import logging, warnings
        logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore")
        import torch, pytorch_lightning as pl
        from torch.utils.data import DataLoader, TensorDataset
        import memguard
        from memguard.integrations.lightning import MemguardCallback

        torch.manual_seed(0)
        class Wide(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(32, 4096), torch.nn.ReLU(),
                                               torch.nn.Linear(4096, 1))
            def training_step(self, batch, index):
                x, y = batch
                return torch.nn.functional.mse_loss(self.net(x), y)
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)

        data = TensorDataset(torch.randn(16384, 32), torch.randn(16384, 1))
        model, callback = Wide(), MemguardCallback()

        def fit(batch_size):
            trainer = pl.Trainer(max_epochs=2, callbacks=[callback], logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False)
            trainer.fit(model, DataLoader(data, batch_size=batch_size))
            return trainer

        fit(64)  # warm up: Lightning's and torch's one-time state
        set_budget(300)  # 16384 x 4096 floats are 256 MiB per activation
        # every attempt starts from the weights the first one began with
        train = memguard.oom_retry(batch_size=16384, on_retry=callback.on_retry,
                                   restore=(model,))(fit)
        trainer = train()
        lift_budget()
        print(json.dumps({"final": train.batch_size,
                          "tried": [a.size for a in train.history],
                          "failures": [f["batch_size"] for f in callback.failures],
                          "epochs": trainer.current_epoch,
                          "logged": sorted(trainer.callback_metrics)}))
    """), timeout=240, env=ENV)
    assert out["final"] < 16384 and out["tried"][0] == 16384
    assert out["failures"] == out["tried"][:-1]  # each failure logged by the callback
    assert out["epochs"] == 2 and "memory/host/peak" in out["logged"]
