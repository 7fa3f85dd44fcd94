"""auto_microbatch's recompute rung under a real memory budget (a soft RLIMIT_AS in a
subprocess): one sample that does not fit even alone runs with its blocks' activations
recomputed in backward, with the gradients of plain torch's unbudgeted step.

The model: 12 residual blocks (Linear 64 -> 1024 -> 64) on one sample of 4,096 positions,
about 410 MiB of address space at its peak in a plain pass and at most about 60 MiB with
each block checkpointed (the 1,024-wide activations dominate both); the budget is 320 MiB.
glibc's mmap threshold is fixed at 1 MiB, so that freed activations give their address space
back as a device's allocator would (with the threshold moving, 16 MiB blocks freed into the
heap left it fragmented: 366 MiB free there and no 16 MiB block to be had). The references
run after the budget is lifted.
"""

from __future__ import annotations

import pytest

from budget import ENV, script

FIXED_THRESHOLD = dict(ENV, MALLOC_MMAP_THRESHOLD_=str(1 << 20))  # see the docstring above

RECOMPUTE = """
import copy
import logging
import torch
import memguard
torch.set_num_threads(1)

class Block(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.up = torch.nn.Linear(64, 1024)
        self.down = torch.nn.Linear(1024, 64)
        self.drop = torch.nn.Dropout(0.1) if norm else torch.nn.Identity()
        self.norm = torch.nn.BatchNorm1d(64) if norm else None

    def forward(self, x):
        y = x + self.down(self.drop(torch.nn.functional.gelu(self.up(x))))
        if self.norm is not None:
            y = self.norm(y.transpose(1, 2)).transpose(1, 2)
        return y

def make(norm, container):
    torch.manual_seed(0)
    blocks = [Block(norm) for _ in range(12)]
    if container == "list":
        class Stack(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = torch.nn.ModuleList(blocks)
                self.head = torch.nn.Linear(64, 1)
            def forward(self, x):
                for block in self.blocks:
                    x = block(x)
                return self.head(x)
        return Stack()
    return torch.nn.Sequential(*blocks, torch.nn.Linear(64, 1))

def sample(positions, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, positions, 64, generator=g), torch.randn(1, positions, 1, generator=g)

def loss_fn(model, b):
    x, y = b
    return torch.nn.functional.mse_loss(model(x), y)

def reference_grads(norm, container, b):
    model = make(norm, container)
    torch.manual_seed(7)  # as before the step: the same Dropout masks
    loss_fn(model, b).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    buffers = [t.clone() for t in model.buffers()]
    generator = torch.get_rng_state()
    del model
    memguard.free_memory()
    return grads, buffers, generator

def relative(a, b):
    return max(((p - q).norm() / q.norm().clamp_min(1e-30)).item() for p, q in zip(a, b))

messages = []
class Keep(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())
logging.getLogger("memguard").addHandler(Keep())

big = sample(4096)
small = sample(1024, seed=2)
CASES = [(False, "sequential"), (False, "list"), (True, "sequential")]
got = {}

# warm the allocator and autograd up on a small sample, then the budget
warm = make(False, "sequential")
loss_fn(warm, sample(64)).backward()
del warm
memguard.free_memory()
set_budget(320)

result = {}
# plain torch: out of memory
plain = make(False, "sequential")
try:
    loss_fn(plain, big).backward()
    result["plain"] = "fit"
except RuntimeError as exc:
    result["plain"] = "oom" if memguard.is_oom_error(exc) else repr(exc)
del plain
memguard.free_memory()

for norm, container in CASES:
    model = make(norm, container)
    blocks = [m for m in model.modules() if isinstance(m, Block)]

    @memguard.auto_microbatch(model)
    def step(b):
        return loss_fn(model, b)

    # the failed pass drew Dropout's masks: the recomputed one must draw them again
    torch.manual_seed(7)
    step(big)
    key = f"{container}{'-norm' if norm else ''}"
    got[key] = ([p.grad.clone() for p in model.parameters()],
                [t.clone() for t in model.buffers()], torch.get_rng_state())
    result[key] = {
        "history": [[a.size, a.ok, a.recompute] for a in step.history],
        "restored": all("forward" not in vars(b) for b in blocks),
    }
    if key == "sequential":
        # a sample that fits: a plain pass, nothing recomputed
        model.zero_grad()
        step(small)
        got["small"] = ([p.grad.clone() for p in model.parameters()], [])
        result["small"] = {"history": [[a.size, a.ok, a.recompute] for a in step.history]}
        # the rung turned off: the error as before
        model.zero_grad()
        off = memguard.auto_microbatch(model, recompute=False)(step.__wrapped__)
        try:
            off(big)
            result["off"] = "fit"
        except memguard.OutOfMemoryError as exc:
            result["off"] = str(exc)
        result["off_restored"] = all(p.grad is None for p in model.parameters())

        # Ctrl-C inside the recomputed pass: the forwards are put back
        calls = []
        @memguard.auto_microbatch(model)
        def interrupted(b):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return loss_fn(model, b)
        try:
            interrupted(big)
            result["interrupt"] = "ran"
        except KeyboardInterrupt:
            result["interrupt"] = "raised"
        result["interrupt_restored"] = all("forward" not in vars(b) for b in blocks)
    del model, step
    memguard.free_memory()

lift_budget()
# the references: plain torch, whole, without a budget
for norm, container in CASES:
    key = f"{container}{'-norm' if norm else ''}"
    grads, buffers, generator = reference_grads(norm, container, big)
    result[key]["grad"] = relative(got[key][0], grads)
    result[key]["generator"] = torch.equal(got[key][2], generator)
    result[key]["buffers"] = relative([t.float() for t in got[key][1]],
                                      [t.float() for t in buffers]) if buffers else 0.0
result["small"]["grad"] = relative(got["small"][0],
                                   reference_grads(False, "sequential", small)[0])
result["log"] = [m for m in messages if "recompute" in m]
finish(result)
"""


