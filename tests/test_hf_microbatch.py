"""Step-level out-of-memory recovery inside a real Hugging Face Trainer
(memguard.integrations.transformers.auto_microbatch) and MemguardCallback's step logs.

A tiny GPT-2 built from a config (nothing is downloaded), trained with SGD; out-of-memory
comes from CUDA-style errors raised inside the model's real forward or backward, or from a
real RLIMIT_AS budget in a subprocess. Every split run is compared with a run that never ran
out of memory.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

import memguard

from frameworks import deferred, lazy, requires

transformers = lazy("transformers")
MemguardCallback = deferred("memguard.integrations.transformers", "MemguardCallback")
auto_microbatch = deferred("memguard.integrations.transformers", "auto_microbatch")
pytestmark = requires("transformers", "accelerate")  # the Trainer needs accelerate

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(memguard.__file__).resolve().parents[1]
CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity)"


class Padded(torch.utils.data.Dataset):
    """Sequences of uneven length padded to ``length``: labels -100 on the padding."""

    def __init__(self, n: int = 16, length: int = 12) -> None:
        self.n, self.length = n, length

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 100, (self.length,), generator=g)
        used = 3 + (i * 5) % (self.length - 2)
        labels = ids.clone()
        labels[used:] = -100
        mask = torch.zeros(self.length, dtype=torch.long)
        mask[:used] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100,
                                     n_positions=32, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


class Ceiling:
    """A CUDA-style out-of-memory raised inside the model's real first block when more than
    ``limit`` samples pass through it: in forward, or in backward (from a hook on the
    block's output gradient). ``seen`` counts the samples each training pass ran."""

    def __init__(self, model, limit: int, where: str = "forward") -> None:
        self.limit, self.where, self.failures, self.seen = limit, where, 0, []
        self.model = model
        model.transformer.h[0].register_forward_hook(self.hook)

    def fail_if_over(self, n: int) -> None:
        if self.where == "plain passes" and self.model.is_activation_checkpointing:
            return  # recomputed: the activations this ceiling stands for are not kept
        if self.limit is not None and n > self.limit:
            self.failures += 1
            raise RuntimeError(CUDA_OOM)

    def hook(self, module, inputs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if torch.is_grad_enabled():  # a training pass (not memguard's gradient-free check)
            self.seen.append(hidden.shape[0])
        if self.where == "forward":
            self.fail_if_over(hidden.shape[0])
        elif torch.is_grad_enabled():
            hidden.register_hook(lambda grad: self.fail_if_over(grad.shape[0]))


def arguments(tmp_path, **options):
    defaults = dict(max_steps=4, per_device_train_batch_size=8, learning_rate=0.1,
                    optim="sgd", lr_scheduler_type="constant", report_to=[],
                    save_strategy="no", logging_strategy="no", disable_tqdm=True,
                    use_cpu=True, seed=0, data_seed=0)
    defaults.update(options)
    return transformers.TrainingArguments(str(tmp_path), **defaults)


def make_trainer(tmp_path, cls=None, model=None, callbacks=None, n=16, **options):
    return (cls or transformers.Trainer)(
        model=model or tiny_gpt2(), args=arguments(tmp_path, **options),
        train_dataset=Padded(n), callbacks=callbacks)


# -- MemguardCallback's step logs join the Trainer's ------------------------------------------
@pytest.mark.parametrize("every", [4, 3])
def test_step_memory_joins_the_trainers_log_entries(tmp_path, every):
    callback = MemguardCallback(log_every_n_steps=every)
    trainer = make_trainer(tmp_path, callbacks=[callback], max_steps=12, n=96,
                           logging_strategy="steps", logging_steps=4)
    trainer.train()
    history = trainer.state.log_history
    losses = [e["step"] for e in history if "loss" in e]
    assert losses == [4, 8, 12]  # the Trainer's own entries, all of them
    for entry in history:
        if "loss" in entry:
            assert "grad_norm" in entry and "learning_rate" in entry
    memory = sorted({e["step"] for e in history if "memory/host/step_allocated" in e})
    assert memory == list(range(every, 13, every))
    if every == 4:  # both log at the same steps: one entry each, memory joined to the loss
        assert all("loss" in e for e in history if "memory/host/step_allocated" in e)


# -- auto_microbatch(trainer) -----------------------------------------------------------------
def trained(tmp_path, limit=None, where="forward", cls=None, wrap=True, callbacks=None,
            loss_kwargs=None, options=None, **args):
    """(trainer, ceiling) after train(): split by auto_microbatch when ``wrap``."""
    model = tiny_gpt2()
    ceiling = Ceiling(model, limit, where)
    trainer = make_trainer(tmp_path, cls=cls, model=model, callbacks=callbacks, **args)
    if loss_kwargs is not None:
        trainer.model_accepts_loss_kwargs = loss_kwargs
    if wrap:
        trainer = auto_microbatch(trainer, **(options or {}))
    trainer.train()
    return trainer, ceiling


def distance(a, b) -> float:
    return max((p - q).abs().max().item()
               for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_oom_redoes_the_batch_in_slices_inside_train(tmp_path, where):
    reference, _ = trained(tmp_path / "ref", wrap=False, logging_strategy="steps",
                           logging_steps=2)
    trainer, ceiling = trained(tmp_path / "split", limit=4, where=where,
                               logging_strategy="steps", logging_steps=2)
    assert ceiling.failures == 1  # the first step's whole batch; later steps start at 4
    assert trainer.state.global_step == 4
    assert trainer.training_step.microbatch_size == 4
    assert [a.size for a in trainer.training_step.history] == [4]
    assert distance(trainer, reference) < 1e-5
    ours = [e for e in trainer.state.log_history if "loss" in e]
    theirs = [e for e in reference.state.log_history if "loss" in e]
    assert [e["step"] for e in ours] == [2, 4]
    for mine, ref in zip(ours, theirs, strict=True):
        assert mine["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert mine["memory/microbatch_size"] == 4


def test_num_items_in_batch_slices_sum_to_the_whole_batch_with_accumulation(tmp_path):
    reference, _ = trained(tmp_path / "ref", wrap=False, gradient_accumulation_steps=2,
                           per_device_train_batch_size=4, n=32)
    assert reference.model_accepts_loss_kwargs  # the Trainer passes num_items_in_batch
    trainer, ceiling = trained(tmp_path / "split", limit=2, gradient_accumulation_steps=2,
                               per_device_train_batch_size=4, n=32)
    assert ceiling.failures == 1 and trainer.state.global_step == 4
    assert set(ceiling.seen[1:]) == {2}  # every later batch ran in slices of 2
    assert distance(trainer, reference) < 1e-6


def test_without_num_items_in_batch_slices_are_weighted_by_tokens(tmp_path):
    # the model's own loss, a mean over the non-padding tokens of what it is given
    reference, _ = trained(tmp_path / "ref", wrap=False, loss_kwargs=False)
    trainer, ceiling = trained(tmp_path / "split", limit=3, loss_kwargs=False)
    assert ceiling.failures >= 1 and trainer.training_step.microbatch_size <= 3
    assert distance(trainer, reference) < 1e-6
    # weighted by samples instead, the same split is visibly off: the test can tell
    by_samples, _ = trained(tmp_path / "samples", limit=3, loss_kwargs=False,
                            options={"weight": lambda batch: len(batch["input_ids"])})
    assert distance(by_samples, reference) > 1e-4


@functools.cache
def doubled_class():
    """A user's Trainer, defined at first use (transformers imported then)."""

    class Doubled(transformers.Trainer):
        """A user's own compute_loss that hands num_items_in_batch on (as trainers built on
        Trainer do)."""

        calls = 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            Doubled.calls += 1
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
            return (loss * 2.0, outputs) if return_outputs else loss * 2.0

    return Doubled


@functools.cache
def own_mean_class():
    """A user's Trainer, defined at first use (transformers imported then)."""

    class OwnMean(transformers.Trainer):
        """A user's own compute_loss that ignores num_items_in_batch: a mean over the tokens
        of what it is given, declared as the Trainer asks."""

        loss_is_scaled_for_ga = False

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            return (outputs.loss, outputs) if return_outputs else outputs.loss

    return OwnMean


def test_a_subclass_with_its_own_compute_loss_and_the_callback(tmp_path):
    Doubled = doubled_class()
    reference, _ = trained(tmp_path / "ref", cls=Doubled, wrap=False)
    callback = MemguardCallback(log_every_n_steps=2)
    trainer, ceiling = trained(tmp_path / "split", cls=Doubled, limit=4, callbacks=[callback],
                               logging_strategy="steps", logging_steps=2)
    assert ceiling.failures == 1 and Doubled.calls > 8
    assert callback._trainer() is trainer  # attached by auto_microbatch, not looked for
    assert distance(trainer, reference) < 1e-5
    entries = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in entries] == [2, 4]
    for entry in entries:  # one entry: the Trainer's, memguard's memory and microbatch size
        assert entry["memory/microbatch_size"] == 4
        assert "memory/host/step_allocated" in entry and "grad_norm" in entry


def test_a_subclass_whose_loss_ignores_num_items_is_weighted_by_tokens(tmp_path):
    OwnMean = own_mean_class()
    reference, _ = trained(tmp_path / "ref", cls=OwnMean, wrap=False)
    trainer, ceiling = trained(tmp_path / "split", cls=OwnMean, limit=3)
    assert ceiling.failures >= 1
    assert distance(trainer, reference) < 1e-6


class Regression(torch.nn.Module):
    """Hugging Face's own test ``RegressionModel`` pattern: ``forward`` takes ``**kwargs``
    (so the Trainer passes ``num_items_in_batch``) and returns its own mean loss, ignoring
    it. Out of memory, CUDA-style, for more than ``limit`` samples."""

    def __init__(self, limit=None):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(3, 1)
        self.limit = limit

    def forward(self, input_x, labels=None, **kwargs):
        if self.limit is not None and input_x.shape[0] > self.limit:
            raise RuntimeError(CUDA_OOM)
        y = self.layer(input_x).squeeze(-1)
        if labels is None:
            return (y,)
        return (torch.nn.functional.mse_loss(y, labels), y)


class Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(3, generator=g)
        return {"input_x": x, "labels": x.sum() * 2.0 + torch.randn((), generator=g)}


@pytest.mark.parametrize("accumulate, weight", [(1, None), (2, None), (1, "samples")])
def test_a_model_taking_kwargs_that_ignores_num_items_splits_exactly(tmp_path, accumulate,
                                                                     weight):
    # weight= as memguard's warning advises: before, the Trainer's assumption (a loss
    # divided by num_items_in_batch) stood, and the slices added up unweighted: the loss
    # and the gradients times the slices
    options = {} if weight is None else {"weight": lambda batch: len(batch["input_x"])}

    def run(limit, wrap, name):
        trainer = transformers.Trainer(
            model=Regression(limit), train_dataset=Points(),
            args=arguments(tmp_path / name, logging_strategy="steps", logging_steps=1,
                           gradient_accumulation_steps=accumulate))
        if wrap:
            trainer = auto_microbatch(trainer, **options)
        trainer.train()
        return trainer

    reference = run(None, False, "ref")
    assert reference.model_accepts_loss_kwargs  # the Trainer passes num_items_in_batch
    trainer = run(2, True, "split")
    assert trainer.training_step.microbatch_size == 2
    ours = [e for e in trainer.state.log_history if "loss" in e]
    theirs = [e for e in reference.state.log_history if "loss" in e]
    assert len(ours) == len(theirs) == 4
    for mine, ref in zip(ours, theirs, strict=True):
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert distance(trainer, reference) < 1e-6


def test_a_step_that_fits_is_left_whole_and_bad_arguments_are_named(tmp_path):
    trainer, ceiling = trained(tmp_path, limit=None)
    assert trainer.training_step.microbatch_size == 8 and ceiling.failures == 0
    with pytest.raises(TypeError, match=r"needs a transformers\.Trainer, got Linear"):
        auto_microbatch(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="reduction"):
        auto_microbatch(trainer, reduction="median")
    with pytest.raises(TypeError, match="unexpected keyword argument 'min_size'"):
        auto_microbatch(trainer, min_size=2)
    with pytest.raises(TypeError, match="cost must be a callable"):  # passed on, checked
        auto_microbatch(trainer, cost=1.0)
    with pytest.raises(TypeError, match="offload must be True or False"):
        auto_microbatch(trainer, offload="no")


def test_a_batch_that_fits_only_recomputed_trains_and_the_log_counts_the_steps(tmp_path):
    """Every plain pass runs out, down to one sample; each step's batch then runs with the
    model's own gradient checkpointing, for that batch only. The log entries count the steps
    that needed it, and the weights are the unbudgeted run's."""
    reference, _ = trained(tmp_path / "ref", wrap=False)
    trainer, ceiling = trained(tmp_path / "split", limit=0, where="plain passes",
                               logging_strategy="steps", logging_steps=2)
    assert trainer.state.global_step == 4
    assert ceiling.failures >= 4  # each step's plain passes ran out
    assert trainer.training_step.history[-1].recompute
    assert not trainer.model.is_activation_checkpointing  # off again after each batch
    assert distance(trainer, reference) < 1e-5
    counted = [(e["step"], e["memory/recomputed_batches"]) for e in trainer.state.log_history
               if "loss" in e]
    assert counted == [(2, 2.0), (4, 4.0)], trainer.state.log_history
    assert not any("memory/offloaded_batches" in e for e in trainer.state.log_history)
    fitted, _ = trained(tmp_path / "whole", logging_strategy="steps", logging_steps=2)
    assert not any("memory/recomputed_batches" in e for e in fitted.state.log_history)


def test_the_smallest_slice_failing_too_ends_train_with_the_error(tmp_path):
    with pytest.raises(memguard.OutOfMemoryError) as caught:
        trained(tmp_path, limit=0, options={"min_batch_size": 2})
    # named as the user knows it, not by memguard's inner function
    assert str(caught.value).startswith("Trainer.training_step: out of memory"), caught.value


# -- a real budget ----------------------------------------------------------------------------
BUDGETED = """
os.environ["TRANSFORMERS_VERBOSITY"] = "error"
import warnings; warnings.filterwarnings("ignore")
import tempfile, torch, transformers
from memguard.integrations.transformers import auto_microbatch
torch.set_num_threads(1)

class Padded(torch.utils.data.Dataset):
    def __init__(self, n, length):
        self.n, self.length = n, length
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 2000, (self.length,), generator=g)
        used = 8 + (i * 7) % (self.length - 8)
        labels = ids.clone()
        labels[used:] = -100
        mask = torch.zeros(self.length, dtype=torch.long)
        mask[:used] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

def model():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=2000, n_positions=64, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

def trainer(batch, steps, accumulate=1):
    args = transformers.TrainingArguments(
        tempfile.mkdtemp(), max_steps=steps, per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulate, learning_rate=0.1, optim="sgd",
        lr_scheduler_type="constant", report_to=[], save_strategy="no",
        logging_strategy="steps", logging_steps=1, disable_tqdm=True, use_cpu=True, seed=0,
        data_seed=0)
    return transformers.Trainer(model=model(), args=args,
                                train_dataset=Padded(batch * steps * accumulate, 64))

trainer(4, 1).train()  # warm up
set_budget(150)  # logits and their gradients of 128 x 64 x 2000 floats do not fit
guarded = auto_microbatch(trainer(128, 4, accumulate=2))
guarded.train()
lift_budget()
reference = trainer(128, 4, accumulate=2)
reference.train()
distance = max((p - q).abs().max().item() for p, q in
               zip(guarded.model.parameters(), reference.model.parameters()))
print(json.dumps({
    "steps": guarded.state.global_step, "distance": distance,
    "size": guarded.training_step.microbatch_size,
    "logged": [e.get("memory/microbatch_size") for e in guarded.state.log_history
               if "loss" in e]}))
"""


@pytest.mark.slow
def test_a_real_budget_the_batch_does_not_fit_trains_every_step(python_in_subprocess):
    from budget import ENV, script

    out = python_in_subprocess(script(BUDGETED), timeout=300, env=ENV)
    assert out["steps"] == 4
    logged = out["logged"]  # the slice size of each logged step: split, never larger
    assert len(logged) == 4 and all(size < 128 for size in logged)
    assert logged[-1] == out["size"] and logged == sorted(logged, reverse=True)
    assert out["distance"] < 1e-5


# -- DDP under torch.distributed.run ----------------------------------------------------------
@pytest.fixture
def launchers(tmp_path):
    import test_torchrun as torchrun_tools  # its Launchers kill every worker by pid

    started = torchrun_tools.Launchers(tmp_path)
    try:
        yield started
    finally:
        started.end()


@pytest.mark.slow
@pytest.mark.xdist_group("ranks")
def test_ddp_one_rank_alone_runs_out_of_memory(launchers):
    import test_torchrun as torchrun_tools

    from budget import free_port

    script = torchrun_tools.SCRIPTS / "hf_worker.py"
    launchers.start(["--nnodes=1", "--nproc_per_node=2", f"--master-port={free_port()}",
                     str(script), str(launchers.out)],
                    PYTHONPATH=os.pathsep.join([str(ROOT), str(script.parent.parent)]))
    assert launchers.wait(deadline=240) == [0], launchers.tails()
    results = launchers.results()
    assert set(results) == {"rank0", "rank1"}, launchers.tails()
    assert results["rank1"]["failures"] == 1 and results["rank0"]["failures"] == 0
    assert results["rank1"]["size"] == 4 and results["rank0"]["size"] == 8
    for data in results.values():
        assert data["steps"] == 3
    saved = [torch.load(launchers.out / f"rank{r}.pt") for r in (0, 1)]
    for a, b in zip(saved[0]["guarded"], saved[1]["guarded"], strict=True):
        assert torch.equal(a, b)  # the ranks end with the same weights
    for ours, theirs in zip(saved[0]["guarded"], saved[0]["reference"], strict=True):
        assert (ours - theirs).abs().max().item() < 1e-5  # as if nothing ran out of memory
    assert not torchrun_tools.ended_by_themselves(launchers)


def test_whether_a_loss_divides_by_num_items_is_read_on_samples_with_labels():
    # a batch whose first samples have no label that counts (all -100): their losses, a mean
    # over nothing, are NaN. Read on them, the answer was "cannot tell", the Trainer's
    # assumption stood (the slices' losses added up), and a step whose first slice had no
    # label logged NaN, its loss a mean of its own
    from memguard.integrations._transformers_step import _divided_by_items

    counts = [0, 0, 0, 0, 0, 5, 3, 2]
    values = [2.0, 1.0, 4.0]  # the labelled samples' own means

    def own_mean(i, j, count):  # ignores count: a mean over its labels
        labelled = [(v, c) for v, c in zip(values, counts[5:], strict=True)]
        picked = [labelled[k - 5] for k in range(i, j) if counts[k]]
        return (sum(v * c for v, c in picked) / sum(c for _, c in picked) if picked
                else float("nan"))

    def divided(i, j, count):
        return sum(v * c for v, c in ([(values[k - 5], counts[k]) for k in range(i, j)
                                       if counts[k]])) / count

    def tokens(i, j):
        return float(sum(counts[i:j]))

    assert _divided_by_items(own_mean, 10, 8, tokens) is False
    assert _divided_by_items(divided, 10, 8, tokens) is True
    assert _divided_by_items(own_mean, 10, 8) is None  # the first four alone: cannot tell
