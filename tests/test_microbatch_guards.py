"""auto_microbatch never gives silently wrong gradients: tensors outside the model found on
any call, buffers put back before a pass is redone, calls on one model serialised across
threads, the step function's own optimizer step / zero_grad / backward refused, and the
ladder walked once inside oom_retry.

Out-of-memory errors are real torch CPU allocator failures (a request for petabytes) placed
at an exact point of forward or backward, as in test_microbatch.py.
"""

from __future__ import annotations

import copy
import logging
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import memguard


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
    def __init__(self, width=16, norm=False):
        super().__init__()
        self.first = torch.nn.Linear(8, width)
        self.norm = torch.nn.BatchNorm1d(width) if norm else torch.nn.Identity()
        self.second = torch.nn.Linear(width, 1)
        self.forward_limit = 10**9
        self.backward_limit = 10**9

    def forward(self, x):
        hidden = self.norm(self.first(x))  # BatchNorm's statistics move before any failure
        if x.shape[0] > self.forward_limit:
            torch.empty(x.shape[0] << 42)
        hidden = Hungry.apply(torch.relu(hidden), self.backward_limit)
        return self.second(hidden)


def data(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)


def pair(**kwargs):
    torch.manual_seed(0)
    model = Net(**kwargs)
    return model, copy.deepcopy(model)