@pytest.mark.slow
def test_one_sample_too_long_runs_with_recompute_and_plain_torch_gradients(
        python_in_subprocess):
    out = python_in_subprocess(script(RECOMPUTE), env=FIXED_THRESHOLD, timeout=600)
    assert out["plain"] == "oom", out  # the budget is real: plain torch does not fit
    for key in ("sequential", "list", "sequential-norm"):
        row = out[key]
        # the plain pass of one sample ran out, the recomputed one fitted
        assert row["history"] == [[1, False, False], [1, True, True]], (key, row)
        assert row["grad"] < 1e-5, (key, row)
        assert row["buffers"] < 1e-5, (key, row)  # BatchNorm's statistics moved once
        assert row["restored"], key
        assert row["generator"], key  # left as plain torch's step leaves it
    # a sample that fits runs plain afterwards
    assert out["small"]["history"] == [[1, True, False]], out["small"]
    assert out["small"]["grad"] < 1e-5
    assert "Not even one sample" in out["off"] or "microbatch_size=1" in out["off"], out["off"]
    assert out["off_restored"]
    assert out["interrupt"] == "raised" and out["interrupt_restored"]
    assert any("recomputed" in m for m in out["log"]), out["log"]


# the model, the samples and the loss of RECOMPUTE, without its cases
MODEL = RECOMPUTE[:RECOMPUTE.index("def reference_grads")]

FIRST_RUNG = MODEL + """
import sys
dynamo_before = "torch._dynamo" in sys.modules
model = make(False, "sequential")

@memguard.auto_microbatch(model)
def step(b):
    return loss_fn(model, b)

step(sample(64))  # a plain pass that fits: no checkpoint has run in this process
memguard.free_memory()
set_budget(100)  # the plain pass of 2,048 positions needs ~200 MiB, the recomputed one less
try:
    step(sample(2048))
    result = {"history": [[a.size, a.ok, a.recompute] for a in step.history]}
except Exception as exc:
    result = {"error": f"{type(exc).__name__}: {exc}"[:400]}
result["dynamo_before"] = dynamo_before
finish(result)
"""


def test_the_first_recomputed_pass_does_not_import_torch_dynamo_with_memory_exhausted(
        python_in_subprocess):
    """torch.utils.checkpoint imports torch._dynamo on its first call (about 60 MiB of
    address space): in the rung, with memory exhausted, that import made the pass run out
    where the pass alone fitted. auto_microbatch imports it when it decorates."""
    out = python_in_subprocess(script(FIRST_RUNG), env=FIXED_THRESHOLD, timeout=300)
    assert out["dynamo_before"] is False, out  # the process had not imported it itself
    assert out.get("history") == [[1, False, False], [1, True, True]], out


