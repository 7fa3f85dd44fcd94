"""The differential harness: memguard's step recovery against plain torch on the same data.

A matrix of model features (BatchNorm, dropout, tied and frozen weights, lazy modules,
buffers moved by forward, activation checkpointing, torch.compile) x batch structures (one
tensor, dicts, nested tuples, lists of per-sample sequences of equal and unequal lengths,
dataclasses, strings beside tensors, numpy arrays, BatchEncoding) x losses (mean over
samples, mean over tokens with padding, sums, label smoothing, per-sample weights) x
out-of-memory points (a real ``torch.OutOfMemoryError`` raised at a chosen module call of a
chosen pass, in forward or in backward) x drivers (a plain loop, the Hugging Face Trainer,
Lightning). Each case runs memguard and plain torch on the same samples and compares
gradients (relative 1e-5), weights after the optimizer steps, buffers and the loss.

Plain torch runs the whole batch where the model's output does not depend on which samples
share a pass, and the same slices as memguard (gradient accumulation) where it does
(BatchNorm's batch statistics, dropout's masks, buffers moved by forward).

Hypothesis draws the plain loop's cases with a fixed seed and a bounded count; set
``MEMGUARD_DIFF_EXAMPLES`` (say 2000) for a larger run. Known open defects are explicit
rows marked ``xfail(strict=True)``: they pass once fixed, and the marker goes then; the
generated cases leave those combinations out (``KNOWN``) until then.
"""

from __future__ import annotations

import copy
import os
import random
import threading
from pathlib import Path

import pytest
import torch
from differential import (
    COUPLED,
    LOSSES,
    STRUCTURES,
    C,
    D,
    H,
    Injector,
    Point,
    accumulate,
    gradient_error,
    loss_value,
    model,
    options,
    pack,
    relative,
    samples,
    step_loss,
    unpack,
    weight_error,
)
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from torch.nn.parameter import is_lazy

import memguard

pytestmark = pytest.mark.differential
TOL = 1e-5
EXAMPLES = int(os.environ.get("MEMGUARD_DIFF_EXAMPLES", "40"))
PLAIN_FEATURES = ("batchnorm", "dropout", "tied", "frozen", "lazy", "buffers",
                  "checkpointing")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models on one thread: two threads spin for each of their small ops, and on a busy
    machine a tiny backward then takes 0.25 s instead of 0.2 ms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def known(features: frozenset[str], structure: str, loss: str) -> str | None:
    """Why a combination is left out of the generated cases: an open defect with a row of its
    own below (``None``: none)."""
    if structure == "list_equal":
        return "per-sample sequences of one length alone: refused when cut (a row below)"
    return None


def refused(call, kinds, *words) -> bool:
    """Run ``call``: ``False`` when it returns; ``True`` when it raises one of ``kinds`` whose
    message names one of ``words`` (a refusal that says what is wrong); anything else is a
    failure."""
    try:
        call()
    except kinds as error:
        message = str(error)
    else:
        return False
    assert any(word in message for word in words), message
    return True


# -- the plain loop ---------------------------------------------------------------------------
def entry_size(history, n: int) -> int:
    """The slice size of the pass that succeeded (the batch's length when it ran whole)."""
    done = [a for a in history if a.ok]
    return done[-1].size if done else n


def run_plain(features: frozenset[str], structure: str, loss: str, sizes: list[list[int]],
              points: list[tuple[Point, ...]], entry: bool = False, length: int = 5,
              seed: int = 0, policy: dict | None = None) -> dict:
    """Train ``len(sizes)`` steps (each step's sample lengths) under memguard with the
    out-of-memory ``points`` of each step, and with plain torch; assert they agree.
    Returns what happened, for the caller's own assertions."""
    steps = [samples(lengths, length, seed + i) for i, lengths in enumerate(sizes)]
    net, ref = model(features, seed), model(features, seed)
    injector = Injector(net)
    lazy = "lazy" in features
    coupled = bool(features & COUPLED)

    @memguard.auto_microbatch(net, **options(loss, structure), **(policy or {}))
    def loss_of(batch):
        return step_loss(net, structure, loss, batch)

    optimizers = None
    if entry:  # gradients kept on purpose from an earlier backward (accumulation)
        extra = samples([length] * 2, length, seed + 99)
        for m in (net, ref):
            torch.manual_seed(seed)
            step_loss(m, structure, loss, pack(structure, extra)).backward()
    report: dict = {"sizes": [], "fired": []}
    try:
        for number, (s, where) in enumerate(zip(steps, points, strict=True)):
            before = [None if is_lazy(p) or p.grad is None else p.grad.clone()
                      for p in net.parameters()]
            injector.arm(where)
            torch.manual_seed(seed)
            try:
                value = loss_of(pack(structure, s))
            except memguard.OutOfMemoryError:
                # every size failed: the step is undone, the entry gradients kept
                report["exhausted"] = True
                for p, g in zip(net.parameters(), before, strict=True):
                    assert relative(p.grad, g) <= TOL
                return report
            size = entry_size(loss_of.history, len(s))
            report["sizes"].append(size)
            report["fired"].extend(injector.fired)
            injector.fired.clear()
            torch.manual_seed(seed)
            expected = accumulate(ref, structure, loss, s, size if coupled else len(s))
            assert relative(value, torch.tensor(expected)) <= TOL, (value, expected)
            error = gradient_error(net, ref)
            assert error <= TOL, f"step {number}: gradients {error:.3g} off plain torch"
            error = weight_error(net, ref)
            assert error <= TOL, f"step {number}: state {error:.3g} off plain torch"
            if lazy:
                continue  # no optimizer over parameters that did not exist at its making
            if optimizers is None:
                optimizers = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
                              for m in (net, ref)]
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
            error = weight_error(net, ref)
            assert error <= TOL, f"after step {number}: weights {error:.3g} off plain torch"
    finally:
        injector.remove()
    return report