def grads(model):
    return [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


def assert_close(a, b, tol=1e-6):
    for x, y in zip(a, b, strict=True):
        assert (x - y).abs().max().item() <= tol


# -- tensors outside the model -----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["parameter", "tensor"])
def test_a_tensor_outside_the_model_first_used_on_a_later_call_loses_the_failed_pass(kind,
                                                                                      caplog):
    body, reference = pair()
    scale = torch.tensor([1.5], requires_grad=True)
    if kind == "parameter":
        scale = torch.nn.Parameter(scale.detach())
    reference_scale = scale.detach().clone().requires_grad_(True)
    x, y = data(128)
    scaled = []

    @memguard.auto_microbatch(body)
    def loss_of(batch):
        out = body(batch[0])
        return F.mse_loss(out * scale if scaled else out, batch[1])

    loss_of((x[:32], y[:32]))  # fits whole, and nothing outside the model takes part yet
    body.zero_grad()
    scaled.append(True)  # from now on a soft scale beside the model is trained too
    body.backward_limit = 50  # scale's gradient exists when backward fails inside body
    with caplog.at_level(logging.WARNING, logger="memguard"):
        loss_of((x, y))
    assert [a.size for a in loss_of.history] == [128, 64, 32]
    F.mse_loss(reference(x) * reference_scale, y).backward()
    assert scale.grad.item() == pytest.approx(reference_scale.grad.item(), abs=1e-5)
    assert_close(grads(body), grads(reference))
    assert "1 tensor(s) outside the model" in caplog.text


def test_a_tensor_used_only_by_a_later_slice_loses_the_failed_pass():
    body, reference = pair()
    scale = torch.nn.Parameter(torch.tensor([1.5]))
    reference_scale = scale.detach().clone().requires_grad_(True)
    x, y = data(128)
    body.forward_limit = 100  # the whole batch fails in forward, before any backward

    def loss(model, factor, xs, ys, first):
        out = model(xs)
        if not first:  # scale takes its share, then backward fails above 40 samples
            out = Hungry.apply(out, 40) * factor
        return F.mse_loss(out, ys)

    @memguard.auto_microbatch(body)
    def loss_of(batch):
        return loss(body, scale, batch[0], batch[1], batch[2][0] == 0)

    loss_of((x, y, torch.arange(128)))
    assert [a.size for a in loss_of.history] == [128, 64, 32]
    for start in range(0, 128, 32):
        (loss(reference, reference_scale, x[start:start + 32], y[start:start + 32],
              start == 0) * 0.25).backward()
    assert scale.grad.item() == pytest.approx(reference_scale.grad.item(), abs=1e-5)
    assert_close(grads(body), grads(reference))


# -- the model's walk, kept between calls ---------------------------------------------------------
class Grown(Net):
    """Net whose forward adds an ``extra`` module when it has one."""

    def forward(self, x):
        out = super().forward(x)
        extra = self._modules.get("extra")
        return out if extra is None else out + extra(x)


@pytest.mark.parametrize("how", ["setattr", "direct", "unfrozen"])
def test_a_parameter_the_model_gains_between_calls_is_the_models_own(how, caplog):
    torch.manual_seed(0)
    model = Grown()
    reference = copy.deepcopy(model)
    extra = torch.nn.Linear(8, 1)  # made before: making a module is seen by torch's hooks
    reference.extra = copy.deepcopy(extra)
    if how == "unfrozen":  # held from the start, frozen, then trained
        model.extra = extra
        extra.requires_grad_(False)
    x, y = data(128)
    loss_of = memguard.auto_microbatch(model)(lambda b: F.mse_loss(model(b[0]), b[1]))
    loss_of((x[:32], y[:32]))  # the model walked; calls that fit reuse the walk
    model.zero_grad()
    if how == "unfrozen":  # nothing registered: no hook sees it
        extra.requires_grad_(True)
    elif how == "setattr":  # torch's registration hooks see it
        model.extra = extra
    else:  # written into the module's dictionary: no hook sees it
        model._modules["extra"] = extra
    model.backward_limit = 50  # the extra layer's gradient is written before the failure
    with caplog.at_level(logging.WARNING, logger="memguard"):
        loss_of((x, y))
    assert [a.size for a in loss_of.history] == [128, 64, 32]
    F.mse_loss(reference(x), y).backward()
    assert_close(grads(model), grads(reference), 1e-5)  # extra's failed share dropped too
    assert "outside the model" not in caplog.text  # the model's own, not a stranger


def test_a_head_outside_the_model_is_told_from_the_models_own_once(monkeypatch, caplog):
    from memguard.backends.steps import torch_training

    body, _ = pair()
    head = torch.nn.Linear(1, 1)  # trained beside the model, not in it
    x, y = data(64)
    walks = []
    trained = torch_training.trained
    monkeypatch.setattr(torch_training, "trained",
                        lambda model: walks.append(model) or trained(model))
    loss_of = memguard.auto_microbatch(body)(lambda b: F.mse_loss(head(body(b[0])), b[1]))
    with caplog.at_level(logging.WARNING, logger="memguard"):
        for _ in range(6):
            loss_of((x, y))
    assert len(walks) == 2  # the first call's walk, and once more to tell the head's two
    assert caplog.text.count("outside the model") == 1
    assert head.weight.grad is not None


def test_a_buffer_written_into_its_module_between_calls_is_the_one_put_back():
    model, reference = pair(norm=True)
    x, y = data(256)
    loss_of = memguard.auto_microbatch(model)(lambda b: F.mse_loss(model(b[0]), b[1]))
    loss_of((x[:32], y[:32]))  # the model walked, with its running statistics
    reference(x[:32])
    for net in (model, reference):  # new tensors, written past torch's hooks
        net.norm._buffers["running_mean"] = torch.full((16,), 0.5)
    model.forward_limit = 70  # BatchNorm's statistics move in each failed forward
    loss_of((x, y))
    assert [a.size for a in loss_of.history] == [256, 128, 64]
    for start in range(0, 256, 64):
        reference(x[start:start + 64])
    assert torch.allclose(model.norm.running_mean, reference.norm.running_mean, atol=1e-6)


@pytest.mark.parametrize("how", ["setattr", "direct"])
def test_a_module_the_model_gains_between_calls_has_its_buffers_put_back(how, monkeypatch):
    from memguard.backends.steps import torch_training

    model, reference = pair()
    reference.norm = torch.nn.BatchNorm1d(16, affine=False)
    norm = torch.nn.BatchNorm1d(16, affine=False)  # made before: torch's hooks see that
    x, y = data(256)
    if how == "direct":  # each walk kept for no time at all
        monkeypatch.setattr(torch_training, "REWALK", 0.0)
    loss_of = memguard.auto_microbatch(model)(lambda b: F.mse_loss(model(b[0]), b[1]))
    loss_of((x[:32], y[:32]))  # the model walked; calls that fit reuse the walk
    if how == "setattr":  # torch's registration hooks see it: walked at the next call
        model.norm = norm
    else:  # past torch's hooks: walked again once REWALK seconds have passed
        model._modules["norm"] = norm
    loss_of((x[:32], y[:32]))
    reference(x[:32])
    model.forward_limit = 70
    loss_of((x, y))
    assert [a.size for a in loss_of.history] == [256, 128, 64]
    for start in range(0, 256, 64):
        reference(x[start:start + 64])
    assert torch.allclose(model.norm.running_mean, reference.norm.running_mean, atol=1e-6)
    assert model.norm.num_batches_tracked.item() == reference.norm.num_batches_tracked.item()


def test_a_batch_unlike_the_last_one_is_planned_again():
    model, reference = pair()
    x, y = data(256)
    loss_of = memguard.auto_microbatch(model)(lambda b: F.mse_loss(model(b["x"]), b["y"]))
    loss_of({"x": x[:100], "y": y[:100]})
    loss_of({"x": x[:60], "y": y[:60]})  # the epoch's short last batch
    assert loss_of.history[0].size == 60
    with pytest.raises(ValueError, match="disagree"):  # parts that disagree: checked again
        loss_of({"x": x[:60], "y": y[:59]})
    model.forward_limit = 30
    model.zero_grad()
    loss_of({"x": x[:60], "y": y[:60]})
    assert [a.size for a in loss_of.history] == [60, 30]
    F.mse_loss(reference(x[:60]), y[:60]).backward()
    assert_close(grads(model), grads(reference), 1e-5)


# -- buffers -------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_batchnorm_statistics_equal_plain_accumulation_over_the_slices(where):
    model, reference = pair(norm=True)
    setattr(model, f"{where}_limit", 70)
    x, y = data(256)

    @memguard.auto_microbatch(model)
    def loss_of(batch):
        return F.mse_loss(model(batch[0]), batch[1])

    loss_of((x, y))
    assert [a.size for a in loss_of.history] == [256, 128, 64]
    for start in range(0, 256, 64):  # what plain accumulation over the slices gives
        (F.mse_loss(reference(x[start:start + 64]), y[start:start + 64]) / 4).backward()
    ours, theirs = model.norm, reference.norm
    assert ours.num_batches_tracked.item() == theirs.num_batches_tracked.item() == 4
    assert torch.allclose(ours.running_mean, theirs.running_mean, atol=1e-6)
    assert torch.allclose(ours.running_var, theirs.running_var, atol=1e-6)
    assert_close(grads(model), grads(reference), 1e-5)


def test_a_buffer_replaced_in_forward_gets_its_entry_values_back():
    class Counting(Net):
        def __init__(self):
            super().__init__()
            self.register_buffer("seen", torch.zeros(()))
            self.register_buffer("scratch", torch.zeros(()), persistent=False)

        def forward(self, x):
            self.seen = self.seen + len(x)  # a new tensor each time, not an in-place update
            self.scratch += 1  # not in the state_dict: left as the passes leave it
            return super().forward(x)

    torch.manual_seed(0)
    model = Counting()
    model.forward_limit = 70
    x, y = data(256)
    step = memguard.auto_microbatch(model)(lambda b: F.mse_loss(model(b[0]), b[1]))
    step((x, y))
    assert [a.size for a in step.history] == [256, 128, 64]
    assert model.seen.item() == 256  # the four slices of 64, not the failed passes too
    assert model.scratch.item() == 6


# -- threads ---------------------------------------------------------------------------------------
def test_threads_stepping_one_model_add_up_exactly():
    torch.manual_seed(0)
    model = Net(width=256)
    reference = copy.deepcopy(model)
    model.forward_limit = 50
    x, y = data(128)

    @memguard.auto_microbatch(model)
    def step(batch):
        time.sleep(0.002)  # the batch arriving, say: another thread runs meanwhile
        return F.mse_loss(model(batch[0]), batch[1])

    threads, steps = 4, 4
    start = threading.Barrier(threads)
    errors = []

    def train():
        try:
            start.wait()
            for _ in range(steps):
                step((x, y))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    workers = [threading.Thread(target=train) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(60)
    assert errors == []
    F.mse_loss(reference(x), y).backward()
    ratios = [(p.grad.norm() / (q.grad.norm() * threads * steps)).item()
              for p, q in zip(model.parameters(), reference.parameters(), strict=True)]
    assert ratios == pytest.approx([1.0] * len(ratios), abs=1e-4)  # every step counted once


def test_a_thread_waits_for_the_other_threads_step_on_the_same_model():
    model, _ = pair()
    x, y = data(32)
    inside, release, order = threading.Event(), threading.Event(), []

    @memguard.auto_microbatch(model)
    def slow(batch):
        order.append("slow")
        inside.set()
        release.wait(10)
        return F.mse_loss(model(batch[0]), batch[1])

    other = memguard.auto_microbatch(model)(  # another step function on the same model
        lambda b: order.append("other") or F.mse_loss(model(b[0]), b[1]))
    first = threading.Thread(target=slow, args=((x, y),))
    first.start()
    assert inside.wait(10)
    second = threading.Thread(target=other, args=((x, y),))
    second.start()
    second.join(0.3)
    assert second.is_alive() and order == ["slow"]  # waiting, not running beside it
    release.set()
    first.join(10)
    second.join(10)
    assert order == ["slow", "other"]


# -- the step function's own optimizer step, zero_grad and backward ------------------------------
@pytest.mark.parametrize("split", [False, True])
def test_optimizer_step_inside_the_step_function_is_refused(split):
    model, _ = pair()
    x, y = data(128)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    F.mse_loss(model(x), y).backward()  # gradients on entry, kept on purpose
    model.forward_limit = 50 if split else 10**9  # split: the step comes between slices
    entry = grads(model)
    weights = [p.detach().clone() for p in model.parameters()]

    @memguard.auto_microbatch(model)
    def loss_of(batch):
        loss = F.mse_loss(model(batch[0]), batch[1])
        optimizer.step()
        return loss

    with pytest.raises(RuntimeError, match=r"called optimizer\.step\(\)") as info:
        loss_of((x, y))
    assert "after the decorated function returns" in str(info.value)
    assert_close(grads(model), entry, 0.0)  # restored
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


def test_an_optimizer_of_other_parameters_may_step_inside():
    model, reference = pair()
    other = torch.nn.Linear(2, 2)
    inner = torch.optim.SGD(other.parameters(), lr=0.1)
    other(torch.ones(1, 2)).sum().backward()
    x, y = data(64)

    @memguard.auto_microbatch(model)
    def loss_of(batch):
        inner.step()  # a model of its own, trained inside: not memguard's business
        return F.mse_loss(model(batch[0]), batch[1])

    loss_of((x, y))
    F.mse_loss(reference(x), y).backward()
    assert_close(grads(model), grads(reference))


def _clear(how, model, optimizer):
    if how == "optimizer":
        optimizer.zero_grad()
    elif how == "model":
        model.zero_grad()
    else:  # zeros kept in place
        optimizer.zero_grad(set_to_none=False)


@pytest.mark.parametrize("split", [None, "forward", "backward"])
@pytest.mark.parametrize("how", ["optimizer", "model", "zeros"])
def test_zero_grad_at_the_top_of_the_step_starts_it_from_zero_as_in_plain_torch(split, how):
    """The natural port of a loop (zero_grad() kept at the top, backward() and step() taken
    out) trains as the loop does, whether the batch fits whole or is split."""
    model, reference = pair()
    if split is not None:  # every step split: the first call fails, then slices of 64
        setattr(model, f"{split}_limit", 70)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)

    @memguard.auto_microbatch(model)
    def loss_of(batch):
        _clear(how, model, optimizer)
        return F.mse_loss(model(batch[0]), batch[1])

    for seed in range(3):
        x, y = data(128, seed)
        loss_of((x, y))
        optimizer.step()
        _clear(how, reference, plain)
        F.mse_loss(reference(x), y).backward()
        plain.step()
        assert_close(grads(model), grads(reference))
        assert_close([p.detach() for p in model.parameters()],
                     [p.detach() for p in reference.parameters()])
    if split is not None:
        assert loss_of.microbatch_size == 64 and len(loss_of.history) == 1


def test_zero_grad_of_one_optimizer_clears_only_its_parameters():
    model, reference = pair()
    x, y = data(128)
    F.mse_loss(model(x), y).backward()  # both layers hold gradients on entry
    F.mse_loss(reference(x), y).backward()
    first = torch.optim.SGD(model.first.parameters(), lr=0.1)
    model.forward_limit = 50

    @memguard.auto_microbatch(model)
    def loss_of(batch):
        first.zero_grad()  # the first layer starts from zero, the second accumulates
        return F.mse_loss(model(batch[0]), batch[1])

    loss_of((x, y))
    reference.first.zero_grad()
    F.mse_loss(reference(x), y).backward()
    assert_close(grads(model), grads(reference))


@pytest.mark.parametrize("split", [False, True])
def test_clipping_entry_gradients_inside_the_step_function_is_refused(split):
    model, _ = pair()
    x, y = data(128)
    F.mse_loss(model(x), y).backward()
    entry = grads(model)
    model.backward_limit = 50 if split else 10**9

    @memguard.auto_microbatch(model)
    def loss_of(batch):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        return F.mse_loss(model(batch[0]), batch[1])

    with pytest.raises(RuntimeError, match=r"changed in place .* clipping") as info:
        loss_of((x, y))
    assert "optimizer.step() after the decorated function returns" in str(info.value)
    assert all(p.grad is not None for p in model.parameters())
    assert not any(torch.equal(a, b) for a, b in zip(grads(model), entry, strict=True))


# -- an optimizer step fused into backward ---------------------------------------------------
def test_an_optimizer_step_fused_into_backward_is_refused_at_the_first_call():
    model, _ = pair()
    x, y = data(128)
    weights = [p.detach().clone() for p in model.parameters()]
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

    def step_in_backward(param):  # PyTorch's tutorial pattern
        optimizers[param].step()
        optimizers[param].zero_grad()

    handles = [p.register_post_accumulate_grad_hook(step_in_backward)
               for p in model.parameters()]

    @memguard.auto_microbatch(model)
    def loss_of(batch):
        return F.mse_loss(model(batch[0]), batch[1])

    with pytest.raises(NotImplementedError, match=r"register_post_accumulate_grad_hook "
                       r"\(.*step_in_backward on 'first\.weight'\)") as info:
        loss_of((x, y))
    assert "call optimizer.step() after the decorated function returns" in str(info.value)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    assert all(p.grad is None for p in model.parameters())

    for handle in handles:  # without the hooks it trains; a hook added later is refused on
        handle.remove()     # the path of a split step too
    model.forward_limit = 50
    loss_of((x, y))
    assert loss_of.microbatch_size == 32
    model.second.bias.register_post_accumulate_grad_hook(step_in_backward)
    with pytest.raises(NotImplementedError, match=r"1 parameter\(s\).*'second\.bias'"):
        loss_of((x, y))


@pytest.mark.parametrize("split", [False, True])
def test_backward_inside_the_step_function_is_refused(split):
    model, _ = pair()
    model.forward_limit = 50 if split else 10**9
    x, y = data(128)

    @memguard.auto_microbatch(model)
    def loss_of(batch):
        loss = F.mse_loss(model(batch[0]), batch[1])
        loss.backward(retain_graph=True)
        return loss

    with pytest.raises(RuntimeError, match=r"backward\(\)") as info:
        loss_of((x, y))
    assert "auto_microbatch runs backward itself" in str(info.value)
    assert all(p.grad is None for p in model.parameters())


def test_embedding_renormalised_in_forward_is_no_mistake():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, max_norm=0.5), torch.nn.Flatten(),
                                torch.nn.Linear(12, 1))
    ids = torch.randint(0, 10, (64, 3), generator=torch.Generator().manual_seed(1))
    limit = [10**9]

    @memguard.auto_microbatch(model)
    def loss_of(batch):
        if len(batch) > limit[0]:
            torch.empty(len(batch) << 42)
        return model(batch).pow(2).mean()

    loss_of(ids)
    limit[0] = 20
    loss_of(ids)  # the embedding's weight changes in place in every slice's forward
    assert [a.size for a in loss_of.history] == [64, 32, 16]


