"""auto_microbatch on the batch structures, modules and state that real training code brings:
lists of tensors read the same whatever their lengths, dataclass batches, PackedSequence,
lazy modules, large constant buffers (under a real budget), models sharing a submodule
stepped from two threads, and a ``factor`` that returns a size it must not.

Out-of-memory comes from real allocations of petabytes (``limit`` samples and more), as in
test_microbatch.py, or from a soft RLIMIT_AS budget in a subprocess.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading

import pytest
import torch
import torch.nn.functional as F

import memguard

HUGE = 1 << 50  # bytes no allocator gives: a real out-of-memory error


def oom_over(n: int, limit: int) -> None:
    if n > limit:
        torch.empty(HUGE, dtype=torch.uint8)


def grads(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def assert_close(a, b, tol=1e-6):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert (x - y).abs().max().item() <= tol


# -- lists of tensors: one rule whatever the lengths ------------------------------------------
class SeqNet(torch.nn.Module):
    """A loss over a list of per-sample 1-D sequences: each one's mean, averaged over the
    samples; out of memory for more than ``limit`` sequences."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.head = torch.nn.Linear(8, 1)
        self.limit = 10**9

    def loss(self, seqs):
        oom_over(len(seqs), self.limit)
        return torch.stack([self.head(self.embed(s)).mean() for s in seqs]).mean()


def sequences(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("lengths", [[5, 9, 3, 7, 4, 6], [10] * 6])
def test_a_list_of_sequences_beside_a_per_sample_part_is_split_by_sequence(lengths):
    torch.manual_seed(0)
    model = SeqNet()
    reference = copy.deepcopy(model)
    seqs, weights = sequences(lengths), torch.arange(1.0, 7.0)
    model.limit = 3

    @memguard.auto_microbatch(model)
    def loss_of(batch):
        seqs, w = batch
        assert len(seqs) == len(w)  # cut along the samples, the sequences whole
        return model.loss(seqs) * w.mean()

    loss_of((seqs, weights))
    assert [a.size for a in loss_of.history] == [6, 3]
    for start in (0, 3):  # plain accumulation of the two halves
        (reference.loss(seqs[start:start + 3]) * weights[start:start + 3].mean() / 2).backward()
    assert_close(grads(model), grads(reference))


def test_a_ragged_list_of_sequences_alone_is_one_sequence_per_sample():
    torch.manual_seed(0)
    model = SeqNet()
    reference = copy.deepcopy(model)
    seqs = sequences([5, 9, 3, 7, 4, 6])
    model.limit = 3
    step = memguard.auto_microbatch(model)(model.loss)
    step(seqs)
    assert [a.size for a in step.history] == [6, 3]
    reference.loss(seqs).backward()
    assert_close(grads(model), grads(reference))


def test_a_list_of_sequences_of_one_length_alone_is_refused_at_the_split_not_guessed():
    torch.manual_seed(0)
    model = SeqNet()
    seqs = sequences([10] * 6)
    step = memguard.auto_microbatch(model)(model.loss)
    step(seqs)  # fits whole: nothing to cut, nothing to tell
    entry = grads(model)
    model.limit = 3
    with pytest.raises(ValueError, match=r"a list of 6 tensors of one shape \[10\].*tuple"):
        step(seqs)
    assert_close(grads(model), entry, 0.0)  # the entry gradients as they were


# -- dataclasses and PackedSequence -----------------------------------------------------------
@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    names: list
    task: str = "regression"


def test_a_dataclass_batch_is_cut_field_by_field_with_the_whole_batch_gradients():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batch = Batch(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g),
                  [f"s{i}" for i in range(8)])
    seen = []

    @memguard.auto_microbatch(model)
    def loss_of(b):
        seen.append((type(b), len(b.names), b.task))
        oom_over(len(b.x), 4)
        return F.mse_loss(model(b.x), b.y)

    loss_of(batch)
    assert [a.size for a in loss_of.history] == [8, 4]
    assert seen[1:] == [(Batch, 4, "regression")] * 2
    F.mse_loss(reference(batch.x), batch.y).backward()
    assert_close(grads(model), grads(reference))