point = st.builds(Point, number=st.integers(0, 4), hook=st.integers(0, 7),
                  phase=st.sampled_from(["forward", "backward"]))


@st.composite
def plain_cases(draw):
    features = frozenset(draw(st.sets(st.sampled_from(PLAIN_FEATURES), max_size=3)))
    structure = draw(st.sampled_from([s for s in STRUCTURES if s != "list_equal"]))
    loss = draw(st.sampled_from(LOSSES))
    assume(known(features, structure, loss) is None)
    steps = draw(st.integers(1, 3))
    length = 5
    low = 1 if structure == "list_unequal" else 0
    sizes = []
    for _ in range(steps):
        lengths = draw(st.lists(st.integers(low, length), min_size=4, max_size=9))
        if structure == "list_unequal" and len(set(lengths)) == 1:
            lengths[0] = length - 1 if lengths[0] == length else lengths[0] + 1
        if all(used == 0 for used in lengths):
            lengths[0] = 1  # a batch with no token has no token mean
        sizes.append(lengths)
    points = [tuple(draw(st.lists(point, max_size=3, unique=True))) for _ in range(steps)]
    entry = draw(st.booleans())
    policy = draw(st.fixed_dictionaries({}, optional={
        "factor": st.sampled_from([0.5, 0.3, "auto"]), "grow_every": st.sampled_from([1, 2]),
        "min_batch_size": st.sampled_from([1, 2])}))
    return features, structure, loss, sizes, points, entry, policy


PLAIN = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@PLAIN
@given(plain_cases())
def test_plain_loop_matches_plain_torch(case):
    features, structure, loss, sizes, points, entry, policy = case
    run_plain(features, structure, loss, sizes, points, entry, policy=policy)


# every structure, feature and loss at least once, with an out-of-memory in forward and in
# backward of the first pass and of a later slice
FIRST_FORWARD = (Point(0, 0, "forward"),)
FIRST_BACKWARD = (Point(0, 3, "backward"),)
LATER_FORWARD = (Point(0, 1, "forward"), Point(2, 1, "forward"))
LATER_BACKWARD = (Point(0, 3, "backward"), Point(2, 3, "backward"))
EXPLICIT = [
    (frozenset(), "tensor", "sample_mean", FIRST_FORWARD),
    (frozenset({"batchnorm"}), "dict", "token_mean", FIRST_BACKWARD),
    (frozenset({"dropout"}), "nested", "sum", LATER_FORWARD),
    (frozenset({"tied"}), "list_unequal", "smoothing", LATER_BACKWARD),
    (frozenset({"frozen"}), "strings", "weighted", LATER_BACKWARD),
    (frozenset({"lazy"}), "numpy", "sample_mean", FIRST_BACKWARD),
    (frozenset({"buffers"}), "encoding", "token_mean", LATER_FORWARD),
    (frozenset({"checkpointing"}), "dict", "weighted", LATER_BACKWARD),
    (frozenset({"checkpointing", "tied", "batchnorm"}), "nested", "smoothing", FIRST_BACKWARD),
    (frozenset({"tied", "frozen"}), "list_unequal", "pooled", LATER_FORWARD),
    (frozenset({"buffers", "dropout"}), "tensor", "pooled", LATER_BACKWARD),
]


@pytest.mark.parametrize("features, structure, loss, where", EXPLICIT,
                         ids=["-".join([*sorted(f), s, name]) for f, s, name, _ in EXPLICIT])
def test_explicit_rows_split_and_match_plain_torch(features, structure, loss, where):
    if structure == "encoding":
        pytest.importorskip("transformers")
    lengths = [5, 3, 1, 4, 2, 5, 0, 2] if structure != "list_unequal" else [5, 3, 1, 4, 2, 5]
    report = run_plain(features, structure, loss, [lengths, lengths[::-1]], [where, ()])
    assert report["fired"] == list(where), report  # every point was reached
    assert report["sizes"][0] < len(lengths)  # the batch was split


@pytest.mark.slow  # torch.compile's first trace takes seconds
@pytest.mark.parametrize("where", [FIRST_BACKWARD, LATER_FORWARD], ids=["first", "later"])
def test_compiled_block_splits_and_matches_plain_torch(where):
    lengths = [5, 3, 1, 4, 2, 5, 0, 2]
    report = run_plain(frozenset({"compile"}), "dict", "token_mean", [lengths, lengths],
                       [where, ()])
    assert report["fired"] == list(where) and report["sizes"][0] < len(lengths)


# -- open defects of the plain loop, one row each ---------------------------------------------
LENGTHS = [5, 3, 1, 4, 2, 5, 0, 2]


def test_list_of_equal_length_sequences():
    """Never read as fields by a coincidence of lengths: exact, or refused where the batch
    cannot tell (the ragged list beside it is exact in the generated cases)."""
    call = lambda: run_plain(frozenset(), "list_equal", "pooled", [[5] * 6],  # noqa: E731
                             [FIRST_FORWARD])
    refused(call, ValueError, "cannot tell how to cut")


def test_lazy_batchnorm():
    run_plain(frozenset({"lazy", "batchnorm"}), "dict", "sample_mean", [LENGTHS],
              [FIRST_FORWARD])


