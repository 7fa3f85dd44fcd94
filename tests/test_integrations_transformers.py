"""memguard.integrations.transformers.MemguardCallback against a real Hugging Face Trainer
(a tiny GPT-2 built from a config: nothing is downloaded)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import memguard

from budget import ENV, script
from frameworks import deferred, lazy, requires

transformers = lazy("transformers")
MemguardCallback = deferred("memguard.integrations.transformers", "MemguardCallback")
pytestmark = requires("transformers", "accelerate")  # the Trainer needs accelerate

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
LEAKS: list = []


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 16, length: int = 16) -> None:
        self.n, self.length = n, length

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, 100, (self.length,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100,
                                     n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def make_trainer(tmp_path, callback, model=None, **options):
    args = transformers.TrainingArguments(
        str(tmp_path), num_train_epochs=options.pop("epochs", 2), per_device_train_batch_size=8,
        per_device_eval_batch_size=8, report_to=[], save_strategy="no", logging_strategy="no",
        disable_tqdm=True, use_cpu=True, **options)
    return transformers.Trainer(model=model or tiny_gpt2(), args=args, train_dataset=Tokens(),
                                eval_dataset=Tokens(8), callbacks=[callback])


@pytest.mark.slow
def test_epochs_and_evaluations_go_into_log_history(tmp_path):
    callback = MemguardCallback(log_every_n_steps=2)
    trainer = make_trainer(tmp_path, callback, eval_strategy="epoch")
    trainer.train()
    history = trainer.state.log_history
    epochs = [e for e in history if "memory/host/peak" in e]
    assert [e["epoch"] for e in epochs] == [1.0, 2.0]
    for entry in epochs:  # MiB
        assert 50 < entry["memory/host/peak"] < 1e6 and entry["memory/host/allocated"] > 10
        assert 0 <= entry["memory/host/retained"] < entry["memory/host/peak"]
    assert len([e for e in history if "val_memory/host/peak" in e]) == 2
    steps = [e["step"] for e in history if "memory/host/step_allocated" in e]
    assert steps == [2, 4]  # 16 samples at 8: 2 steps an epoch
    metrics = trainer.evaluate()  # a bare evaluate() returns the figures too
    assert metrics["val_memory/host/peak"] > 50
    assert [s.name for s in callback.scopes][-1] == "transformers validation 3"


@pytest.mark.slow
def test_max_leak_spares_the_warm_up_epoch_and_names_the_holder(tmp_path):
    class Leaky(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % 2 == 1:
                LEAKS.append(torch.ones(50 << 20))  # 200 MiB an epoch

    LEAKS.clear()
    callback = MemguardCallback(max_leak="100MiB", track_tensors=True)
    trainer = make_trainer(tmp_path, callback, epochs=3)
    trainer.add_callback(Leaky())
    with pytest.raises(memguard.MemoryLeakError, match=r"epoch 2.*LEAKS\[-1\]"):
        trainer.train()
    LEAKS.clear()
    assert callback.scopes[0].retained["host"] > 150 << 20  # the warm-up, unjudged


def test_an_oom_is_logged_through_on_retry_and_the_next_train_runs(tmp_path, caplog):
    callback = MemguardCallback()
    model = tiny_gpt2()
    calls = []

    class OOMOnce(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if not calls:
                calls.append(state.global_step)
                torch.empty(1 << 42)  # a real DefaultCPUAllocator failure at step 1

    @memguard.oom_retry(batch_size=8, on_retry=callback.on_retry)
    def train(batch_size):
        trainer = make_trainer(tmp_path, callback, model=model, epochs=1)
        trainer.args.per_device_train_batch_size = batch_size
        trainer.add_callback(OOMOnce())
        trainer.train()
        return trainer

    with caplog.at_level(logging.DEBUG, "memguard"):
        trainer = train()
    [failure] = callback.failures
    assert failure["batch_size"] == 8 and failure["step"] == 1
    assert "DefaultCPUAllocator" in failure["error"] and failure["memory"]["devices"]["host"]
    # logged once, at WARNING by oom_retry; the callback's line (DEBUG) adds the step
    [line] = [r.getMessage() for r in caplog.records
              if r.levelno >= logging.WARNING and "out of memory" in r.getMessage()]
    assert "retrying at batch_size=4" in line
    assert "transformers: out of memory during train at step 1, batch_size=8" in caplog.text
    assert [a.size for a in train.history] == [8, 4]
    assert [s.name for s in callback.scopes] == ["transformers epoch 1"]  # after the retry
    assert any("memory/host/peak" in e for e in trainer.state.log_history)


def test_without_transformers_the_import_error_names_the_package():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "try:\n    import memguard.integrations.transformers\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60).stdout
    assert 'pip install "memguard-ml[transformers]"' in out


@pytest.mark.slow
def test_a_budgeted_train_recovers_through_oom_retry(python_in_subprocess):
    out = python_in_subprocess(script("""
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"
        import warnings; warnings.filterwarnings("ignore")
        import tempfile, torch, transformers
        import memguard
        from memguard.integrations.transformers import MemguardCallback

        class Tokens(torch.utils.data.Dataset):
            def __len__(self):
                return 1024
            def __getitem__(self, i):
                ids = torch.randint(0, 1000, (128,))
                return {"input_ids": ids, "labels": ids}

        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=1, n_embd=32, n_head=2, vocab_size=1000, n_positions=128))
        callback = MemguardCallback()

        def train(batch_size, max_steps=2):
            args = transformers.TrainingArguments(
                tempfile.mkdtemp(), max_steps=max_steps, per_device_train_batch_size=batch_size,
                report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
                use_cpu=True)
            trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                           callbacks=[callback])
            trainer.train()
            return trainer

        train(4)  # warm up
        set_budget(400)  # logits of 1024 x 128 x 1000 floats are 500 MiB
        guarded = memguard.oom_retry(batch_size=1024, on_retry=callback.on_retry,
                                     restore=(model,))(train)
        trainer = guarded()
        lift_budget()
        print(json.dumps({"final": guarded.batch_size,
                          "tried": [a.size for a in guarded.history],
                          "failures": [f["batch_size"] for f in callback.failures],
                          "logged": [sorted(e) for e in trainer.state.log_history
                                     if "memory/host/peak" in e]}))
    """), timeout=300, env=ENV)
    assert out["final"] < 1024 and out["tried"][0] == 1024
    assert out["failures"] == out["tried"][:-1]
    assert out["logged"], "the successful run logged its epoch"