def test_a_packed_sequence_is_refused_by_name_when_it_must_be_cut():
    model = torch.nn.RNN(3, 4)
    packed = torch.nn.utils.rnn.pack_sequence([torch.ones(5, 3), torch.ones(2, 3)])
    targets = torch.zeros(2, 4)

    @memguard.auto_microbatch(model)
    def loss_of(batch):
        seqs, y = batch
        oom_over(len(y), 1)
        return F.mse_loss(model(seqs)[1][0], y)

    with pytest.raises(TypeError, match=r"PackedSequence.*pad_packed_sequence"):
        loss_of((packed, targets))
    with pytest.raises(TypeError, match="PackedSequence"):
        loss_of(packed)  # alone: nothing per-sample to measure either


# -- lazy modules -----------------------------------------------------------------------------
class LazyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.LazyLinear(8)
        self.norm = torch.nn.LazyBatchNorm1d()
        self.out = torch.nn.Linear(8, 1)
        self.limit = 10**9

    def forward(self, x):
        hidden = self.norm(self.first(x))  # initialised and moved before the failure
        oom_over(len(x), self.limit)
        return self.out(torch.relu(hidden))


def test_lazy_modules_initialise_in_a_failed_pass_and_end_as_plain_torch():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 5, generator=g), torch.randn(16, 1, generator=g)
    torch.manual_seed(0)
    model = LazyNet()
    torch.manual_seed(0)
    reference = LazyNet()
    model.limit = 8

    @memguard.auto_microbatch(model)
    def loss_of(batch):
        return F.mse_loss(model(batch[0]), batch[1])

    torch.manual_seed(1)
    loss_of((x, y))
    assert [a.size for a in loss_of.history] == [16, 8]
    torch.manual_seed(1)
    for start in (0, 8):  # plain accumulation over the same slices
        (F.mse_loss(reference(x[start:start + 8]), y[start:start + 8]) / 2).backward()
    assert_close(grads(model), grads(reference), 1e-6)
    assert model.norm.num_batches_tracked.item() == 2  # the failed pass's move undone
    assert torch.allclose(model.norm.running_mean, reference.norm.running_mean, atol=1e-6)
    assert torch.allclose(model.norm.running_var, reference.norm.running_var, atol=1e-6)


# -- a large constant buffer ------------------------------------------------------------------
def test_a_large_constant_buffer_is_watched_not_copied_and_a_moved_one_is_told(caplog):
    class Table(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)
            self.register_buffer("table", torch.ones(2 << 20))  # 8 MiB: over the small size
            self.limit = 10**9
            self.move = False

        def forward(self, x):
            if self.move:
                self.table.mul_(2)  # a large buffer this forward writes
            oom_over(len(x), self.limit)
            return self.lin(x) * self.table[0]

    model = Table()
    step = memguard.auto_microbatch(model)(lambda b: model(b).pow(2).mean())
    buffers = memguard.backends.steps.torch_training.Buffers(
        memguard.backends.steps.torch_training.trained(model)[1])
    assert buffers.copies == {} and len(buffers.watched) == 1  # not copied: watched
    model.limit, model.move = 4, True
    with caplog.at_level(logging.WARNING, "memguard"):
        step(torch.ones(8, 4))
    assert "moved 1 buffer(s) memguard had not copied (Table.table)" in caplog.text
    assert model.table[0].item() == 2.0 ** 3  # the failed pass's move stays, as told
    step(torch.ones(8, 4))  # known to move now: copied, the failed pass's move undone
    assert model.table[0].item() == 2.0 ** 5