@pytest.mark.parametrize("who", ["optimizer", "model"])
def test_zero_grad_at_the_top_of_the_step(who):
    """The natural port of a loop: either refused by name, or the plain loop's weights."""
    net = model(frozenset())
    ref = copy.deepcopy(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    plain = torch.optim.SGD(ref.parameters(), lr=0.5)

    @memguard.auto_microbatch(net)
    def loss_of(batch):
        (optimizer if who == "optimizer" else net).zero_grad()
        return step_loss(net, "dict", "sample_mean", batch)

    data = [samples(LENGTHS, 5, seed) for seed in range(3)]

    def train():
        for s in data:
            loss_of(pack("dict", s))
            optimizer.step()
    if refused(train, RuntimeError, "zero_grad"):
        return
    for s in data:
        plain.zero_grad()
        step_loss(ref, "dict", "sample_mean", pack("dict", s)).backward()
        plain.step()
    assert weight_error(net, ref) <= TOL


def test_optimizer_step_fused_into_backward():
    """PyTorch's own pattern: either refused by name, or plain torch's weights."""
    net = model(frozenset())
    ref = copy.deepcopy(net)

    def fuse(m):
        optimizers = {p: torch.optim.SGD([p], lr=0.5) for p in m.parameters()}

        def step(p):
            optimizers[p].step()
            optimizers[p].zero_grad()
        for p in m.parameters():
            p.register_post_accumulate_grad_hook(step)
    fuse(net)
    fuse(ref)
    injector = Injector(net, (Point(0, 3, "backward"),))

    @memguard.auto_microbatch(net)
    def loss_of(batch):
        return step_loss(net, "dict", "sample_mean", batch)

    s = samples(LENGTHS, 5, 0)
    try:
        if refused(lambda: loss_of(pack("dict", s)), RuntimeError, "hook"):
            return
    finally:
        injector.remove()
    step_loss(ref, "dict", "sample_mean", pack("dict", s)).backward()
    assert weight_error(net, ref) <= TOL


def test_packed_sequence_batch():
    """Either split at sequence boundaries with plain torch's gradients, or refused by name."""
    from torch.nn.utils.rnn import pack_sequence, pad_packed_sequence
    s = samples([5, 4, 4, 3, 2, 1], 5, 0)
    rows = [torch.cat([s.x[i, :used], s.y[i, :used, None].float()], -1)
            for i, used in enumerate(s.lengths)]
    net = model(frozenset())
    ref = copy.deepcopy(net)
    injector = Injector(net, FIRST_FORWARD)

    def loss(m, packed):
        padded, _ = pad_packed_sequence(packed, batch_first=True, padding_value=-100.0)
        x, y = padded[..., :D].clamp(min=-100), padded[..., D].long()
        x = torch.where(y.unsqueeze(-1) == -100, 0.0, x)
        return torch.nn.functional.cross_entropy(m(x.reshape(-1, D)), y.reshape(-1))

    loss_of = memguard.auto_microbatch(net, weight=lambda p: int(p.batch_sizes.sum()))(
        lambda p: loss(net, p))
    try:
        if refused(lambda: loss_of(pack_sequence(rows)), (TypeError, ValueError),
                   "PackedSequence"):
            return
    finally:
        injector.remove()
    loss(ref, pack_sequence(rows)).backward()
    assert gradient_error(net, ref) <= TOL


def test_two_models_sharing_a_submodule_in_two_threads():
    """Either the gradients of both steps add up, or an error that names the sharing."""
    torch.manual_seed(0)
    shared = torch.nn.Linear(D, H)
    a = torch.nn.Sequential(shared, torch.nn.Tanh(), torch.nn.Linear(H, C))
    b = torch.nn.Sequential(shared, torch.nn.Tanh(), torch.nn.Linear(H, C))
    s = samples(LENGTHS, 5, 0)
    x, y = s.x.reshape(-1, D), s.y.reshape(-1)
    b_done = threading.Event()

    @memguard.auto_microbatch(a)
    def step_a(batch):
        out = a(batch[0])
        b_done.wait(10)  # b's whole step runs inside a's
        return torch.nn.functional.cross_entropy(out, batch[1])

    @memguard.auto_microbatch(b)
    def step_b(batch):
        return torch.nn.functional.cross_entropy(b(batch[0]), batch[1])

    errors = []

    def run_a():
        try:
            step_a((x, y))
        except RuntimeError as error:
            errors.append(error)
    thread = threading.Thread(target=run_a)
    thread.start()
    step_b((x, y))
    b_done.set()
    thread.join()
    if errors:
        message = str(errors[0])
        assert "shar" in message and "backward() of its own" not in message, message
        return
    got = shared.weight.grad.clone()
    shared.weight.grad = None
    (torch.nn.functional.cross_entropy(a(x), y)
     + torch.nn.functional.cross_entropy(b(x), y)).backward()
    assert relative(got, shared.weight.grad) <= TOL


def test_invalid_factor_keeps_the_entry_gradients():
    net = model(frozenset())
    s = samples(LENGTHS, 5, 0)
    step_loss(net, "dict", "sample_mean", pack("dict", s)).backward()  # accumulated on purpose
    entry = [p.grad.clone() for p in net.parameters() if p.grad is not None]
    injector = Injector(net, FIRST_FORWARD)

    @memguard.auto_microbatch(net, factor=lambda size: size)  # not below size: invalid
    def loss_of(batch):
        return step_loss(net, "dict", "sample_mean", batch)

    with pytest.raises(ValueError, match="factor"):
        loss_of(pack("dict", s))
    injector.remove()
    after = [p.grad for p in net.parameters() if p.grad is not None]
    assert len(after) == len(entry)
    assert max(relative(g, e) for g, e in zip(after, entry, strict=True)) == 0.0


# -- the Hugging Face Trainer -----------------------------------------------------------------
class Rows(torch.utils.data.Dataset):
    """Per-sample dicts of one set of samples, as a tokenised dataset gives them."""

    def __init__(self, s) -> None:
        self.s = s

    def __len__(self) -> int:
        return len(self.s)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.s.x[i], "labels": self.s.y[i], "w": self.s.w[i]}


