"""MemguardCallback(microbatch=True): an out-of-memory inside Lightning's training step is
redone in slices within the same optimizer step, with the unsplit step's gradients.

Injected CUDA-style errors are raised from inside a real model's forward or backward when it
is given more samples than ``limit``; the real budget runs in a subprocess under a soft
RLIMIT_AS. Every run is compared with the same training that never ran out of memory.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from memguard import OutOfMemoryError

from budget import ENV, free_port, script
from frameworks import deferred, lazy, requires

integration = lazy("memguard.integrations.lightning")
MemguardCallback = deferred("memguard.integrations.lightning", "MemguardCallback")
pytestmark = requires("pytorch_lightning")

PACKAGES = ["pytorch_lightning", "lightning.pytorch"]
OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"


def lightning(name: str):
    return pytest.importorskip(name)


class Refuse(torch.autograd.Function):
    """Identity in forward; in backward, a CUDA-style out-of-memory for a batch over
    ``limit`` samples."""

    @staticmethod
    def forward(ctx, x, limit):
        ctx.limit = limit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if grad.shape[0] > ctx.limit:
            raise RuntimeError(OOM)
        return grad, None


def module_class(pl):
    class Net(pl.LightningModule):
        """Two layers; runs out of memory in forward (``where="forward"``) or backward for
        more than ``limit`` samples; records the sizes it was called with."""

        def __init__(self, limit=None, where="forward", lr=0.1, output="tensor"):
            super().__init__()
            self.first = torch.nn.Linear(8, 16)
            self.second = torch.nn.Linear(16, 1)
            self.limit, self.where, self.lr, self.output = limit, where, lr, output
            self.sizes: list[int] = []

        def training_step(self, batch, index):
            x, y = batch
            self.sizes.append(len(x))
            if self.limit and self.where == "forward" and len(x) > self.limit:
                raise RuntimeError(OOM)
            hidden = torch.relu(self.first(x))
            if self.limit and self.where == "backward":
                hidden = Refuse.apply(hidden, self.limit)
            loss = torch.nn.functional.mse_loss(self.second(hidden), y)
            if self.output == "dict":
                return {"loss": loss, "seen": len(x)}
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    return Net


def data(n: int = 128) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))


# a quiet one-epoch fit on the CPU
QUIET = dict(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
             enable_model_summary=False, accelerator="cpu", devices=1)


def fit(pl, model, callbacks, batch_size=32, **options):
    trainer = pl.Trainer(**{**QUIET, "callbacks": callbacks, **options})
    trainer.fit(model, DataLoader(data(), batch_size=batch_size))
    return trainer


def distance(a, b) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max((p - q).abs().max().item() for p, q in pairs)


def pair(pl, limit=None, where="forward", **common):
    """A module that runs out of memory over ``limit`` samples and its reference: the same
    start, the same graph, never out of memory."""
    Net = module_class(pl)
    torch.manual_seed(1)
    reference = Net(limit=10 ** 9 if limit else None, where=where, **common)
    model = copy.deepcopy(reference)
    model.limit = limit
    return reference, model


@pytest.mark.parametrize("package", PACKAGES)
def test_an_oom_in_training_step_is_redone_in_slices_with_the_unsplit_weights(package):
    pl = lightning(package)
    reference, model = pair(pl, limit=10)
    fit(pl, reference, [])
    callback = MemguardCallback(microbatch=True)
    trainer = fit(pl, model, [callback])
    assert trainer.global_step == 4  # every step finished, none skipped
    assert model.sizes[:6] == [32, 16, 8, 8, 8, 8]  # the first step split 32 -> 16 -> 8
    assert model.sizes[6:] == [8] * 12  # later steps: at once at the size that fitted
    assert callback.microbatch_size == 8
    assert trainer.callback_metrics[integration.MICROBATCH_KEY].item() == 8
    assert distance(model, reference) < 1e-5
    assert "training_step" not in vars(model)  # the module's own step is back after fit


def test_an_oom_in_backward_with_accumulated_batches():
    pl = lightning("pytorch_lightning")
    reference, model = pair(pl, limit=12, where="backward")
    fit(pl, reference, [], accumulate_grad_batches=2, max_epochs=2)
    callback = MemguardCallback(microbatch=True, factor=0.25)
    trainer = fit(pl, model, [callback], accumulate_grad_batches=2, max_epochs=2)
    assert trainer.global_step == 4
    assert model.sizes[:3] == [32, 8, 8]  # 32 ran out in backward; 8 = 32 * 0.25 fits
    assert distance(model, reference) < 1e-5
    # without the callback the same run fails: the batch really does not fit
    _, failing = pair(pl, limit=12, where="backward")
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        fit(pl, failing, [], accumulate_grad_batches=2)


def test_a_dict_output_with_gradient_clipping_under_lightning_pytorch():
    pl = lightning("lightning.pytorch")
    reference, model = pair(pl, limit=20, output="dict", lr=1.0)
    fit(pl, reference, [], gradient_clip_val=0.05)
    fit(pl, model, [MemguardCallback(microbatch=True)], gradient_clip_val=0.05)
    assert model.sizes[:3] == [32, 16, 16]
    assert distance(model, reference) < 1e-5


def test_the_smallest_slice_running_out_ends_fit_with_an_error_and_the_step_restored():
    pl = lightning("pytorch_lightning")
    _, model = pair(pl, limit=3)
    callback = MemguardCallback(microbatch=True, min_batch_size=8)
    with pytest.raises(OutOfMemoryError):
        fit(pl, model, [callback])
    assert model.sizes == [32, 16, 8]
    assert "training_step" not in vars(model)
    assert callback.failures and callback.failures[0]["step"] == 0


def test_a_step_that_fits_is_the_plain_step():
    pl = lightning("pytorch_lightning")
    reference, model = pair(pl)
    fit(pl, reference, [], accumulate_grad_batches=3)
    callback = MemguardCallback(microbatch=True)
    trainer = fit(pl, model, [callback], accumulate_grad_batches=3)
    assert model.sizes == [32] * 4 and callback.microbatch_size is None
    assert trainer.callback_metrics[integration.MICROBATCH_KEY].item() == 32
    assert distance(model, reference) < 1e-6


def stack_class(pl):
    class Stack(pl.LightningModule):
        """Four blocks in a ``Sequential``; a pass runs out of memory when it keeps more than
        ``cap`` elements for backward, counted by a saved-tensors hook (a checkpointed block
        keeps its tensors under the checkpoint's own hooks, not this one)."""

        def __init__(self, cap=None):
            super().__init__()
            self.blocks = torch.nn.Sequential(*[
                torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(4)])
            self.head = torch.nn.Linear(8, 1)
            self.cap = cap

        def training_step(self, batch, index):
            x, y = batch
            kept = [0]

            def pack(t):
                kept[0] += t.numel()
                if self.cap is not None and kept[0] > self.cap:
                    raise RuntimeError(OOM)
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return torch.nn.functional.mse_loss(self.head(self.blocks(x)), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Stack


def test_a_batch_that_fits_only_recomputed_trains_and_the_log_counts_the_steps():
    """One sample's plain pass keeps more than the cap; with the blocks checkpointed it fits.
    Every step ends with the unbudgeted weights, and the logged count of steps that needed
    the rung grows by one a step."""
    pl = lightning("lightning.pytorch")
    Stack = stack_class(pl)
    torch.manual_seed(1)
    reference = Stack()
    model = copy.deepcopy(reference)
    model.cap = 200  # one sample keeps 274 plain, 50 recomputed
    fit(pl, reference, [])
    seen = []

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            history = callback._step.step.history
            seen.append((trainer.callback_metrics["memory/recomputed_batches"].item(),
                         [a.recompute for a in history if a.ok]))

    callback = MemguardCallback(microbatch=True)
    trainer = fit(pl, model, [callback, Watch()])
    assert trainer.global_step == 4
    assert seen == [(float(n), [True]) for n in range(1, 5)]
    assert distance(model, reference) < 1e-5
    assert "memory/offloaded_batches" not in trainer.callback_metrics
    plain = fit(pl, copy.deepcopy(reference), [MemguardCallback(microbatch=True)])
    assert "memory/recomputed_batches" not in plain.callback_metrics
    with pytest.raises(OutOfMemoryError):  # the rung turned off: one sample does not fit
        fit(pl, copy.deepcopy(model), [MemguardCallback(microbatch=True, recompute=False)])


def test_manual_optimisation_and_bad_options_are_refused():
    pl = lightning("pytorch_lightning")
    _, model = pair(pl)
    model.automatic_optimization = False
    with pytest.raises(ValueError, match=r"automatic_optimization is False.*auto_microbatch"):
        fit(pl, model, [MemguardCallback(microbatch=True)])
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'min_size_bytes'"):
        MemguardCallback(microbatch=True, min_size_bytes=3)
    with pytest.raises(TypeError, match="pass microbatch=True"):
        MemguardCallback(factor=0.5)
    with pytest.raises(ValueError, match="factor"):
        MemguardCallback(microbatch=True, factor=2.0)
    with pytest.raises(TypeError, match="cost must be a callable"):  # passed on, checked
        MemguardCallback(microbatch=True, cost="tokens")
    with pytest.raises(TypeError, match="offload must be True or False"):
        MemguardCallback(microbatch=True, offload="no")
    with pytest.raises(TypeError, match="pass microbatch=True"):
        MemguardCallback(offload=False)


def test_bf16_mixed_precision_split_matches_the_unsplit_bf16_run():
    pl = lightning("pytorch_lightning")
    reference, model = pair(pl, limit=10)
    fit(pl, reference, [], precision="bf16-mixed")
    fit(pl, model, [MemguardCallback(microbatch=True)], precision="bf16-mixed")
    assert model.sizes[:3] == [32, 16, 8]
    # slices' products round to bfloat16 on their own: equal to bfloat16's precision, far
    # closer than one step of gradients (lr 0.1) is to none
    _, untrained = pair(pl)
    assert distance(model, reference) < 2e-3 < distance(untrained, reference) / 10


# -- a real budget ---------------------------------------------------------------------------

BUDGET = """
import copy, importlib
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from memguard.integrations.lightning import MemguardCallback
import memguard
torch.set_num_threads(1)
pl = importlib.import_module("pytorch_lightning")
UNIT = 2 * 2**20 // 4  # 2 MiB of scratch per sample, in forward and again in backward

class Hungry(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        scratch = torch.ones(x.shape[0] * UNIT)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        scratch = torch.ones(grad.shape[0] * UNIT)
        return grad

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(32, 64)
        self.second = torch.nn.Linear(64, 1)
        self.sizes = []

    def training_step(self, batch, index):
        x, y = batch
        self.sizes.append(len(x))
        return F.mse_loss(self.second(torch.relu(Hungry.apply(self.first(x)))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

g = torch.Generator().manual_seed(0)
DATA = TensorDataset(torch.randn(1024, 32, generator=g), torch.randn(1024, 1, generator=g))

def fit(model, callbacks, steps):
    trainer = pl.Trainer(max_steps=steps, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1,
                         accumulate_grad_batches=2)
    trainer.fit(model, DataLoader(DATA, batch_size=256))
    return trainer

torch.manual_seed(0)
model = Net()
reference = copy.deepcopy(model)
fit(reference, [], 2)  # no budget: the whole batch
warm = copy.deepcopy(model)
fit(warm, [MemguardCallback(microbatch=True)], 1)  # warm Lightning and autograd up
del warm
memguard.free_memory()
set_budget(300)
fails = None
try:
    plain = copy.deepcopy(model)
    fit(plain, [], 1)
except Exception as exc:
    fails = memguard.is_oom_error(exc)
del plain
memguard.free_memory()
callback = MemguardCallback(microbatch=True)
trainer = fit(model, [callback], 2)
lift_budget()
diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(),
                                                      reference.parameters()))
print(json.dumps({"sizes": model.sizes, "diff": diff, "steps": trainer.global_step,
                  "plain_fails": fails, "microbatch_size": callback.microbatch_size}))
"""


@pytest.mark.slow
def test_under_a_real_budget_every_step_finishes_with_the_unbudgeted_weights(
        python_in_subprocess):
    out = python_in_subprocess(script(BUDGET), env=ENV, timeout=300)
    assert out["plain_fails"] is True, out  # the configured batch does not fit the budget
    assert out["steps"] == 2, out
    sizes = out["sizes"]
    assert sizes[0] == 256 and out["microbatch_size"] in (64, 128), out
    assert sizes.count(256) == 1 and set(sizes[1:]) <= {128, 64}, out
    assert out["diff"] < 1e-5, out


# -- DDP: 2 gloo ranks, one of them out of memory ----------------------------------------

DDP = """
import copy, os
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
import pytorch_lightning as pl
from memguard.integrations.lightning import MemguardCallback
torch.set_num_threads(1)
RANK = int(os.environ["RANK"])
MICRO = os.environ["MICRO"] == "1"

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 16)
        self.second = torch.nn.Linear(16, 1)
        self.sizes = []

    def training_step(self, batch, index):
        x, y = batch
        self.sizes.append(len(x))
        if MICRO and RANK == 1 and len(x) > 10:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return F.mse_loss(self.second(torch.relu(self.first(x))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

g = torch.Generator().manual_seed(0)
DATA = TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g))
torch.manual_seed(1)
model = Net()
callbacks = [MemguardCallback(microbatch=True)] if MICRO else []
trainer = pl.Trainer(max_epochs=1, callbacks=callbacks, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                     devices=2, num_nodes=1, strategy="ddp", accumulate_grad_batches=2,
                     use_distributed_sampler=True)
trainer.fit(model, DataLoader(DATA, batch_size=32))
finish({"rank": RANK, "sizes": model.sizes,  # gloo's threads may abort at exit
        "weights": [p.detach().flatten().tolist() for p in model.parameters()]})
"""


def ranks(micro: bool, timeout: float) -> list[dict]:
    """Start 2 ranks as a launcher would (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT):
    Lightning joins them instead of starting processes; every one is killed at the end."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, **ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE="2", NODE_RANK="0", MICRO="1" if micro else "0")
    procs = [subprocess.Popen([sys.executable, "-c", script(DDP)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)))
             for rank in range(2)]
    outputs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, stderr[-3000:]
            outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs


@pytest.mark.slow
@pytest.mark.xdist_group("ranks")
def test_ddp_with_one_rank_out_of_memory_ends_with_the_reference_weights_and_no_hang():
    reference = ranks(False, timeout=180)
    first, second = ranks(True, timeout=180)
    assert first["sizes"] == [32] * 4  # rank 0 fits; it waited for rank 1's slices
    assert second["sizes"][:6] == [32, 16, 8, 8, 8, 8] and second["sizes"][6:] == [8] * 12
    for out in (first, second):
        for got, want in zip(out["weights"], reference[0]["weights"], strict=True):
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5


class Unfreeze:
    """A layer frozen when the fit starts, unfrozen at the second epoch (fine-tuning a
    backbone): a Lightning callback of the same package as the Trainer."""

    @staticmethod
    def make(pl):
        class Callback(pl.Callback):
            def on_train_epoch_start(self, trainer, module):
                if trainer.current_epoch == 1:
                    module.first.weight.requires_grad_(True)
                    module.first.bias.requires_grad_(True)

        return Callback()


@pytest.mark.parametrize("limit", [None, 10], ids=["fits", "split"])
def test_a_layer_unfrozen_during_the_fit_trains_from_then_on(limit):
    pl = lightning("pytorch_lightning")
    reference, model = pair(pl, limit=limit)
    for net in (reference, model):
        net.first.weight.requires_grad_(False)
        net.first.bias.requires_grad_(False)
    before = reference.first.weight.detach().clone()
    fit(pl, reference, [Unfreeze.make(pl)], max_epochs=2)
    fit(pl, model, [MemguardCallback(microbatch=True), Unfreeze.make(pl)], max_epochs=2)
    assert (reference.first.weight - before).abs().max() > 1e-3  # precondition: it trained
    assert distance(model, reference) < 1e-5


@pytest.mark.parametrize("limit", [None, 10], ids=["fits", "split"])
def test_a_step_that_returns_none_skips_the_batch_as_without_the_callback(limit):
    pl = lightning("pytorch_lightning")
    Net = module_class(pl)

    class Skipping(Net):
        def training_step(self, batch, index):
            loss = super().training_step(batch, index)
            return None if index == 1 else loss  # Lightning's way to skip a batch

    torch.manual_seed(1)
    reference = Skipping()
    model = copy.deepcopy(reference)
    model.limit = limit
    plain = fit(pl, reference, [])
    trainer = fit(pl, model, [MemguardCallback(microbatch=True)])
    assert trainer.global_step == plain.global_step
    assert distance(model, reference) < 1e-5
    assert "training_step" not in vars(model)  # the module's own step is back


@pytest.mark.parametrize("limit", [None, 10], ids=["fits", "split"])
def test_a_gradient_hook_on_the_parameters_runs_once_a_step_as_without_the_callback(limit):
    # p.register_hook ran in memguard's backward and again when the carrier handed the
    # gradients over: a hook that halves a gradient quartered it, also with no split
    pl = lightning("pytorch_lightning")
    reference, model = pair(pl, limit=limit)
    calls = {id(reference): 0, id(model): 0}

    def halving(key):
        def hook(grad):
            calls[key] += 1
            return grad * 0.5
        return hook

    for net in (reference, model):
        for p in net.parameters():
            p.register_hook(halving(id(net)))
    fit(pl, reference, [])
    fit(pl, model, [MemguardCallback(microbatch=True)])
    assert calls[id(reference)] == 4 * 4  # four steps, four parameters
    assert calls[id(model)] == calls[id(reference)]
    assert distance(model, reference) < 1e-5
    assert all(len(p._backward_hooks) == 1 for p in model.parameters())  # given back


# -- 16-mixed, logged values, the default weight -----------------------------------------------
def _recording(pl, scale=1.0, log=False):
    """The test module whose loss is multiplied by ``scale`` and which records its unscaled
    gradients before each optimizer step; with ``log``, it logs its loss per epoch, weighted
    by the samples it was given, and a torchmetrics sum of the samples it saw."""
    Net = module_class(pl)

    class Recording(Net):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.grads: list[list[torch.Tensor]] = []
            if log:
                torchmetrics = pytest.importorskip("torchmetrics")
                self.samples = torchmetrics.SumMetric()

        def training_step(self, batch, index):
            loss = super().training_step(batch, index) * scale
            if log:
                self.log("train_loss", loss, on_step=False, on_epoch=True,
                         batch_size=len(batch[0]))
                self.samples.update(torch.tensor(float(len(batch[0]))))
                self.log("samples", self.samples, on_step=False, on_epoch=True)
            return loss

        def on_before_optimizer_step(self, optimizer):
            self.grads.append([p.grad.detach().clone() for p in self.parameters()])

    torch.manual_seed(1)
    return Recording


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_16_mixed_split_matches_the_plain_16_mixed_run(where):
    pl = lightning("pytorch_lightning")
    from pytorch_lightning.plugins import MixedPrecision

    Recording = _recording(pl, scale=1e-6)  # unscaled, fp16 gradients of it underflow to 0
    reference = Recording(where=where, lr=1e4)
    model = copy.deepcopy(reference)
    model.limit = 10
    fit(pl, reference, [], plugins=[MixedPrecision("16-mixed", "cpu")])
    fit(pl, model, [MemguardCallback(microbatch=True)],
        plugins=[MixedPrecision("16-mixed", "cpu")])
    assert model.sizes[:3] == [32, 16, 8]
    assert len(model.grads) == len(reference.grads) == 4
    for got, want in zip(model.grads, reference.grads, strict=True):
        for g, w in zip(got, want, strict=True):
            assert w.abs().max() > 0  # precondition: the plain run's did not underflow
            assert (g - w).abs().max() <= 5e-3 * w.abs().max()  # fp16 rounding of slices


def test_a_failed_pass_leaves_no_trace_in_the_logged_epoch_mean():
    pl = lightning("pytorch_lightning")
    Recording = _recording(pl, log=True)
    reference = Recording(where="backward")  # the failed passes log, then run out
    model = copy.deepcopy(reference)
    model.limit = 10
    plain = fit(pl, reference, [])
    trainer = fit(pl, model, [MemguardCallback(microbatch=True)])
    assert model.sizes[:3] == [32, 16, 8]
    want = plain.callback_metrics["train_loss"].item()
    got = trainer.callback_metrics["train_loss"].item()
    assert abs(got - want) < 1e-6 * abs(want)
    assert plain.callback_metrics["samples"].item() == 128  # each sample counted once
    assert trainer.callback_metrics["samples"].item() == 128


def _padded_lm_data():
    g = torch.Generator().manual_seed(3)
    samples = []
    for length in [12, 3, 9, 2, 12, 5, 7, 11, 4, 12, 6, 8, 1, 10, 12, 2]:
        ids = torch.randint(0, 97, (12,), generator=g)
        labels = ids.clone()
        labels[length:] = -100  # right padding
        samples.append({"input_ids": ids, "labels": labels})
    return samples


def test_a_padded_causal_lm_splits_by_tokens_without_weight(caplog):
    pl = lightning("pytorch_lightning")
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=16, n_layer=1,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = transformers.GPT2LMHeadModel(config)
            self.limit = None

        def training_step(self, batch, index):
            if self.limit and len(batch["input_ids"]) > self.limit:
                raise RuntimeError(OOM)
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1.0)

    torch.manual_seed(0)
    reference = LM()
    model = copy.deepcopy(reference)
    model.limit = 3
    options = QUIET
    pl.Trainer(**options).fit(reference, DataLoader(_padded_lm_data(), batch_size=8))
    with caplog.at_level("INFO", logger="memguard"):
        pl.Trainer(callbacks=[MemguardCallback(microbatch=True)], **options).fit(
            model, DataLoader(_padded_lm_data(), batch_size=8))
    assert distance(model, reference) < 1e-5
    assert "labels[..., 1:] that are not -100" in caplog.text


def test_a_slice_with_no_label_logs_nothing_into_the_epoch_mean():
    # a slice whose samples have no label that counts adds nothing to the step; its logged
    # loss, a token mean over nothing, is NaN, and the epoch's mean of it read NaN
    pl = lightning("pytorch_lightning")

    class Tokens(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(20, 8)
            self.head = torch.nn.Linear(8, 20)
            self.limit = None

        def training_step(self, batch, index):
            x, y = batch["x"], batch["y"]
            if self.limit and len(x) > self.limit:
                raise RuntimeError(OOM)
            loss = torch.nn.functional.cross_entropy(self.head(self.embed(x)).flatten(0, 1),
                                                     y.flatten(), ignore_index=-100)
            self.log("train_loss", loss, on_step=False, on_epoch=True, batch_size=len(x))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 20, (32, 6), generator=g)
    y = x.clone()
    y = y.reshape(4, 8, 6)
    y[:, :4] = -100  # the first four samples of every batch of eight: no label
    y = y.reshape(32, 6)
    samples = [{"x": a, "y": b} for a, b in zip(x, y, strict=True)]
    torch.manual_seed(1)
    reference = Tokens()
    model = copy.deepcopy(reference)
    model.limit = 4
    options = QUIET
    plain = pl.Trainer(**options)
    plain.fit(reference, DataLoader(samples, batch_size=8))
    trainer = pl.Trainer(callbacks=[MemguardCallback(microbatch=True)], **options)
    trainer.fit(model, DataLoader(samples, batch_size=8))
    assert distance(model, reference) < 1e-5
    ours = trainer.callback_metrics["train_loss"].item()
    assert math.isfinite(ours), ours
    # the slices' token means weighted by samples, as logged: near the batches' own
    assert ours == pytest.approx(plain.callback_metrics["train_loss"].item(), rel=0.05)
