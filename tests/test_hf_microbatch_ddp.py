"""auto_microbatch(trainer) under DDP: two gloo ranks running the Hugging Face Trainer, whose
``compute_loss`` runs a collective of its own (as TRL's SFTTrainer counts tokens with
``self.accelerator.gather_for_metrics``). A hang is the failure guarded against: every run has
a deadline."""

from __future__ import annotations

import pytest

from budget import run_ranks
from frameworks import requires

# two ranks, a tiny model, two steps: 5-10 s each, not slow
pytestmark = [requires("transformers", "accelerate"), pytest.mark.xdist_group("ranks"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

TRAINER = """
import tempfile, time
import torch, transformers
from memguard.integrations.transformers import auto_microbatch
os.environ["LOCAL_RANK"] = os.environ["RANK"]
torch.set_num_threads(1)
rank = int(os.environ["RANK"])


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x, labels):
        return {"loss": (self.lin(x).squeeze(-1) - labels).pow(2).mean()}


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return {"x": torch.full((3,), float(i % 5)), "labels": torch.tensor(float(i % 3))}


class Counting(transformers.Trainer):
    calls = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        Counting.calls += 1
        if OOM_ON is not None and rank == OOM_ON and torch.is_grad_enabled() \\
                and len(inputs["x"]) > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        seen = self.accelerator.gather_for_metrics(torch.tensor([float(len(inputs["x"]))]))
        Counting.seen = getattr(Counting, "seen", 0.0) + float(seen.sum())
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


args = transformers.TrainingArguments(
    tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=8, learning_rate=0.1,
    optim="sgd", report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True,
    ddp_backend="gloo", remove_unused_columns=False, logging_steps=1)
torch.manual_seed(0)
trainer = auto_microbatch(Counting(model=Model(), args=args, train_dataset=Rows()))
start = time.monotonic()
try:
    trainer.train()
    outcome = "trained"
except Exception as exc:
    outcome = type(exc).__name__ + ": " + str(exc)
finish({"rank": rank, "outcome": outcome, "waited": time.monotonic() - start,
        "calls": Counting.calls, "seen": getattr(Counting, "seen", 0.0),
        "sizes": [a.size for a in trainer.training_step.history],
        "weight": [float(p.detach().sum()) for p in trainer.model.parameters()]})
"""


def test_an_oom_on_one_rank_with_a_collective_in_compute_loss_ends_with_errors(monkeypatch):
    # rank 1 runs out of memory before compute_loss's gather; rank 0 waits in that gather:
    # rank 1 raises memguard's error naming the cause after MEMGUARD_SYNC_TIMEOUT, and rank
    # 0's gather ends with an error once rank 1 is gone
    monkeypatch.setenv("MEMGUARD_SYNC_TIMEOUT", "2")
    outputs = run_ranks("OOM_ON = 1\n" + TRAINER, world=2, timeout=90)
    failed, peer = outputs[1], outputs[0]
    assert failed["outcome"].startswith("MemguardError: rank 1"), outputs
    assert "collective of your own" in failed["outcome"], outputs
    assert 2 <= failed["waited"] < 15, outputs
    assert peer["outcome"] != "trained" and peer["waited"] < 60, outputs


TOKENS = """
import tempfile, time
import torch, transformers
from memguard.integrations.transformers import auto_microbatch
os.environ["LOCAL_RANK"] = os.environ["RANK"]
torch.set_num_threads(1)
rank = int(os.environ["RANK"])
# rows 0-7 (rank 0's first batch) have as many labels each, rows 8-15 (rank 1's) do not
LENGTHS = [3] * 8 + [1, 4, 2, 4, 3, 1, 2, 4] + [2, 3, 1, 4] * 4


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 5)

    def forward(self, x, labels):
        logits = self.lin(x)
        return {"loss": torch.nn.functional.cross_entropy(logits.reshape(-1, 5),
                                                          labels.reshape(-1))}


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return len(LENGTHS)

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        labels = torch.randint(0, 5, (4,), generator=g)
        labels[LENGTHS[i]:] = -100
        return {"x": torch.randn(4, 3, generator=g), "labels": labels}


class Counting(transformers.Trainer):
    gathered = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if torch.is_grad_enabled() and len(inputs["x"]) > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        seen = self.accelerator.gather_for_metrics(inputs["labels"].ne(-100).sum()[None])
        if self.model.training:  # as TRL counts the tokens trained on
            Counting.gathered += int(seen.sum())
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


args = transformers.TrainingArguments(
    tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=8, learning_rate=0.1,
    optim="sgd", report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True,
    ddp_backend="gloo", remove_unused_columns=False, train_sampling_strategy="sequential")
torch.manual_seed(0)
trainer = auto_microbatch(Counting(model=Model(), args=args, train_dataset=Rows()))
start = time.monotonic()
try:
    trainer.train()
    outcome = "trained"
except Exception as exc:
    outcome = type(exc).__name__ + ": " + str(exc)
finish({"rank": rank, "outcome": outcome, "waited": time.monotonic() - start,
        "gathered": Counting.gathered, "sizes": [a.size for a in trainer.training_step.history],
        "weight": [float(p.detach().sum()) for p in trainer.model.parameters()]})
"""


def test_the_mean_reading_runs_compute_loss_with_a_collective_alike_on_every_rank(monkeypatch):
    # both ranks split; only rank 1's batch has labels that can tell a mean over tokens from
    # one over samples: the reading must not leave rank 1's gathers unmatched, nor count
    # its gradient-free losses among the tokens trained on
    monkeypatch.setenv("MEMGUARD_SYNC_TIMEOUT", "5")
    outputs = run_ranks(TOKENS, world=2, timeout=90)
    for out in outputs:
        assert out["outcome"] == "trained", outputs
    total = sum(min(n, 4) for n in [3] * 8 + [1, 4, 2, 4, 3, 1, 2, 4] + [2, 3, 1, 4] * 4)
    assert [out["gathered"] for out in outputs] == [total, total], outputs
    assert outputs[0]["weight"] == outputs[1]["weight"], outputs