def hf_model(features: frozenset[str], loss: str):
    """A model as the Trainer takes it: ``forward(**batch)`` returns the loss. ``"own_mean"``
    takes ``**kwargs`` (so the Trainer passes ``num_items_in_batch``) and ignores them."""

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model(features)

        def loss_of(self, x, labels, w):
            n, length = labels.shape
            seg = torch.arange(n).repeat_interleave(length)
            return self.net(x.reshape(-1, D)), labels.reshape(-1), seg, w

    if loss == "num_items":
        class Items(Model):
            def forward(self, x, labels, w, num_items_in_batch=None, **kwargs):
                logits, y, _, _ = self.loss_of(x, labels, w)
                total = torch.nn.functional.cross_entropy(logits, y, reduction="sum")
                return {"loss": total / num_items_in_batch}
        return Items()
    if loss == "own_mean":
        class OwnMean(Model):
            def forward(self, x, labels, w, **kwargs):
                logits, y, seg, w = self.loss_of(x, labels, w)
                return {"loss": loss_value("sample_mean", logits, y, seg, w)}
        return OwnMean()

    class Plain(Model):
        def forward(self, x, labels, w):
            return {"loss": loss_value(loss, *self.loss_of(x, labels, w))}
    return Plain()


HF_STEPS = 3


LENGTHS_24 = [5, 3, 1, 4, 2, 5, 0, 2, 4, 4, 3, 1, 5, 2, 1, 3, 2, 5, 4, 1, 3, 2, 2, 4]
# batches of 8 whose first samples cannot tell a mean over tokens from one over samples: the
# first batch has as many tokens in every sample, the second in its first four
EQUAL_FIRST = [4] * 8 + [3, 3, 3, 3, 5, 1, 1, 1] + [2, 4, 1, 5, 3, 3, 2, 1]
UNPADDED_FIRST = [5] * 8 + EQUAL_FIRST[8:]