BUDGETED_BUFFER = """
import copy, torch, memguard
import torch.nn.functional as F
torch.set_num_threads(1)

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 1)
        self.register_buffer("table", torch.ones(64 << 20 >> 0))  # 256 MiB, constant

    def forward(self, x):
        scratch = torch.ones(len(x), 1 << 18)  # 1 MiB per sample
        return self.lin(x) * self.table[:1] + scratch.sum() * 0

torch.manual_seed(0)
model = Net()
reference = copy.deepcopy(model)
g = torch.Generator().manual_seed(0)
batches = [(torch.randn(64, 64, generator=g), torch.randn(64, 1, generator=g))
           for _ in range(3)]
step = memguard.auto_microbatch(model)(lambda b: F.mse_loss(model(b[0]), b[1]))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
for b in batches[:1]:  # warm both up unbudgeted
    F.mse_loss(reference(b[0]), b[1]).backward(); ref_opt.zero_grad()
set_budget(200)  # a step needs ~64 MiB more: plain torch fits, a copy of the table does not
sizes, plain = [], 0
for b in batches:
    F.mse_loss(reference(b[0]), b[1]).backward(); ref_opt.step(); ref_opt.zero_grad()
    plain += 1
    step(b); opt.step(); opt.zero_grad()
    sizes.append([a.size for a in step.history])
lift_budget()
distance = max((p - q).abs().max().item()
               for p, q in zip(model.parameters(), reference.parameters()))

# running statistics of 256 MiB that memguard must copy, and cannot within the budget
import logging
told = []
handler = logging.Handler()
handler.emit = lambda record: told.append(record.getMessage())
logging.getLogger("memguard").addHandler(handler)

class Normed(Net):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(32 << 20)  # in training mode; not in this forward

del model, reference, opt, ref_opt, step
normed = Normed()
step = memguard.auto_microbatch(normed)(lambda b: F.mse_loss(normed(b[0]), b[1]))
set_budget(200)
normed_sizes = []
for b in batches[:2]:
    step(b)
    normed_sizes.append([a.size for a in step.history])
lift_budget()
finish({"plain": plain, "sizes": sizes, "size": step.microbatch_size, "distance": distance,
        "normed": normed_sizes, "told": [t for t in told if "copying" in t]})
"""


@pytest.mark.slow
def test_a_large_constant_buffer_under_a_real_budget_plain_torch_fits_in(python_in_subprocess):
    from budget import ENV, script

    out = python_in_subprocess(script(BUDGETED_BUFFER), timeout=300, env=ENV)
    assert out["plain"] == 3  # the budget holds plain torch's step
    assert out["sizes"] == [[64]] * 3 and out["size"] is None  # never split: no copy
    assert out["distance"] < 1e-6
    # memguard's own copy out of memory: told as such, the batch never blamed for it
    assert out["normed"] == [[64]] * 2
    assert len(out["told"]) == 2 and "memguard's own bookkeeping" in out["told"][0]


# -- two models sharing a submodule, from two threads -----------------------------------------
def test_two_models_sharing_a_submodule_stepped_from_two_threads_take_turns():
    torch.manual_seed(0)
    shared = torch.nn.Linear(4, 4)
    a = torch.nn.Sequential(shared, torch.nn.Linear(4, 1))
    b = torch.nn.Sequential(shared, torch.nn.Linear(4, 1))
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    ref_b[0] = ref_a[0]
    x = torch.randn(8, 4)
    inside, stepped = threading.Event(), threading.Event()

    @memguard.auto_microbatch(a)
    def loss_a(batch):
        loss = a(batch).pow(2).mean()
        inside.set()
        stepped.wait(0.5)  # b's step, were it let in, would write the shared gradients now
        return loss

    @memguard.auto_microbatch(b)
    def loss_b(batch):
        return b(batch).pow(2).mean()

    errors = []

    def run(fn, after=None):
        try:
            fn(x)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        if after is not None:
            after.set()

    first = threading.Thread(target=run, args=(loss_a,))
    first.start()
    inside.wait(5)
    second = threading.Thread(target=run, args=(loss_b, stepped))
    second.start()
    first.join(10)
    second.join(10)
    assert errors == []
    ref_a(x).pow(2).mean().backward()
    ref_b(x).pow(2).mean().backward()
    assert_close(grads(a) + grads(b), grads(ref_a) + grads(ref_b))


# -- a factor that returns a size it must not --------------------------------------------------
def test_an_invalid_factor_leaves_the_entry_gradients_and_buffers_as_they_were():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.Linear(4, 1))
    x = torch.randn(8, 4)
    model(x).sum().backward()  # gradients accumulated on purpose, before the step
    entry = grads(model)
    stats = copy.deepcopy(model[1].state_dict())

    @memguard.auto_microbatch(model, factor=lambda size: size)  # not smaller: invalid
    def loss_of(batch):
        out = model(batch)  # moves the running statistics before the failure
        oom_over(len(batch), 4)
        return out.pow(2).mean()

    with pytest.raises(ValueError, match=r"factor .* returned 8; it must return"):
        loss_of(x)
    assert_close(grads(model), entry, 0.0)
    for key, value in model[1].state_dict().items():
        assert torch.equal(value, stats[key])
