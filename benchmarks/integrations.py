"""The integrations' cost: ``MemguardCallback`` in a PyTorch Lightning ``fit`` whose training
step takes about 10 ms.

Fair to the bare run: both fit the same module on the same data with the same Trainer
settings (no logger, no checkpoints, no progress bar), in one fresh process, in adjacent
pairs whose order alternates; the figure is the median of the pairs' ratios. Each fit builds
its Trainer, as a user's does; the callback runs with its defaults (an auto-cleanup
``memory_scope`` per epoch, no step readings) plus ``log_every_n_steps=10`` in a second row.
"""

from __future__ import annotations

import importlib.util

from benchmarks.common import Result, run_python

LIGHTNING = r"""
import json, logging, statistics, time, warnings
warnings.filterwarnings("ignore")
for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
    logging.getLogger(name).setLevel(logging.ERROR)
import torch, pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset
from memguard.integrations.lightning import MemguardCallback

torch.manual_seed(0)
torch.set_num_threads(1)

class Step(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                       torch.nn.Linear(1024, 256))
    def training_step(self, batch, index):
        (x,) = batch
        return self.net(x).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

STEPS, BATCH = {steps}, {batch}
data = TensorDataset(torch.randn(STEPS * BATCH, 256))
model = Step()

def fit(callbacks):
    trainer = pl.Trainer(max_epochs=1, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    loader = DataLoader(data, batch_size=BATCH)
    start = time.perf_counter()
    trainer.fit(model, loader)
    return time.perf_counter() - start

variants = {{"bare": lambda: fit([]), "callback": lambda: fit([MemguardCallback()]),
            "steps": lambda: fit([MemguardCallback(log_every_n_steps=10)])}}
for fn in variants.values():
    fn()  # warm up
times = {{name: [] for name in variants}}
for index in range({pairs}):
    names = list(variants) if index % 2 == 0 else list(reversed(variants))
    for name in names:
        times[name].append(variants[name]())
ratio = {{name: statistics.median(t / b for t, b in zip(times[name], times["bare"]))
         for name in ("callback", "steps")}}
print(json.dumps({{"ratio": ratio, "bare": statistics.median(times["bare"]),
                   "step_ms": 1000 * statistics.median(times["bare"]) / STEPS}}))
"""


def lightning_callback(quick: bool) -> list[Result]:
    """Benchmark 10: a Lightning fit of 1 epoch of ~10 ms steps with and without
    ``MemguardCallback``: target <= 1.02x the bare fit."""
    if importlib.util.find_spec("pytorch_lightning") is None:
        return [Result("10 Lightning MemguardCallback on a 10 ms step", 0.0, None, "x",
                       "bare fit", "<= 1.02x", None, "skipped: pytorch-lightning not installed")]
    steps, pairs = (50, 6) if quick else (100, 12)
    out = run_python(LIGHTNING.format(steps=steps, batch=256, pairs=pairs))
    notes = (f"median of {pairs} adjacent pairs of 1-epoch fits of {steps} steps; the bare "
             f"step took {out['step_ms']:.1f} ms (fit {out['bare']:.2f} s)")
    return [
        Result("10a Lightning MemguardCallback() per fit", out["ratio"]["callback"], 1.0, "x",
               "bare fit", "<= 1.02x", out["ratio"]["callback"] <= 1.02, notes),
        Result("10b ... with log_every_n_steps=10", out["ratio"]["steps"], 1.0, "x",
               "bare fit", "reported", None, notes),
    ]


BENCHMARKS = [lightning_callback]