def hf_train(tmp_path, features, loss, points=(), wrap=False, arguments=None,
             lengths=LENGTHS_24, hook=None, **options):
    """``hook(model)``, where given, is called with the model before training."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    data = samples(lengths, 5, 7)
    m = hf_model(features, loss)
    if hook is not None:
        hook(m)
    settings = dict(max_steps=HF_STEPS, per_device_train_batch_size=8, learning_rate=0.5,
                    optim="sgd", lr_scheduler_type="constant", report_to=[],
                    save_strategy="no", logging_steps=1, disable_tqdm=True, use_cpu=True,
                    seed=0, data_seed=0, remove_unused_columns=False)
    args = transformers.TrainingArguments(str(tmp_path), **{**settings, **(arguments or {})})
    trainer = transformers.Trainer(model=m, args=args, train_dataset=Rows(data))
    injector = Injector(m.net, points)
    if wrap:
        from memguard.integrations.transformers import auto_microbatch
        auto_microbatch(trainer, **options)
    try:
        trainer.train()
    finally:
        injector.remove()
    logged = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return m, logged, injector.fired


def hf_compare(tmp_path, features, loss, points, arguments=None, lengths=LENGTHS_24,
               hook=None, **options):
    ref, ref_logged, _ = hf_train(tmp_path / "ref", features, loss, arguments=arguments,
                                  lengths=lengths, hook=hook)
    got, logged, fired = hf_train(tmp_path / "got", features, loss, points, wrap=True,
                                  arguments=arguments, lengths=lengths, hook=hook, **options)
    assert fired == list(points)
    error = weight_error(got, ref)
    assert error <= TOL, f"weights {error:.3g} off the plain Trainer"
    assert logged == pytest.approx(ref_logged, rel=TOL)


HF_ROWS = [
    (frozenset(), "token_mean", FIRST_FORWARD, {}),
    (frozenset({"tied"}), "smoothing", LATER_BACKWARD, {}),
    (frozenset({"checkpointing"}), "num_items", LATER_FORWARD, {}),
    (frozenset({"frozen"}), "sample_mean", FIRST_BACKWARD,
     {"weight": lambda b: len(b["labels"])}),
    (frozenset(), "sample_mean", LATER_FORWARD, {}),  # no weight=: read from the loss
    (frozenset(), "sum", (Point(1, 3, "backward"),), {"reduction": "sum"}),
    (frozenset({"tied"}), "num_items", (Point(1, 2, "forward"), Point(3, 4, "backward")),
     {"arguments": {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 4,
                    "max_grad_norm": 0.05}}),
]


@pytest.mark.parametrize("features, loss, where, extra", HF_ROWS,
                         ids=["-".join([*sorted(f), name, *e.get("arguments", {})])
         for f, name, _, e in HF_ROWS])
def test_hugging_face_trainer_matches_the_plain_trainer(tmp_path, features, loss, where,
                                                        extra):
    hf_compare(tmp_path, features, loss, where, **extra)


def test_hugging_face_model_with_kwargs_and_its_own_mean(tmp_path):
    # a mean over samples, the Trainer passing num_items_in_batch that it ignores: found out
    # from the loss's values, not assumed to be over tokens (0.189 off) or divided by them
    hf_compare(tmp_path, frozenset(), "own_mean", (Point(0, 0, "forward"),
                                                   Point(1, 0, "forward")))


def test_hugging_face_reads_the_mean_past_samples_of_equal_counts(tmp_path):
    # the first batch that splits has as many tokens in every sample: it cannot tell, and the
    # next one is read, from its first neighbours of unequal counts (a mean over samples was
    # weighted by tokens: 0.135 off)
    hf_compare(tmp_path, frozenset(), "own_mean", FIRST_FORWARD, lengths=EQUAL_FIRST,
               arguments={"train_sampling_strategy": "sequential"})


# batches of 8 with samples whose labels are all -100, none among the first four samples of
# the first batch: a mean over the labelled samples there reads as one over all samples
UNLABELLED = [5, 3, 1, 4, 2, 0, 0, 2] + [4, 0, 3, 0, 5, 2, 1, 3] + LENGTHS_24[16:]
# the first batch has labels in every sample: a mean over all samples and one over the
# labelled samples weight it alike, and the second batch is read again
LABELLED_FIRST = [5, 3, 1, 4, 2, 5, 1, 2] + UNLABELLED[8:]
UNLABELLED_ROWS = [("labelled_mean", UNLABELLED), ("labelled_mean", LABELLED_FIRST),
                   ("sample_mean", LABELLED_FIRST)]
UNLABELLED_IDS = ["labelled_mean", "labelled_mean-labelled_first", "sample_mean-labelled_first"]


@pytest.mark.parametrize("loss, lengths", UNLABELLED_ROWS, ids=UNLABELLED_IDS)
def test_hugging_face_reads_a_mean_over_the_labelled_samples(tmp_path, loss, lengths):
    # each sample's token mean, averaged over the samples with any label: slices weighted by
    # their labelled samples (by all samples, the split step was 0.044 off the plain Trainer,
    # silently); a mean over all samples, where the first batch cannot tell, stays one
    hf_compare(tmp_path, frozenset(), loss, FIRST_FORWARD, lengths=lengths,
               arguments={"train_sampling_strategy": "sequential"})


def test_hugging_face_probe_out_of_memory_keeps_the_trainers_sum(tmp_path, caplog):
    # the gradient-free losses that read the loss run out of memory: the Trainer's own
    # assumption (a loss divided by num_items_in_batch, summed over the slices) stands (was
    # weighted by tokens: 0.072 off)
    def no_room_without_gradients(m):
        def refuse(module, args, kwargs):
            if not torch.is_grad_enabled():
                raise torch.OutOfMemoryError("CUDA out of memory (gradient-free forward)")
        m.register_forward_pre_hook(refuse, with_kwargs=True)

    with caplog.at_level("WARNING", logger="memguard"):
        hf_compare(tmp_path, frozenset(), "num_items", FIRST_FORWARD,
                   hook=no_room_without_gradients)
    assert "adds its slices' losses" in caplog.text


def test_hugging_face_padding_free_packing(tmp_path):
    """Packed rows split at sequence boundaries with the plain Trainer's weights, or refused
    with an error that names the packing."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")

    class Texts(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, 50, (3 + i % 5,), generator=g).tolist()
            return {"input_ids": ids}

    def run(path, points, wrap):
        torch.manual_seed(0)
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0))
        args = transformers.TrainingArguments(
            str(path), max_steps=2, per_device_train_batch_size=8, learning_rate=0.5,
            optim="sgd", lr_scheduler_type="constant", report_to=[], save_strategy="no",
            logging_steps=1, disable_tqdm=True, use_cpu=True, seed=0, data_seed=0)
        trainer = transformers.Trainer(
            model=gpt2, args=args, train_dataset=Texts(),
            data_collator=transformers.DataCollatorWithFlattening())
        injector = Injector(gpt2, points)
        if wrap:
            from memguard.integrations.transformers import auto_microbatch
            auto_microbatch(trainer)
        try:
            trainer.train()
        finally:
            injector.remove()
        return gpt2

    ref = run(tmp_path / "ref", (), False)
    got = []
    if refused(lambda: got.append(run(tmp_path / "got", (Point(0, 3, "forward"),), True)),
               (TypeError, ValueError, RuntimeError), "pack", "position_ids", "Flattening"):
        return
    assert weight_error(got[0], ref) <= TOL


# -- Lightning --------------------------------------------------------------------------------
LIGHTNING = ["pytorch_lightning", "lightning.pytorch"]


def collate(structure: str):
    """The DataLoader's collate_fn that builds ``structure`` from Samples' rows."""
    def build(rows):
        return pack(structure, samples_of(rows))
    return build


def samples_of(rows):
    from differential import Samples
    x = torch.stack([r[0] for r in rows])
    y = torch.stack([r[1] for r in rows])
    w = torch.stack([r[2] for r in rows])
    return Samples(x, y, [int((r[1] != -100).sum()) for r in rows], w)


class Triples(torch.utils.data.Dataset):
    def __init__(self, s) -> None:
        self.s = s

    def __len__(self) -> int:
        return len(self.s)

    def __getitem__(self, i: int):
        return self.s.x[i], self.s.y[i], self.s.w[i]


