"""auto_microbatch(trainer) on padding-free packed batches (DataCollatorWithFlattening) and
across a checkpoint: a resumed run starts from the slice size learned before.

A tiny GPT-2 from a config (nothing downloaded); out-of-memory is a CUDA-style error raised
inside the model's real first block past a number of tokens (packed rows) or samples.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from test_hf_microbatch import CUDA_OOM, Ceiling, Padded, arguments, distance, tiny_gpt2  # noqa: E402

from memguard.integrations.transformers import auto_microbatch  # noqa: E402


class Uneven(torch.utils.data.Dataset):
    """Sequences of uneven length, unpadded: what DataCollatorWithFlattening packs."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        n = 3 + (i * 5) % 9
        ids = torch.randint(0, 100, (n,), generator=g).tolist()
        return {"input_ids": ids, "labels": list(ids)}


class TokenCeiling:
    """Out of memory when more than ``limit`` tokens of a packed row pass the first block."""

    def __init__(self, model, limit) -> None:
        self.limit, self.failures, self.seen = limit, 0, []
        model.transformer.h[0].register_forward_hook(self.hook)

    def hook(self, module, inputs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        self.seen.append(tuple(hidden.shape[:2]))
        if self.limit is not None and hidden.shape[1] > self.limit:
            self.failures += 1
            raise RuntimeError(CUDA_OOM)


def packed_run(tmp_path, limit, flash, wrap=True, loss_kwargs=None):
    model = tiny_gpt2()
    ceiling = TokenCeiling(model, limit)
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash,
                                                       return_seq_idx=flash)
    trainer = transformers.Trainer(model=model, args=arguments(tmp_path, max_steps=3),
                                   train_dataset=Uneven(), data_collator=collator)
    if loss_kwargs is not None:
        trainer.model_accepts_loss_kwargs = loss_kwargs
    if wrap:
        trainer = auto_microbatch(trainer)
    trainer.train()
    return trainer, ceiling


@pytest.mark.parametrize("flash", [False, True])
@pytest.mark.parametrize("loss_kwargs", [None, False])
def test_packed_rows_are_cut_between_their_sequences_with_the_whole_rows_weights(
        tmp_path, flash, loss_kwargs):
    reference, _ = packed_run(tmp_path / "ref", None, flash, wrap=False,
                              loss_kwargs=loss_kwargs)
    trainer, ceiling = packed_run(tmp_path / "split", 40, flash, loss_kwargs=loss_kwargs)
    assert trainer.state.global_step == 3 and ceiling.failures >= 1
    assert trainer.training_step.microbatch_size < 8  # sequences per slice
    assert all(rows == 1 and tokens <= 40 for rows, tokens in ceiling.seen[1:])
    assert distance(trainer, reference) < 1e-6


def test_the_learned_slice_size_is_kept_in_the_checkpoint_and_a_resumed_run_starts_there(
        tmp_path):
    def run(limit, **options):
        model = tiny_gpt2()
        ceiling = Ceiling(model, limit)
        trainer = transformers.Trainer(model=model, args=arguments(
            tmp_path, save_strategy="steps", save_steps=2, **options), train_dataset=Padded(32))
        return auto_microbatch(trainer), ceiling

    first, ceiling = run(3, max_steps=2)
    first.train()
    assert ceiling.failures == 2 and first.training_step.history[-1].size == 2  # 8, 4, 2
    resumed, ceiling = run(3, max_steps=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.state.global_step == 4
    assert ceiling.failures == 0  # started at the size kept, not the whole batch again
    assert set(ceiling.seen) == {2}
    state = resumed.state.stateful_callbacks["MicrobatchState"]
    assert state["attributes"]["microbatch_size"] == 2