# -- inside oom_retry -----------------------------------------------------------------------
@pytest.mark.slow
def test_inside_oom_retry_the_ladder_is_walked_once_per_outermost_call():
    model, _ = pair()
    model.forward_limit = 0  # nothing fits
    x, y = data(8)
    calls = []

    @memguard.auto_microbatch(model)
    def loss_of(batch):
        calls.append(len(batch[0]))
        return F.mse_loss(model(batch[0]), batch[1])

    @memguard.oom_retry(batch_size=8, min_batch_size=2)
    def train(batch_size):
        return loss_of((x[:batch_size], y[:batch_size]))

    for _ in range(2):  # a new outermost call walks the inner ladder again
        calls.clear()
        with pytest.raises(memguard.OutOfMemoryError):
            train()
        assert [a.size for a in train.history] == [8, 4, 2]
        # 8, 4, 2, 1 once, then one attempt at 1 per smaller outer size: 4 + 3 - 1
        assert calls == [8, 4, 2, 1, 1, 1]
    calls.clear()
    with pytest.raises(memguard.OutOfMemoryError):
        loss_of((x, y))  # alone, it walks its own ladder as before
    assert calls == [8, 4, 2, 1]


@pytest.mark.slow
def test_inside_oom_retry_a_smaller_outer_batch_that_fits_succeeds():
    model, reference = pair()
    model.forward_limit = 3
    x, y = data(16)

    @memguard.auto_microbatch(model, min_batch_size=4)
    def loss_of(batch):
        return F.mse_loss(model(batch[0]), batch[1])

    @memguard.oom_retry(batch_size=16, min_batch_size=2)
    def train(batch_size):
        return loss_of((x[:batch_size], y[:batch_size]))

    train()
    assert [a.size for a in train.history] == [16, 8, 4, 2]
    assert [a.size for a in loss_of.history] == [2]
    F.mse_loss(reference(x[:2]), y[:2]).backward()
    assert_close(grads(model), grads(reference))