def lightning_fit(package, features, structure, loss, points=(), callback=None,
                  scale=1.0, grads=None, count=False, lengths=LENGTHS_24, hook=None,
                  **options):
    """The fitted module, its logged epoch loss and the points that fired; ``grads``: a list
    given the gradients each optimizer step sees (unscaled, as Lightning hands them);
    ``hook(module)``, where given, is called at the top of every ``training_step``."""
    pl = pytest.importorskip(package)
    torchmetrics = pytest.importorskip("torchmetrics") if count else None

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model(features)
            # what the step saw, as a torchmetrics state (put back when a pass is redone)
            self.seen = torchmetrics.SumMetric() if count else None

        def training_step(self, batch, index):
            if hook is not None:
                hook(self)
            x, y, seg, w = unpack(structure, batch)
            if self.seen is not None:
                self.seen.update(len(w))
            value = loss_value(loss, self.net(x), y, seg, w) * scale
            self.log("train_loss", value, on_step=False, on_epoch=True, batch_size=len(w))
            return value

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

        def on_before_optimizer_step(self, optimizer):
            if grads is not None:
                grads.append([None if p.grad is None else p.grad.detach().clone()
                              for p in self.net.parameters()])

    data = samples(lengths, 5, 7)
    if structure == "list_unequal":
        data.lengths = [max(used, 1) for used in data.lengths]
    module = Module()
    injector = Injector(module.net, points)
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", devices=1,
                         callbacks=[callback] if callback is not None else [], **options)
    loader = torch.utils.data.DataLoader(Triples(data), batch_size=8,
                                         collate_fn=collate(structure))
    try:
        trainer.fit(module, loader)
    finally:
        injector.remove()
    return module, float(trainer.callback_metrics["train_loss"]), injector.fired


def lightning_compare(package, features, structure, loss, points, with_weight=True, **extra):
    from memguard.integrations.lightning import MemguardCallback
    if package == "lightning.pytorch":
        pytest.importorskip("lightning")
    ref, ref_logged, _ = lightning_fit(package, features, structure, loss, **extra)
    told = options(loss, structure) if with_weight else {}
    got, logged, fired = lightning_fit(package, features, structure, loss, points,
                                       MemguardCallback(microbatch=True, **told), **extra)
    assert fired == list(points)
    return ref, ref_logged, got, logged


LIGHTNING_ROWS = [
    ("pytorch_lightning", frozenset(), "dict", "token_mean", FIRST_FORWARD),
    ("lightning.pytorch", frozenset({"tied"}), "nested", "sample_mean", FIRST_FORWARD),
    ("pytorch_lightning", frozenset({"checkpointing"}), "list_unequal", "sum",
     (Point(1, 3, "forward"),)),
    ("lightning.pytorch", frozenset({"frozen"}), "strings", "weighted", FIRST_FORWARD),
    ("pytorch_lightning", frozenset({"tied"}), "dict", "pooled", FIRST_FORWARD,
     {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}),
]


@pytest.mark.parametrize("package, features, structure, loss, where, trainer", [
    row if len(row) == 6 else (*row, {}) for row in LIGHTNING_ROWS],
    ids=["-".join([row[0].split(".")[0], *sorted(row[1]), row[2], row[3],
                   *(row[5] if len(row) == 6 else {})]) for row in LIGHTNING_ROWS])
def test_lightning_matches_plain_lightning(package, features, structure, loss, where, trainer):
    ref, ref_logged, got, logged = lightning_compare(package, features, structure, loss, where,
                                                     **trainer)
    error = weight_error(got, ref)
    assert error <= TOL, f"weights {error:.3g} off plain Lightning"
    if loss in ("sample_mean", "pooled"):  # logged per slice with batch_size=, as the guide asks
        assert logged == pytest.approx(ref_logged, rel=TOL)


def test_lightning_out_of_memory_in_backward_and_the_epoch_mean():
    # the failed whole-batch pass's self.log calls and torchmetrics updates are undone (a
    # plain Python counter in training_step cannot be: the step runs again on each slice)
    ref, ref_logged, got, logged = lightning_compare("pytorch_lightning", frozenset(), "dict",
                                                     "sample_mean", FIRST_BACKWARD, count=True)
    assert weight_error(got, ref) <= TOL
    assert float(got.seen.compute()) == float(ref.seen.compute()) == 24
    assert logged == pytest.approx(ref_logged, rel=TOL)


def test_lightning_out_of_memory_in_a_later_slice_and_the_epoch_mean():
    ref, ref_logged, got, logged = lightning_compare("pytorch_lightning", frozenset(), "dict",
                                                     "sample_mean", LATER_FORWARD)
    assert weight_error(got, ref) <= TOL  # the weights are right: only the log is off
    assert logged == pytest.approx(ref_logged, rel=TOL)


@pytest.mark.parametrize("structure, loss, lengths", [
    ("dict", "token_mean", LENGTHS_24), ("dict", "sample_mean", LENGTHS_24),
    ("nested", "token_mean", LENGTHS_24),
    # the first batch that splits cannot tell (as many tokens in every sample, or no padding
    # at all): read again at the next (a mean over samples weighted by tokens was 0.135 off)
    ("dict", "sample_mean", EQUAL_FIRST), ("dict", "token_mean", UNPADDED_FIRST)],
    ids=["dict-token_mean", "dict-sample_mean", "nested-token_mean",
         "dict-sample_mean-equal_first", "dict-token_mean-unpadded_first"])
def test_lightning_reads_the_mean_without_weight(structure, loss, lengths):
    # labels padded with -100 under a name of the program's own: the loss's own mean is read
    # off training_step, the probe's self.log calls and metric updates undone
    ref, ref_logged, got, logged = lightning_compare(
        "pytorch_lightning", frozenset(), structure, loss, FIRST_FORWARD, with_weight=False,
        count=True, lengths=lengths)
    assert weight_error(got, ref) <= TOL
    assert float(got.seen.compute()) == float(ref.seen.compute()) == 24
    if loss == "sample_mean":  # logged per slice with batch_size=: the probe's calls dropped
        assert logged == pytest.approx(ref_logged, rel=TOL)