def test_a_hugging_face_model_uses_its_own_checkpointing_for_the_batch_only():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from memguard.backends.steps import torch_recompute as _recompute

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                     n_positions=64)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 100, (2, 16))

    def grads():
        model.zero_grad()
        torch.manual_seed(3)  # dropout: the same masks in both runs
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    with _recompute.recomputing(model) as what:
        assert model.is_activation_checkpointing
        recomputed = grads()
    assert "gradient checkpointing" in what
    assert not model.is_activation_checkpointing  # off again after the batch
    pairs = zip(plain, recomputed, strict=True)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in pairs)


def test_blocks_get_their_forwards_back_after_an_error():
    torch = pytest.importorskip("torch")
    from memguard.backends.steps import torch_recompute as _recompute

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.nn.Linear(4, 1))
    blocks = list(model.children())
    x = torch.randn(3, 4)
    seen = []

    def interrupted() -> None:
        with _recompute.recomputing(model) as what:
            seen.append(what)
            seen.append(all("forward" in vars(b) for b in blocks))
            model(x).sum().backward()
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        interrupted()
    assert seen == ["3 blocks checkpointed", True]  # the inner Sequential inside its own
    assert all("forward" not in vars(b) for b in blocks)
    assert not _recompute.available(torch.nn.Linear(4, 4))  # nothing to checkpoint


def test_a_block_with_a_generator_of_its_own_is_not_recomputed(caplog):
    # checkpointing restores only torch's global generators: a block drawing from its own
    # would recompute other noise than its forward drew, and its gradients would not be the
    # loss's (1.1e-3 relative under a real budget). The rung is skipped: the out-of-memory
    # stands, with the entry gradients, and the log says why
    import logging

    torch = pytest.importorskip("torch")
    import memguard

    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.noise = torch.Generator().manual_seed(3)

        def forward(self, x):
            return x + self.linear(x) * torch.rand(x.shape, generator=self.noise)

    def stack(noisy):
        blocks = [Noisy() if noisy else torch.nn.Linear(4, 4) for _ in range(3)]
        return torch.nn.Sequential(*blocks, torch.nn.Linear(4, 1))

    for noisy in (False, True):
        model = stack(noisy)
        model[-1].weight.grad = torch.ones_like(model[-1].weight)

        @memguard.auto_microbatch(model)
        def loss_of(batch, model=model):
            if "forward" not in vars(model[0]):  # runs only with its blocks checkpointed
                torch.empty(1 << 48)  # out of memory, for real
            return model(batch).sum()

        with caplog.at_level(logging.WARNING, logger="memguard"):
            if noisy:
                with pytest.raises(memguard.OutOfMemoryError):
                    loss_of(torch.randn(1, 4))
                assert torch.equal(model[-1].weight.grad, torch.ones_like(model[-1].weight))
            else:
                loss_of(torch.randn(1, 4))
                assert [a.recompute for a in loss_of.history] == [False, True]
    assert "its module attribute 0.noise is a torch.Generator of its own" in caplog.text


# -- the offload rung (after recompute; CUDA, ROCm, XPU only) ------------------------------------

def _stack(torch, blocks, width):
    """A residual stack: ``blocks`` blocks (Linear width -> width, GELU, Linear width ->
    width), then a head to one output."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(width, width)
            self.down = torch.nn.Linear(width, width)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    return torch.nn.Sequential(*[Block() for _ in range(blocks)], torch.nn.Linear(width, 1))


@pytest.mark.parametrize("error", ["cpu allocator", "says cuda"])
@pytest.mark.parametrize("blocks", [3, 0])
def test_offload_never_runs_on_the_cpu(error, blocks, caplog):
    """A model on the CPU: after the smallest slice (and recompute, where the model has
    blocks) ran out of memory, no offload pass is tried, even when the error names a CUDA
    device, and the step ends with memguard's error listing every size tried."""
    torch = pytest.importorskip("torch")
    import memguard

    torch.manual_seed(0)
    model = _stack(torch, blocks, 8) if blocks else torch.nn.Linear(8, 1)

    @memguard.auto_microbatch(model)
    def step(batch):
        if error == "cpu allocator":
            torch.empty(1 << 50, dtype=torch.uint8)  # the CPU allocator's real error
        else:  # what a CUDA library called inside the step could raise
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return model(batch).pow(2).mean()

    caplog.set_level("INFO", logger="memguard")
    with pytest.raises(memguard.OutOfMemoryError) as raised:
        step(torch.ones(2, 8))
    rows = [[a.size, a.ok, a.recompute, a.offload] for a in step.history]
    below = [[1, False, True, False]] if blocks else []  # the recompute rung, where it ran
    assert rows == [[2, False, False, False], [1, False, False, False], *below], rows
    assert raised.value.attempts == step.history
    text = str(raised.value)
    assert "every microbatch_size tried for a batch of 2: 2 (" in text, text
    assert text.count("); 1 (") == 1 + len(below) and "Not even one sample fits" in text, text
    told = [r.getMessage() for r in caplog.records if r.name == "memguard"]
    assert not any("pinned host memory" in m for m in told), told
    assert all(p.grad is None for p in model.parameters())  # nothing left of the passes


