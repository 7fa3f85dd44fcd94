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
import threading

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import memguard
from torch.nn.parameter import is_lazy
from differential import (COUPLED, D, H, C, LOSSES, STRUCTURES, Injector, Point, accumulate, model,
                          options, pack, samples, step_loss, gradient_error, weight_error,
                          relative)

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
        return "per-sample sequences of one length read as fields"
    if "lazy" in features and "batchnorm" in features:
        return "LazyBatchNorm1d fails at the first call"
    return None


# -- the plain loop ---------------------------------------------------------------------------
def entry_size(history, n: int) -> int:
    """The slice size of the pass that succeeded (the batch's length when it ran whole)."""
    done = [a for a in history if a.ok]
    return done[-1].size if done else n


def run_plain(features: frozenset[str], structure: str, loss: str, sizes: list[list[int]],
              points: list[tuple[Point, ...]], entry: bool = False, length: int = 5,
              seed: int = 0) -> dict:
    """Train ``len(sizes)`` steps (each step's sample lengths) under memguard with the
    out-of-memory ``points`` of each step, and with plain torch; assert they agree.
    Returns what happened, for the caller's own assertions."""
    steps = [samples(lengths, length, seed + i) for i, lengths in enumerate(sizes)]
    net, ref = model(features, seed), model(features, seed)
    injector = Injector(net)
    lazy = "lazy" in features
    coupled = bool(features & COUPLED)

    @memguard.auto_microbatch(net, **options(loss, structure))
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
        for number, (s, where) in enumerate(zip(steps, points)):
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
    steps = draw(st.integers(1, 2))
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
    return features, structure, loss, sizes, points, entry


PLAIN = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@PLAIN
@given(plain_cases())
def test_plain_loop_matches_plain_torch(case):
    features, structure, loss, sizes, points, entry = case
    if structure == "dataclass":  # documented: no per-sample part memguard can see
        with pytest.raises(TypeError, match="Batch"):
            run_plain(features, structure, loss, sizes, points, entry)
        return
    run_plain(features, structure, loss, sizes, points, entry)


# every structure, feature and loss at least once, with an out-of-memory in forward and in
# backward of the first pass and of a later slice
FIRST_FORWARD = (Point(0, 0, "forward"),)
FIRST_BACKWARD = (Point(0, 2, "backward"),)
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
                         ids=["-".join([*sorted(f), s, l]) for f, s, l, _ in EXPLICIT])
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


@pytest.mark.xfail(strict=True, reason="per-sample sequences of one common length are read "
                                       "as fields and cut along their positions")
def test_list_of_equal_length_sequences():
    run_plain(frozenset(), "list_equal", "pooled", [[5] * 6], [FIRST_FORWARD])


@pytest.mark.xfail(strict=True, reason="LazyBatchNorm1d fails at the first call")
def test_lazy_batchnorm():
    run_plain(frozenset({"lazy", "batchnorm"}), "dict", "sample_mean", [LENGTHS],
              [FIRST_FORWARD])


@pytest.mark.xfail(strict=True, reason="zero_grad() kept at the top of the step is ignored "
                                       "while the batch fits whole")
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
    try:
        for s in data:
            loss_of(pack("dict", s))
            optimizer.step()
    except RuntimeError as error:
        assert "zero_grad" in str(error)
        return
    for s in data:
        plain.zero_grad()
        step_loss(ref, "dict", "sample_mean", pack("dict", s)).backward()
        plain.step()
    assert weight_error(net, ref) <= TOL


@pytest.mark.xfail(strict=True, reason="an optimizer step fused into backward "
                                       "(register_post_accumulate_grad_hook) is neither "
                                       "refused nor undone")
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
        loss_of(pack("dict", s))
    except RuntimeError as error:
        assert "hook" in str(error)
        return
    finally:
        injector.remove()
    step_loss(ref, "dict", "sample_mean", pack("dict", s)).backward()
    assert weight_error(net, ref) <= TOL


@pytest.mark.xfail(strict=True, reason="a PackedSequence batch raises ValueError labelling its "
                                       "fields 0..3")
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
        loss_of(pack_sequence(rows))
    except (TypeError, ValueError) as error:
        assert "PackedSequence" in str(error)
        return
    finally:
        injector.remove()
    loss(ref, pack_sequence(rows)).backward()
    assert gradient_error(net, ref) <= TOL


@pytest.mark.xfail(strict=True, reason="two models sharing a submodule stepped from two "
                                       "threads: the error blames a backward() of its own")
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


@pytest.mark.xfail(strict=True, reason="a factor callable returning an invalid size wipes the "
                                       "accumulated entry gradients on the whole-batch path")
def test_invalid_factor_keeps_the_entry_gradients():
    net = model(frozenset())
    s = samples(LENGTHS, 5, 0)
    step_loss(net, "dict", "sample_mean", pack("dict", s)).backward()  # accumulated on purpose
    entry = [p.grad.clone() for p in net.parameters() if p.grad is not None]
    injector = Injector(net, FIRST_FORWARD)

    @memguard.auto_microbatch(net, factor=lambda size: size)  # not below size: invalid
    def loss_of(batch):
        return step_loss(net, "dict", "sample_mean", batch)

    with pytest.raises(ValueError):
        loss_of(pack("dict", s))
    injector.remove()
    after = [p.grad for p in net.parameters() if p.grad is not None]
    assert len(after) == len(entry)
    assert max(relative(g, e) for g, e in zip(after, entry)) == 0.0