@pytest.mark.parametrize("loss, lengths", UNLABELLED_ROWS, ids=UNLABELLED_IDS)
def test_lightning_reads_a_mean_over_the_labelled_samples(loss, lengths):
    # as test_hugging_face_reads_a_mean_over_the_labelled_samples, for Lightning
    ref, _, got, _ = lightning_compare("pytorch_lightning", frozenset(), "dict", loss,
                                       FIRST_FORWARD, with_weight=False, lengths=lengths)
    assert weight_error(got, ref) <= TOL


def test_lightning_probe_leaves_the_run_alone_or_steps_aside():
    # the probe's training_step draws from Python's random: the stream the run's own steps
    # see is the one they see without a probe (weight= given); a step that cannot run in
    # eval mode (a BatchNorm without running statistics on one sample) warns, not crashes
    from memguard.integrations.lightning import MemguardCallback
    draws: dict[str, list[float]] = {"probe": [], "told": []}

    def draw(into):
        def hook(module):
            value = random.random()
            if module.training:
                draws[into].append(value)
        return hook

    for into, told in (("probe", {}), ("told", {"weight": lambda b: len(b["w"])})):
        random.seed(0)
        lightning_fit("pytorch_lightning", frozenset(), "dict", "sample_mean", FIRST_FORWARD,
                      MemguardCallback(microbatch=True, **told), hook=draw(into))
    assert len(draws["probe"]) == 1 + 3 * 2  # the failed pass, then 3 steps of 2 slices
    assert draws["probe"] == draws["told"]

    def eval_fails(module):
        if not module.training:
            raise ValueError("Expected more than 1 value per channel when training")

    ref, _, got, _ = lightning_compare("pytorch_lightning", frozenset(), "dict", "sample_mean",
                                       FIRST_FORWARD, with_weight=False, hook=eval_fails)
    assert weight_error(got, ref) <= TOL  # undecided, weighted by samples: this loss's mean


def test_lightning_says_when_several_tensors_could_be_the_labels(caplog):
    # two integer tensors padded with -100: which one a mean over tokens counts is not read,
    # and the slices weighted by samples are said to be so (a mean over tokens was 0.12 off,
    # silently)
    with caplog.at_level("WARNING", logger="memguard"):
        ref, _, got, _ = lightning_compare("pytorch_lightning", frozenset(), "two_labels",
                                           "sample_mean", FIRST_FORWARD, with_weight=False)
    assert weight_error(got, ref) <= TOL
    assert caplog.text.count("several integer tensors with -100") == 1


def test_lightning_dataclass_batch():
    ref, _, got, _ = lightning_compare("lightning.pytorch", frozenset(), "dataclass",
                                       "sample_mean", FIRST_FORWARD)
    assert weight_error(got, ref) <= TOL


def test_lightning_16_mixed_scales_the_loss():
    # the gradients each optimizer step sees, not the weights moved: an update of 1e-7 on a
    # weight of 0.3 is a few float32 ulps, and rounding the update read 2% apart
    pl = pytest.importorskip("pytorch_lightning")
    from memguard.integrations.lightning import MemguardCallback

    def fit(grads, **extra):
        lightning_fit("pytorch_lightning", frozenset(), "dict", "sample_mean", scale=1e-5,
                      grads=grads, **extra)
        return grads

    fp32 = fit([])
    mixed = {"plugins": [pl.plugins.precision.MixedPrecision("16-mixed", "cpu")]}
    ref = fit([], **mixed)
    got = fit([], points=FIRST_FORWARD, callback=MemguardCallback(
        microbatch=True, **options("sample_mean", "dict")), **mixed)
    assert len(got) == len(ref) == len(fp32) == 3
    pairs = [(a, b) for mine, theirs in zip(got, ref, strict=True)
             for a, b in zip(mine, theirs, strict=True)]
    assert all(b is not None and b.abs().max() > 0 for _, b in pairs)  # plain 16-mixed trains
    noise = max(relative(b, c) for step, exact in zip(ref, fp32, strict=True)
                for b, c in zip(step, exact, strict=True))
    # unscaled, small float16 gradients underflow to 0: a relative error of 1
    assert max(relative(a, b) for a, b in pairs) <= max(noise, 1e-3), noise


# -- a real budget: the injected points anchored to a real out-of-memory ----------------------
BUDGET = """
import sys
sys.path.insert(0, TESTS)
import torch
import memguard
import differential as d
torch.set_num_threads(1)

class Wide(torch.nn.Module):
    # 8192 positions x 2048 hidden: 64 MiB per activation, about 256 MiB for a step
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(d.D, 2048)
        self.head = torch.nn.Linear(2048, d.C)

    def forward(self, x):
        return self.head(torch.tanh(self.up(x)))

results = []
scenarios = [("dict", "sample_mean"), ("nested", "token_mean"), ("numpy", "weighted")]
lengths = [64 - (i * 7) % 40 for i in range(128)]
s = d.samples(lengths, 64, 0)
references = []
for structure, loss in scenarios:  # plain torch, the whole batch, before the budget
    ref = Wide()
    d.step_loss(ref, structure, loss, d.pack(structure, s)).backward()
    references.append(ref)
warm = Wide()
memguard.auto_microbatch(warm)(lambda b: d.step_loss(warm, "dict", "sample_mean", b))(
    d.pack("dict", s.part(0, 8)))
del warm
memguard.free_memory()
set_budget(BUDGET_MIB)
plain_fails = None
try:
    probe = Wide()
    d.step_loss(probe, "dict", "sample_mean", d.pack("dict", s)).backward()
except Exception as error:
    plain_fails = memguard.is_oom_error(error)
del probe
memguard.free_memory()
for (structure, loss), ref in zip(scenarios, references):
    net = Wide()
    step = memguard.auto_microbatch(net, **d.options(loss, structure))(
        lambda b: d.step_loss(net, structure, loss, b))
    step(d.pack(structure, s))
    results.append({"structure": structure, "loss": loss,
                    "sizes": [a.size for a in step.history],
                    "error": d.gradient_error(net, ref)})
    del net, step
    memguard.free_memory()
lift_budget()
finish({"plain_fails": plain_fails, "results": results})
"""