def test_offload_with_recompute_keeps_the_plain_gradients():
    """The rung's two contexts nested as a pass enters them (saved tensors to the host
    outermost, the blocks checkpointed inside), run directly on the CPU where the copies
    are plain: the gradients are plain torch's, and the blocks' forwards come back."""
    torch = pytest.importorskip("torch")
    from memguard.backends.steps import torch_offload, torch_recompute

    torch.manual_seed(0)
    model = _stack(torch, 4, 16)
    x, y = torch.randn(3, 32, 16), torch.randn(3, 32, 1)

    def grads():
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    with torch_offload.offloading("cuda"), torch_recompute.recomputing(model) as what:
        both = grads()
    assert what == "5 blocks checkpointed"  # the head too
    assert all("forward" not in vars(b) for b in list(model)[:4])
    assert all(torch.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(plain, both,
                                                                       strict=True))
    assert torch_offload.device_type(model) is None  # the CPU: the rung never runs here

    # a saved tensor is a copy in host memory inside, the tensor itself once out (an error
    # leaves no hook behind either)
    def copied(a):
        return (a * a).grad_fn._saved_self.data_ptr() != a.data_ptr()

    a = torch.randn(4, requires_grad=True)
    inside = []

    def interrupted():
        with torch_offload.offloading("cuda"):
            inside.append(copied(a))
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        interrupted()
    assert inside == [True] and not copied(a)


def _capped_rung(recompute: bool, offload: bool) -> dict:
    """On CUDA: one sample of 16,384 positions through a 32-block residual stack (width
    256): about 1.6 GiB saved for backward in a plain pass, about 530 MiB with every block
    recomputed (each checkpoint keeps its 16 MiB input), about 150 MiB with those inputs in
    pinned host memory too, under a cap of 340 MiB over the model, its data and cuBLAS's
    workspace (``torch.cuda.set_per_process_memory_fraction``). The reference is the same
    step, plain and uncapped. Returns the history and the gradients' relative difference."""
    import torch

    import memguard

    torch.manual_seed(0)
    model = _stack(torch, 32, 256).cuda()
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, 16384, 256, device="cuda", generator=g)
    y = torch.randn(1, 16384, 1, device="cuda", generator=g)

    def loss_of(batch):
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    loss_of((x, y)).backward()  # the reference, uncapped (cuBLAS's workspace made too)
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    memguard.free_memory()
    total = torch.cuda.get_device_properties(0).total_memory
    base = torch.cuda.memory_reserved()
    torch.cuda.set_per_process_memory_fraction((base + 340 * 2**20) / total)
    try:
        step = memguard.auto_microbatch(model, recompute=recompute, offload=offload)(loss_of)
        try:
            step((x, y))
            error = None
        except memguard.OutOfMemoryError as exc:
            error = str(exc)
        grads = [p.grad for p in model.parameters()]
        worst = None if error else max(
            ((a - b).norm() / b.norm()).item() for a, b in zip(grads, reference, strict=True))
        return {"history": [[a.size, a.ok, a.recompute, a.offload] for a in step.history],
                "error": error, "relative": worst}
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        memguard.free_memory()


@pytest.mark.gpu
@pytest.mark.parametrize("recompute", [True, False])
def test_offload_runs_after_recompute_on_cuda_with_plain_gradients(recompute):
    """Under the cap the plain pass and the recomputed one run out; the offloaded pass (with
    recompute where it is on) fits, and its gradients are the uncapped step's."""
    out = _capped_rung(recompute, offload=True)
    below = [[1, False, True, False]] if recompute else []
    assert out["history"] == [[1, False, False, False], *below,
                              [1, True, recompute, True]], out
    assert out["relative"] < 1e-5, out


@pytest.mark.gpu
def test_offload_off_ends_the_ladder_at_recompute_on_cuda():
    out = _capped_rung(recompute=True, offload=False)
    assert out["history"] == [[1, False, False, False], [1, False, True, False]], out
    assert out["error"] and "Not even one sample fits" in out["error"], out
