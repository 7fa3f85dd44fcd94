"""auto_microbatch on real torch allocation failures (no budget needed).

A slice larger than a step's ``limit`` asks the CPU allocator for petabytes and gets its real
out-of-memory error, in forward or, through ``Hungry``, in backward once some parameters
already hold part of their gradients. test_microbatch_budget.py runs the budgeted ones.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import re
import sys

import pytest
import torch
import torch.nn.functional as F

import memguard
from memguard import _events


class Hungry(torch.autograd.Function):
    """Identity whose backward runs out of memory for more than ``limit`` samples."""

    @staticmethod
    def forward(ctx, x, limit):
        ctx.limit = limit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if grad.shape[0] > ctx.limit:
            torch.empty(grad.shape[0] << 42)
        return grad, None


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 16)
        self.second = torch.nn.Linear(16, 1)
        self.forward_limit = 10**9
        self.backward_limit = 10**9

    def forward(self, x):
        if x.shape[0] > self.forward_limit:
            torch.empty(x.shape[0] << 42)
        hidden = Hungry.apply(torch.relu(self.first(x)), self.backward_limit)
        return self.second(hidden)


def data(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)


def pair():
    torch.manual_seed(0)
    model = Net()
    return model, copy.deepcopy(model)


def grads(model):
    return [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


def assert_close(a, b, tol=1e-6):
    for x, y in zip(a, b, strict=True):
        assert (x - y).abs().max().item() <= tol


def test_whole_batch_that_fits_is_one_plain_backward():
    model, ref = pair()
    x, y = data()

    @memguard.auto_microbatch(model)
    def loss_of(batch):
        return F.mse_loss(model(batch[0]), batch[1])

    loss = loss_of((x, y))
    expected = F.mse_loss(ref(x), y)
    expected.backward()
    assert loss.shape == () and not loss.requires_grad and torch.equal(loss, expected.detach())
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)  # bit for bit: no weighting, no slicing
    assert loss_of.microbatch_size is None and [a.ok for a in loss_of.history] == [True]


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("n, factor, sizes", [(256, 0.5, [256, 128, 64]),
                                              (250, 0.5, [250, 125, 62]),
                                              (256, 0.3, [256, 76, 22])])
def test_split_gradients_equal_one_backward_of_the_whole_batch(where, n, factor, sizes):
    model, ref = pair()
    setattr(model, f"{where}_limit", 70)
    x, y = data(n)
    seen = []

    @memguard.auto_microbatch(model, factor=factor)
    def loss_of(batch):
        seen.append(len(batch[0]))
        return F.mse_loss(model(batch[0]), batch[1])

    loss = loss_of((x, y))
    expected = F.mse_loss(ref(x), y)
    expected.backward()
    assert [a.size for a in loss_of.history] == sizes
    assert [a.ok for a in loss_of.history] == [False, False, True]
    assert [a.next_size for a in loss_of.history] == sizes[1:] + [None]
    assert "torch CPU allocator" in loss_of.history[0].error
    assert loss_of.history[-1].steps == -(-n // sizes[-1])
    if n == 250:  # 62 + 62 + 62 + 62 + 2, the last weighted by its own length
        assert seen[-5:] == [62, 62, 62, 62, 2]
    assert abs(loss.item() - expected.item()) < 1e-6
    assert_close(grads(model), grads(ref))
    assert loss_of.microbatch_size == sizes[-1]

    seen.clear()
    loss_of((x, y))  # the next step starts at the size that worked: one attempt
    assert len(loss_of.history) == 1 and loss_of.history[0].size == sizes[-1]
    assert seen == [len(s) for s in torch.arange(n).split(sizes[-1])]


def test_reduction_sum_adds_slices_unweighted():
    model, ref = pair()
    model.forward_limit = 100
    x, y = data()

    @memguard.auto_microbatch(model, reduction="sum")
    def loss_of(batch):
        return F.mse_loss(model(batch[0]), batch[1], reduction="sum")

    loss = loss_of((x, y))
    expected = F.mse_loss(ref(x), y, reduction="sum")
    expected.backward()
    assert loss_of.microbatch_size == 64
    assert abs(loss.item() - expected.item()) < 1e-3
    assert_close(grads(model), grads(ref), 1e-4)


def test_entry_gradients_are_kept_and_only_the_failed_pass_is_dropped():
    model, ref = pair()
    x, y = data()
    for m in (model, ref):  # deliberate accumulation from an earlier step
        F.mse_loss(m(x[:32] * 2), y[:32]).backward()
    model.backward_limit = 100  # partial gradients exist when backward fails

    @memguard.auto_microbatch(model)
    def loss_of(batch):
        return F.mse_loss(model(batch[0]), batch[1])

    loss_of((x, y))
    F.mse_loss(ref(x), y).backward()
    assert loss_of.microbatch_size == 64
    assert_close(grads(model), grads(ref))


def test_other_errors_propagate_at_once_with_entry_gradients_restored():
    model, _ = pair()
    x, y = data()
    F.mse_loss(model(x), y).backward()
    entry = [p.grad for p in model.parameters()]
    entry_values = grads(model)
    model.forward_limit = 100
    calls = []

    @memguard.auto_microbatch(model)
    def loss_of(batch):
        calls.append(len(batch[0]))
        if len(calls) == 4:  # the second slice of the pass at 64
            raise ValueError("bad sample")
        return F.mse_loss(model(batch[0]), batch[1])

    with pytest.raises(ValueError, match="bad sample"):
        loss_of((x, y))
    assert calls == [256, 128, 64, 64]
    assert all(p.grad is g for p, g in zip(model.parameters(), entry, strict=True))
    assert_close(grads(model), entry_values, 0.0)


def test_min_batch_size_failing_too_raises_with_every_size_and_keeps_entry_gradients():
    model, _ = pair()
    model.forward_limit = 10
    x, y = data(64)

    @memguard.auto_microbatch(model, min_batch_size=16)
    def loss_of(batch):
        return F.mse_loss(model(batch[0]), batch[1])

    with pytest.raises(memguard.OutOfMemoryError, match="every microbatch_size") as info:
        loss_of((x, y))
    assert [a.size for a in info.value.attempts] == [64, 32, 16]
    assert memguard.is_oom_error(info.value.__cause__)
    assert all(p.grad is None for p in model.parameters())
    assert [a.size for a in loss_of.history] == [64, 32, 16]


def test_interrupt_is_never_retried():
    model, _ = pair()
    x, y = data(64)
    calls = []

    @memguard.auto_microbatch(model)
    def loss_of(batch):
        calls.append(len(batch[0]))
        try:
            torch.empty(1 << 60)
        except RuntimeError:
            raise KeyboardInterrupt  # noqa: B904 - Ctrl-C while handling an out-of-memory
        return F.mse_loss(model(batch[0]), batch[1])

    with pytest.raises(KeyboardInterrupt):
        loss_of((x, y))
    assert calls == [64]


def test_grow_every_tries_a_larger_size_and_steps_back_at_once():
    model, _ = pair()
    x, y = data(256)
    model.forward_limit = 100

    @memguard.auto_microbatch(model, grow_every=2)
    def loss_of(batch):
        return F.mse_loss(model(batch[0]), batch[1])

    sizes = []
    for step in range(8):
        if step == 4:
            model.forward_limit = 200  # shorter sequences now: 128 fits
        loss_of((x, y))
        sizes.append([a.size for a in loss_of.history])
    assert sizes[:4] == [[256, 128, 64], [64], [64], [128, 64]]  # grown 128 fails, back to 64
    assert sizes[4:] == [[64], [64], [128], [128]]  # two clean steps later 128 fits
    assert loss_of.microbatch_size == 128


def test_growing_back_to_the_whole_batch():
    model, _ = pair()
    x, y = data(256)
    model.forward_limit = 200

    @memguard.auto_microbatch(model, grow_every=1)
    def loss_of(batch):
        return F.mse_loss(model(batch[0]), batch[1])

    loss_of((x, y))
    model.forward_limit = 10**9
    loss_of((x, y))  # the split step was not clean; this one is
    assert [a.size for a in loss_of.history] == [128]
    loss_of((x, y))
    assert [a.size for a in loss_of.history] == [256]
    assert loss_of.microbatch_size == 256  # whole batches of 256 run as one slice
    loss_of((x, y))
    assert [(a.size, a.steps) for a in loss_of.history] == [(256, 1)]


def test_growing_on_a_short_batch_remembers_only_what_it_saw():
    model, _ = pair()
    x, y = data(256)
    model.forward_limit = 100

    @memguard.auto_microbatch(model, grow_every=1)
    def loss_of(batch):
        return F.mse_loss(model(batch[0]), batch[1])

    loss_of((x, y))  # 256, 128 fail: 64
    loss_of((x, y))  # clean at 64
    loss_of((x[:90], y[:90]))  # the short last batch of an epoch: grows to 90, which fits
    assert loss_of.microbatch_size == 90
    loss_of((x, y))  # a full batch starts at 90, not at the whole 256
    assert loss_of.history[0].size == 90


def test_smaller_batches_than_the_remembered_size_run_whole():
    model, _ = pair()
    x, y = data(256)
    model.forward_limit = 100

    @memguard.auto_microbatch(model)
    def loss_of(batch):
        return F.mse_loss(model(batch[0]), batch[1])

    loss_of((x, y))
    loss_of((x[:40], y[:40]))
    assert [a.size for a in loss_of.history] == [40]
    assert loss_of.microbatch_size == 64
    loss_of.reset()
    assert loss_of.microbatch_size is None and loss_of.history == []


def test_dict_batch_with_a_per_sample_text_field_and_extra_arguments():
    model, ref = pair()
    model.forward_limit = 3
    x, y = data(8)
    batch = {"x": x, "y": y, "text": [f"s{i}" for i in range(8)], "task": "regress"}
    seen = []

    @memguard.auto_microbatch(model)
    def loss_of(batch, weight, *, tag):
        seen.append((batch["text"], batch["task"], tag))
        assert len(batch["text"]) == len(batch["x"])
        return F.mse_loss(model(batch["x"]), batch["y"]) * weight

    loss_of(batch, 2.0, tag="t")
    assert seen[-4:] == [(["s0", "s1"], "regress", "t"), (["s2", "s3"], "regress", "t"),
                         (["s4", "s5"], "regress", "t"), (["s6", "s7"], "regress", "t")]
    (F.mse_loss(ref(x), y) * 2.0).backward()
    assert_close(grads(model), grads(ref))


def test_grad_scaler_scales_each_slice():
    model, ref = pair()
    model.forward_limit = 100
    x, y = data()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)

    @memguard.auto_microbatch(model, scaler=scaler)
    def loss_of(batch):
        return F.mse_loss(model(batch[0]), batch[1])

    loss = loss_of((x, y))
    expected = F.mse_loss(ref(x), y)
    (expected * 1024.0).backward()
    assert abs(loss.item() - expected.item()) < 1e-6  # the loss comes back unscaled
    assert_close(grads(model), grads(ref), 1e-3)


def test_method_and_keyword_batch():
    class Trainer:
        def __init__(self):
            self.model = Net()
            self.model.forward_limit = 50

        def loss_of(self, batch):
            return F.mse_loss(self.model(batch[0]), batch[1])

    trainer = Trainer()
    trainer.loss_of = memguard.auto_microbatch(trainer.model)(trainer.loss_of)
    x, y = data(64)
    trainer.loss_of(batch=(x, y))
    assert trainer.loss_of.microbatch_size == 32


def test_split_is_logged_and_marked_for_monitors(caplog):
    model, _ = pair()
    model.forward_limit = 100
    x, y = data()
    marks = []
    _events.listen(marks.append)
    try:
        with caplog.at_level(logging.WARNING, logger="memguard"):
            memguard.auto_microbatch(model)(lambda b: F.mse_loss(model(b[0]), b[1]))((x, y))
    finally:
        _events.unlisten(marks.append)
    assert marks == ["OOM at microbatch_size=256", "OOM at microbatch_size=128"]
    assert "at microbatch_size=256" in caplog.text
    assert "retrying at microbatch_size=64" in caplog.text


def test_bad_values_are_refused_at_decoration():
    model = Net()
    for kwargs, error in [({"factor": 1}, ValueError), ({"factor": True}, ValueError),
                          ({"min_batch_size": 0}, ValueError), ({"reduction": "avg"}, ValueError),
                          ({"grow_every": 0}, ValueError), ({"sync": "yes"}, ValueError),
                          ({"scaler": 3}, TypeError), ({"recompute": "yes"}, TypeError),
                          ({"offload": None}, TypeError)]:
        with pytest.raises(error):
            memguard.auto_microbatch(model, **kwargs)
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        memguard.auto_microbatch(object())
    with pytest.raises(TypeError, match="takes the model first"):
        memguard.auto_microbatch(lambda batch: batch)

    async def step(batch):
        return batch
    with pytest.raises(TypeError, match="async"):
        memguard.auto_microbatch(model)(step)


def test_bad_batches_and_losses_are_clear_errors():
    model = Net()
    step = memguard.auto_microbatch(model)(lambda b: F.mse_loss(model(b), torch.zeros(len(b), 1)))
    with pytest.raises(TypeError, match=r"cannot split a batch of type builtins\.float"):
        step(3.0)
    with pytest.raises(ValueError, match="empty batch"):
        step(torch.ones(0, 8))
    with pytest.raises(TypeError, match=r"must return the loss as a torch\.Tensor"):
        memguard.auto_microbatch(model)(lambda b: 1.0)(torch.ones(4, 8))
    with pytest.raises(TypeError, match="scalar loss"):
        memguard.auto_microbatch(model)(lambda b: model(b))(torch.ones(4, 8))
    with pytest.raises(TypeError, match="needs the batch"):
        step()
    with torch.no_grad(), pytest.raises(RuntimeError, match="does not require grad"):
        step(torch.ones(4, 8))
    with pytest.raises(ValueError, match="sync"):
        memguard.auto_microbatch(model, sync=1)


def test_parameters_outside_the_model_lose_the_failed_pass_too(caplog):
    torch.manual_seed(0)
    body, head = Net(), torch.nn.Linear(1, 1)
    reference_body, reference_head = copy.deepcopy(body), copy.deepcopy(head)
    body.backward_limit = 50  # head's gradients exist when backward fails inside body
    x, y = data(128)

    @memguard.auto_microbatch(body)
    def loss_of(batch):
        return F.mse_loss(head(body(batch[0])), batch[1])

    with caplog.at_level(logging.WARNING, logger="memguard"):
        loss_of((x, y))
    F.mse_loss(reference_head(reference_body(x)), y).backward()
    assert "2 tensor(s) outside the model" in caplog.text
    assert_close(grads(head), grads(reference_head))
    assert_close(grads(body), grads(reference_body))
    for m in (body, head, reference_body, reference_head):
        m.zero_grad()
    loss_of.reset()  # the size is forgotten, the head is not: the next call fails again
    loss_of((x, y))
    assert len(loss_of.history) == 3
    F.mse_loss(reference_head(reference_body(x)), y).backward()
    assert_close(grads(head), grads(reference_head))


def test_concurrent_steps_of_two_models_in_threads():
    import threading

    results = {}

    def train(name):
        model, ref = pair()
        model.forward_limit = 50
        x, y = data(128, seed=len(name))
        step = memguard.auto_microbatch(model)(lambda b: F.mse_loss(model(b[0]), b[1]))
        for _ in range(3):
            step((x, y))
        for _ in range(3):
            F.mse_loss(ref(x), y).backward()
        results[name] = max((p.grad - q.grad).abs().max().item()
                            for p, q in zip(model.parameters(), ref.parameters(), strict=True))

    threads = [threading.Thread(target=train, args=(n,)) for n in ("a", "bb")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(results) == {"a", "bb"} and max(results.values()) < 1e-5


def test_asyncio_loop_calling_a_step():
    model, _ = pair()
    model.forward_limit = 50
    x, y = data(64)
    step = memguard.auto_microbatch(model)(lambda b: F.mse_loss(model(b[0]), b[1]))

    async def main():
        await asyncio.sleep(0)
        return step((x, y))

    assert asyncio.run(main()).shape == ()
    assert step.microbatch_size == 32


def test_a_tiny_gpt2_on_a_batch_encoding_splits_with_the_whole_batch_gradients():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 97, (24, 16), generator=torch.Generator().manual_seed(1))
    batch = transformers.BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                        "labels": ids.clone()})

    def too_many(module, args, kwargs):  # the allocator refuses more than 8 sequences
        if kwargs["input_ids"].shape[0] > 8:
            torch.empty(kwargs["input_ids"].shape[0] << 42)

    model.register_forward_pre_hook(too_many, with_kwargs=True)
    seen = []

    @memguard.auto_microbatch(model)
    def loss_of(b):
        seen.append(type(b).__name__)
        return model(**b).loss

    loss = loss_of(batch)
    expected = reference(**batch).loss  # a mean over tokens: all sequences are equally long
    expected.backward()
    assert [a.size for a in loss_of.history] == [24, 12, 6]
    assert set(seen) == {"BatchEncoding"}
    assert abs(loss.item() - expected.item()) < 1e-5
    worst = max((p.grad - q.grad).abs().max().item()
                for p, q in zip(model.parameters(), reference.parameters(), strict=True))
    assert worst < 1e-5


def _token_lm() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50))
    ids = torch.randint(0, 50, (8, 12))
    labels = ids.clone()
    for row, length in enumerate([12, 3, 9, 1, 12, 5, 2, 7]):  # padded sequences
        labels[row, length:] = -100
    return model, {"input_ids": ids, "labels": labels}


def _token_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    if len(batch["input_ids"]) > 4:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 MiB")
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.reshape(-1, 50), batch["labels"].reshape(-1),
                           ignore_index=-100)  # a mean over the tokens that count


def test_a_token_mean_loss_split_with_weight_has_the_whole_batchs_gradients():
    model, batch = _token_lm()
    logits = model(batch["input_ids"])
    F.cross_entropy(logits.reshape(-1, 50), batch["labels"].reshape(-1),
                    ignore_index=-100).backward()
    whole = [p.grad.clone() for p in model.parameters()]
    largest = max(float(g.abs().max()) for g in whole)

    def gradients(**options: object) -> list[torch.Tensor]:
        model.zero_grad()
        step = memguard.auto_microbatch(model, **options)(lambda b: _token_loss(model, b))
        step(batch)
        assert step.microbatch_size == 4  # split in two
        return [p.grad.clone() for p in model.parameters()]

    by_tokens = gradients(weight=lambda b: (b["labels"] != -100).sum())
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(by_tokens, whole, strict=True))
    by_samples = gradients()  # the default weighs slices by samples: not the token mean
    assert max(float((a - b).abs().max()) for a, b in zip(by_samples, whole, strict=True)) \
        > 1e-3 * largest


def test_a_slice_with_no_token_to_average_adds_nothing_not_nan():
    # one sample's labels are all -100: alone in a slice, its token mean is 0/0 (NaN); the
    # step's loss and gradients must be the whole batch's, finite, also for a loss written
    # as sum / count, whose backward at count 0 is NaN too
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 5)
    x, y = torch.randn(4, 6, 4), torch.randint(0, 5, (4, 6))
    y[0] = -100

    def by_hand(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        losses = F.cross_entropy(model(xb).flatten(0, 1), yb.flatten(), ignore_index=-100,
                                 reduction="none")
        return losses.sum() / (yb != -100).sum()

    for loss_of in (lambda xb, yb: F.cross_entropy(model(xb).flatten(0, 1), yb.flatten(),
                                                   ignore_index=-100), by_hand):
        model.zero_grad()
        whole_loss = loss_of(x, y)
        whole_loss.backward()
        whole = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()

        def step(batch: tuple, loss_of=loss_of) -> torch.Tensor:
            if len(batch[0]) > 1:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return loss_of(*batch)

        loss = memguard.auto_microbatch(model, weight=lambda b: (b[1] != -100).sum())(step)(
            (x, y))
        assert torch.isfinite(loss) and abs(float(loss) - float(whole_loss.detach())) < 1e-6
        assert all(torch.allclose(p.grad, g, atol=1e-6)
                   for p, g in zip(model.parameters(), whole, strict=True))


def test_weight_is_checked():
    model, batch = _token_lm()
    with pytest.raises(TypeError, match="weight must be a callable"):
        memguard.auto_microbatch(model, weight=3)
    step = memguard.auto_microbatch(model, weight=lambda b: "many")(
        lambda b: _token_loss(model, b))
    with pytest.raises(TypeError, match="must return a number"):
        step(batch)
    step = memguard.auto_microbatch(model, weight=lambda b: 0)(lambda b: _token_loss(model, b))
    with pytest.raises(ValueError, match="weight of the whole batch is 0"):
        step(batch)
    # a weight whose slices do not add up to the batch (a constant, a mean) weighs no split
    # right: refused before any slice runs, the entry gradients kept
    entry = [torch.full_like(p, 2.0) for p in model.parameters()]
    for p, g in zip(model.parameters(), entry, strict=True):
        p.grad = g.clone()
    for weight, told in ((lambda b: 0.5, "the batch's is 0.5, its 2 slices' add up to 1"),
                         (lambda b: (b["labels"] != -100).float().mean(), "slices' add up")):
        step = memguard.auto_microbatch(model, weight=weight)(lambda b: _token_loss(model, b))
        with pytest.raises(ValueError, match=re.escape(told)):
            step(batch)
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), entry,
                                                          strict=True))


class Tokens(torch.nn.Module):
    """Per-token layers over batches of (samples, length, 8): out of memory, for real, once
    a pass holds more than ``limit`` elements of input."""

    def __init__(self, limit):
        super().__init__()
        self.inner = torch.nn.Linear(8, 8)
        self.outer = torch.nn.Linear(8, 1)
        self.limit = limit

    def forward(self, x):
        if x.numel() > self.limit:
            torch.empty(x.numel() << 42)
        return self.outer(torch.tanh(self.inner(x))).mean(dim=(1, 2))


def mixed_batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(16, length, 8, generator=g) for length in (64, 8, 64, 128, 8)]


@pytest.mark.parametrize("cost", [None, lambda batch: batch.shape[0] * batch.shape[1]],
                         ids=["elements", "tokens"])
def test_slices_follow_each_batchs_cost_and_the_gradients_stay_exact(cost):
    # A size counted in samples, learned on a long batch, cut every later batch alike: the
    # short ones (1/8 of the cost) in 2, the longest (2x) failed first
    torch.manual_seed(0)
    model = Tokens(limit=16 * 32 * 8)
    reference = copy.deepcopy(model)
    reference.limit = 10**12

    @memguard.auto_microbatch(model, cost=cost)
    def loss_of(batch):
        return model(batch).pow(2).mean()

    passes = []
    for batch in mixed_batches():
        model.zero_grad()
        reference.zero_grad()
        loss = loss_of(batch)
        passes.append([(a.size, a.ok, a.steps) for a in loss_of.history])
        reference(batch).pow(2).mean().backward()
        assert loss.item() == pytest.approx(reference(batch).pow(2).mean().item(), rel=1e-6)
        assert_close(grads(model), grads(reference))
    assert passes == [
        [(16, False, 1), (8, True, 2)],  # 16 x 64 does not fit: 8 x 64 does
        [(16, True, 1)],                 # 16 x 8 costs less than 8 x 64: whole
        [(8, True, 2)],                  # as long as the first: where it fitted
        [(4, True, 4)],                  # twice as long: split before it fails
        [(16, True, 1)],
    ]
    assert loss_of.microbatch_size == 8  # learned where it failed, in samples of that cost


def test_a_cost_that_is_not_a_number_is_refused_naming_it():
    model = Tokens(limit=16 * 32 * 8)
    with pytest.raises(TypeError, match="cost must be a callable"):
        memguard.auto_microbatch(model, cost=3)
    answers = iter([10.0, "many", -1.0])

    @memguard.auto_microbatch(model, cost=lambda batch: next(answers))
    def loss_of(batch):
        return model(batch).pow(2).mean()

    long = torch.randn(16, 64, 8)
    loss_of(long)  # split: the cost is read once the slice fitted
    before = grads(model)
    with pytest.raises(TypeError, match=r"loss_of's batch\) must return a number, got 'ma"):
        loss_of(long)
    with pytest.raises(ValueError, match=r"must return a finite number >= 0, got -1.0"):
        loss_of(long)
    assert_close(grads(model), before, tol=0)  # refused before any pass


def _raises_key_error(batch):
    raise KeyError("attention_mask")


@pytest.mark.parametrize("cost, told", [
    (lambda batch: float("nan"), "must return a finite number >= 0, got nan"),
    (_raises_key_error, "loss_of's batch) raised KeyError: 'attention_mask'"),
], ids=["nan", "raises"])
def test_a_bad_cost_read_after_the_split_keeps_the_step_and_counts_in_samples(caplog, cost,
                                                                              told):
    # the cost is read once a split step has run: an error then lost the finished step,
    # with the batch's gradients already added to the entry ones
    torch.manual_seed(0)
    model = Tokens(limit=16 * 32 * 8)
    reference = copy.deepcopy(model)
    reference.limit = 10**12
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        p.grad, q.grad = torch.full_like(p, 2.0), torch.full_like(q, 2.0)

    @memguard.auto_microbatch(model, cost=cost)
    def loss_of(batch):
        return model(batch).pow(2).mean()

    batch = torch.randn(16, 64, 8)
    with caplog.at_level(logging.WARNING, logger="memguard"):
        loss = loss_of(batch)
    expected = reference(batch).pow(2).mean()
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert_close(grads(model), grads(reference))  # the entry gradients plus the batch's
    assert f"{told}; later batches are cut in samples" in caplog.text
    loss_of(torch.randn(16, 8, 8))  # cheaper, yet cut as the size in samples says
    assert [(a.size, a.steps) for a in loss_of.history] == [(8, 2)]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11's")
def test_an_error_only_a_slice_meets_says_the_batch_was_cut_and_why():
    # a step written for the whole batch (a shape written out) fails on a slice: the error
    # must say that memguard cut the batch after an out-of-memory, the entry gradients kept
    model = torch.nn.Linear(4, 1)
    model.weight.grad = torch.full_like(model.weight, 3.0)

    @memguard.auto_microbatch(model)
    def loss_of(batch):
        x = batch[0].view(16, 4)  # the whole batch's shape
        if len(batch[0]) > 8:
            torch.empty(1 << 48)  # out of memory, for real
        return model(x).pow(2).mean()

    x = torch.randn(16, 4)
    with pytest.raises(RuntimeError, match=r"shape '\[16, 4\]' is invalid") as caught:
        loss_of((x, x[:, :1]))
    assert caught.value.__notes__ == [(
        "memguard: raised on samples 0:8 of a batch of 16 that "
        "test_an_error_only_a_slice_meets_says_the_batch_was_cut_and_why.<locals>.loss_of ran "
        "in slices of 8, after an out-of-memory at microbatch_size=16 (its history lists the "
        "passes)")]
    assert torch.equal(model.weight.grad, torch.full_like(model.weight, 3.0))
    # a batch that cannot be cut, met only once it must be: the note says why it was cut
    with pytest.raises(ValueError, match="cannot tell how to cut") as caught:
        loss_of([x, x.clone()])
    assert "raised while cutting a batch of 16 into slices of 8" in caught.value.__notes__[0]
    assert "after an out-of-memory at microbatch_size=16" in caught.value.__notes__[0]


def test_a_batch_of_the_cost_that_fitted_is_cut_at_the_size_that_fitted_not_one_more():
    # the plan rounds a cost's noise (15.99 samples' worth is 16) but not up past what
    # fitted: 1,024 samples fitted, a longer batch of the same cost is cut in 1,024s
    model = torch.nn.Linear(4, 1)

    @memguard.auto_microbatch(model)
    def loss_of(batch):
        if len(batch) > 1024:
            torch.empty(1 << 48)  # out of memory, for real
        return model(batch).sum()

    loss_of(torch.randn(2048, 4))
    assert [(a.size, a.ok) for a in loss_of.history] == [(2048, False), (1024, True)]
    loss_of(torch.randn(4096, 4))
    assert [(a.size, a.ok, a.steps) for a in loss_of.history] == [(1024, True, 4)]