@pytest.mark.slow
def test_a_real_budget_splits_every_structure_as_plain_torch(python_in_subprocess):
    from budget import ENV, script
    code = script(f"TESTS = {str(Path(__file__).parent)!r}\nBUDGET_MIB = 140\n", BUDGET)
    out = python_in_subprocess(code, env=ENV, timeout=300)
    assert out["plain_fails"] is True, out  # the whole batch does not fit the budget
    for result in out["results"]:
        assert result["sizes"][0] == 128 and len(result["sizes"]) > 1, result
        assert result["error"] <= TOL, result


BUFFER = """
import torch
import memguard
torch.set_num_threads(1)

class Table(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(64, 1024)
        self.head = torch.nn.Linear(1024, 1)
        self.register_buffer("table", torch.zeros(64 * 2**20 // 1))  # 256 MiB, persistent

    def forward(self, x):
        return self.head(torch.relu(self.layer(x))) + self.table[:1]

def loss(m, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(m(x), y)

g = torch.Generator().manual_seed(0)
batches = [(torch.randn(4096, 64, generator=g), torch.randn(4096, 1, generator=g))
           for _ in range(2)]
net = Table()
ref = Table()
memguard.free_memory()
set_budget(240)  # a copy of the 256 MiB buffer would not fit; memguard's steps split at
# 140-160 MiB in a quiet run, and once at 200 MiB under coverage in a loaded CI run, after the
# plain steps here left ~33 MiB of address space mapped (alone in a process, memguard's steps
# and plain torch's both fit 100 MiB and both run out of memory at 80 MiB)
for batch in batches:  # plain torch fits the budget: about 50 MiB a step
    loss(ref, batch).backward()
memguard.free_memory()
step = memguard.auto_microbatch(net)(lambda b: loss(net, b))
outcome = "ok"
try:
    for batch in batches:
        step(batch)
except Exception as error:
    outcome = f"{type(error).__name__}: {str(error)[:300]}"
lift_budget()
error = max(((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
            for p, q in zip(net.parameters(), ref.parameters()) if p.grad is not None)
finish({"outcome": outcome, "sizes": [a.size for a in step.history], "error": error})
"""


@pytest.mark.slow
def test_a_large_buffer_under_a_budget_plain_torch_fits(python_in_subprocess):
    from budget import ENV, script
    out = python_in_subprocess(script(BUFFER), env=ENV, timeout=300)
    assert out["outcome"] == "ok", out
    assert out["sizes"] == [4096], out  # never split: the batch fits
    assert out["error"] <= TOL, out


# -- generated out-of-memory points inside the trainers ---------------------------------------
TRAINER_EXAMPLES = max(4, EXAMPLES // 8)
TRAINERS = settings(max_examples=TRAINER_EXAMPLES, derandomize=True, deadline=None,
                    database=None, suppress_health_check=[HealthCheck.too_slow])
points = st.lists(point, max_size=3, unique=True).map(tuple)


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory):
    """The plain Trainer's run, shared by every generated case."""
    return hf_train(tmp_path_factory.mktemp("hf-reference"), frozenset({"tied"}), "token_mean")


@TRAINERS
@given(where=points)
def test_hugging_face_trainer_at_generated_points(hf_reference, tmp_path_factory, where):
    ref, ref_logged, _ = hf_reference
    got, logged, fired = hf_train(tmp_path_factory.mktemp("hf"), frozenset({"tied"}),
                                  "token_mean", where, wrap=True)
    error = weight_error(got, ref)
    assert error <= TOL, f"weights {error:.3g} off the plain Trainer, points fired: {fired}"
    assert logged == pytest.approx(ref_logged, rel=TOL)


@pytest.fixture(scope="module")
def lightning_reference():
    """Plain Lightning's run, shared by every generated case."""
    return lightning_fit("pytorch_lightning", frozenset({"checkpointing"}), "dict",
                         "sample_mean")


@TRAINERS
@given(where=points)
def test_lightning_at_generated_points(lightning_reference, where):
    from memguard.integrations.lightning import MemguardCallback
    ref, ref_logged, _ = lightning_reference
    got, logged, fired = lightning_fit("pytorch_lightning", frozenset({"checkpointing"}), "dict",
                                       "sample_mean", where, MemguardCallback(microbatch=True))
    error = weight_error(got, ref)
    assert error <= TOL, f"weights {error:.3g} off plain Lightning, points fired: {fired}"
    # the log of a pass that failed after self.log (in backward, or a later slice) is an open
    # defect with rows of its own
    if all(p.phase == "forward" and p.number == 0 for p in fired):
        assert logged == pytest.approx(ref_logged, rel=TOL), fired
