"""Every private Hugging Face transformers API memguard uses, each with the version it was
checked against. Nothing here imports transformers at import time."""

from __future__ import annotations

from typing import Any

CHECKED_WITH = "5.25.0"
"""The transformers version (with accelerate 1.16.0) every entry below was checked against."""


# -- Trainer (checked with transformers 5.25.0) -------------------------------------------------
def prepare_inputs(trainer: Any, inputs: Any) -> Any:
    """``Trainer._prepare_inputs``: a batch moved to the trainer's device as its
    ``training_step`` moves it (for the gradient-free readings of the loss)."""
    return trainer._prepare_inputs(inputs)  # noqa: SLF001 - what training_step calls on its batch


def loss_shifts_labels(trainer: Any) -> bool:
    """``Trainer._loss_shifts_labels``: whether the trainer counts ``num_items_in_batch``
    over ``labels[..., 1:]`` (read from ``config.loss_type``); ``False`` where it is not set."""
    return bool(getattr(trainer, "_loss_shifts_labels", False))


# -- models' losses (checked with transformers 5.25.0) ------------------------------------------
def causal_lm_loss() -> Any:
    """``ForCausalLMLoss`` from ``transformers.loss.loss_utils`` (not exported); imports
    transformers: call only where it is imported."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss
