"""MemguardCallback(microbatch=True) with a dataclass batch, and across a checkpoint: a fit
resumed from one starts from the slice size learned before.

Out-of-memory is a CUDA-style error raised in the module's real training step past ``limit``
samples; each split run is compared with the same training that never ran out of memory.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("pytorch_lightning")

import pytorch_lightning as pl
from test_lightning_microbatch import data, distance, module_class

from memguard.integrations.lightning import MemguardCallback


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor
    source: str = "synthetic"


def as_pairs(samples):
    xs, ys = zip(*samples, strict=True)
    return Pair(torch.stack(xs), torch.stack(ys))


class DataclassNet(module_class(pl)):
    def training_step(self, batch, index):
        assert isinstance(batch, Pair) and batch.source == "synthetic"
        return super().training_step((batch.x, batch.y), index)


def run(model, callbacks, **options):
    defaults = dict(max_epochs=1, callbacks=callbacks, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    accelerator="cpu", devices=1)
    return pl.Trainer(**{**defaults, **options})


def test_a_dataclass_batch_is_split_with_the_unsplit_weights():
    torch.manual_seed(1)
    reference = DataclassNet(limit=10 ** 9)
    model = copy.deepcopy(reference)
    model.limit = 10
    loader = DataLoader(data(), batch_size=32, collate_fn=as_pairs)
    run(reference, []).fit(reference, loader)
    callback = MemguardCallback(microbatch=True)
    trainer = run(model, [callback])
    trainer.fit(model, loader)
    assert trainer.global_step == 4
    assert model.sizes[:6] == [32, 16, 8, 8, 8, 8]
    assert callback.microbatch_size == 8
    assert distance(model, reference) < 1e-5


def test_the_learned_slice_size_is_kept_in_the_checkpoint_and_a_resumed_fit_starts_there(
        tmp_path):
    Net = module_class(pl)
    torch.manual_seed(1)
    model = Net(limit=10)
    loader = DataLoader(data(), batch_size=32)
    trainer = run(model, [MemguardCallback(microbatch=True)], max_steps=2)
    trainer.fit(model, loader)
    assert model.sizes[:3] == [32, 16, 8]
    path = tmp_path / "two.ckpt"
    trainer.save_checkpoint(path)
    resumed = Net(limit=10)
    callback = MemguardCallback(microbatch=True)  # a new process would have a new one
    trainer = run(resumed, [callback], max_steps=4, max_epochs=3)
    trainer.fit(resumed, loader, ckpt_path=str(path))
    assert trainer.global_step == 4
    assert resumed.sizes == [8] * 8  # at the size kept: no whole batch that fails again
    assert callback.microbatch_size == 8
