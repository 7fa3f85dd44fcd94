"""A torchrun worker: a tiny GPT-2 in Hugging Face's Trainer under DDP (gloo, CPU), trained
once without any out-of-memory and once with auto_microbatch(trainer) while rank 1 alone
runs out of memory (a CUDA-style error in its backward once more than 4 samples pass).

Usage: hf_worker.py OUT_FOLDER. Writes OUT/rank<r>.json and OUT/rank<r>.pt (both runs'
weights).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from torchrun_common import record_pid

os.environ["TRANSFORMERS_VERBOSITY"] = "error"
warnings.filterwarnings("ignore")

import transformers  # noqa: E402
from test_hf_microbatch import Ceiling, Padded, tiny_gpt2  # noqa: E402

from memguard.integrations.transformers import auto_microbatch  # noqa: E402


def trainer(folder: str, model: torch.nn.Module) -> transformers.Trainer:
    args = transformers.TrainingArguments(
        folder, max_steps=3, per_device_train_batch_size=8, gradient_accumulation_steps=2,
        learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", report_to=[],
        save_strategy="no", logging_strategy="steps", logging_steps=1, disable_tqdm=True,
        use_cpu=True, ddp_backend="gloo", seed=0, data_seed=0)
    return transformers.Trainer(model=model, args=args, train_dataset=Padded(96))


def main() -> None:
    out = sys.argv[1]
    record_pid(out)
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    reference = trainer(tempfile.mkdtemp(), tiny_gpt2())
    reference.train()
    model = tiny_gpt2()
    ceiling = Ceiling(model, 4 if rank == 1 else None, "backward")
    guarded = auto_microbatch(trainer(tempfile.mkdtemp(), model))
    guarded.train()
    weights = {"reference": [p.detach().clone() for p in reference.model.parameters()],
               "guarded": [p.detach().clone() for p in guarded.model.parameters()]}
    torch.save(weights, os.path.join(out, f"rank{rank}.pt"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"steps": guarded.state.global_step, "failures": ceiling.failures,
                   "size": guarded.training_step.microbatch_size,
                   "logged": [e.get("memory/microbatch_size")
                              for e in guarded.state.log_history if "loss" in e]}, f)


if __name__ == "__main__":
    main()
