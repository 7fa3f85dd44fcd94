"""Step-level out-of-memory recovery inside a real Hugging Face Trainer
(memguard.integrations.transformers.auto_microbatch) and MemguardCallback's step logs.

A tiny GPT-2 built from a config (nothing is downloaded), trained with SGD; out-of-memory
comes from CUDA-style errors raised inside the model's real forward or backward, or from a
real RLIMIT_AS budget in a subprocess. Every split run is compared with a run that never ran
out of memory.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

from memguard.integrations.transformers import MemguardCallback  # noqa: E402

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
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
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0,
                                     n_positions=32)
    return transformers.GPT2LMHeadModel(config)


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
