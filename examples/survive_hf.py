"""Survive an out-of-memory in a Hugging Face Trainer: the step redoes its batch in slices."""
import tempfile

import torch
import transformers

import memguard
from memguard.integrations.transformers import auto_microbatch

torch.manual_seed(0)
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 8000, (384, 64))]
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    n_layer=1, n_embd=32, n_head=2, vocab_size=8000, n_positions=64))
args = transformers.TrainingArguments(
    tempfile.mkdtemp(), max_steps=3, per_device_train_batch_size=128, report_to=[],
    save_strategy="no", disable_tqdm=True)
trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
trainer.remove_callback(transformers.PrinterCallback)     # keep the output to our own line
auto_microbatch(trainer)                                  # the one added line

with memguard.memory_limit("450MiB", device="host"):     # rehearse a smaller device
    trainer.train()
size = trainer.training_step.microbatch_size
print(f"{trainer.state.global_step} steps of 128, in slices of {size}")
