"""auto_microbatch under DistributedDataParallel: three gloo ranks, one of them runs out of
memory for real (a soft RLIMIT_AS budget), in backward in one phase and in forward in another.

Plain DDP hangs there: the other ranks wait in the gradient all-reduce that the failed rank
never reaches. Every run has a deadline, so a hang fails the test instead of the suite.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from budget import free_port, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ranks")]  # ranks run alone (-n 2)

MODEL = """
import torch
import torch.nn.functional as F
UNIT = 8 * 2**20 // 4  # 8 MiB per sample, allocated by the hungry pass on the hungry rank

class Hungry(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, where):
        ctx.where = where
        if where == "forward":
            scratch = torch.ones(x.shape[0] * UNIT)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.where == "backward":
            scratch = torch.ones(grad.shape[0] * UNIT)
        return grad, None

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(16, 32)
        self.second = torch.nn.Linear(32, 1)
        self.where = None

    def forward(self, x):
        return self.second(torch.relu(Hungry.apply(self.first(x), self.where)))

def make_model():
    torch.manual_seed(0)
    return Net()

def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)

# (phase, hungry rank, where) for each step
PLAN = [("A", 1, "backward")] * 3 + [("B", 2, "forward")] * 2
"""

WORKER = MODEL + """
import torch.distributed as dist
import memguard
from torch.nn.parallel import DistributedDataParallel as DDP
torch.set_num_threads(1)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
net = make_model()
model = DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

@memguard.auto_microbatch(model)
def loss_of(b):
    return F.mse_loss(model(b[0]), b[1])

# warm up gloo's buffers and threads and memguard's agreement, without changing the weights
with model.no_sync():
    F.mse_loss(model(batch(99, rank)[0][:2]), batch(99, rank)[1][:2]).backward()
opt.zero_grad()
memguard.oom_retry(batch_size=1)(lambda batch_size: batch_size)()
memguard.free_memory()
set_budget(300)  # 64 samples x 8 MiB do not fit; 32 do

sizes, losses = [], []
for step, (phase, hungry, where) in enumerate(PLAN):
    net.where = where if rank == hungry else None
    losses.append(loss_of(batch(step, rank)).item())
    sizes.append([a.size for a in loss_of.history])
    opt.step()
    opt.zero_grad()
net.where = None

# a failure that is not an out-of-memory, on rank 0: raised there, a clear error elsewhere
@memguard.auto_microbatch(model)
def broken(b):
    if rank == 0:
        raise ValueError("rank 0 has bad data")
    return F.mse_loss(model(b[0]), b[1])

try:
    broken(batch(50, rank))
    outcome = "returned"
except ValueError as exc:
    outcome = "ValueError: " + str(exc)
except memguard.MemguardError as exc:
    outcome = type(exc).__name__ + ": " + str(exc)
grads_after_failure = [p.grad is None for p in model.parameters()]
lift_budget()
weights = [p.detach().tolist() for p in net.parameters()]
dist.destroy_process_group()
finish({"rank": rank, "sizes": sizes, "losses": losses, "weights": weights,
       "broken": outcome, "grads_none": grads_after_failure})
"""


def reference() -> tuple[list, list]:
    """Single-process training on the three ranks' batches concatenated."""
    namespace: dict = {}
    exec(MODEL, namespace)
    model = namespace["make_model"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(len(namespace["PLAN"])):
        parts = [namespace["batch"](step, rank) for rank in range(3)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        loss = F.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()], losses


def test_oom_on_one_rank_in_backward_or_forward_hangs_no_one_and_weights_stay_exact():
    outputs = run_ranks(WORKER)
    # the hungry rank split its batch; the others ran whole batches; later steps reuse the size
    assert outputs[1]["sizes"][:3] == [[64, 32], [32], [32]], outputs[1]["sizes"]
    assert outputs[2]["sizes"][3:] == [[64, 32], [32]], outputs[2]["sizes"]
    assert outputs[0]["sizes"] == [[64]] * 5
    assert outputs[1]["sizes"][3:] == [[32], [32]] and outputs[2]["sizes"][:3] == [[64]] * 3
    # every rank ends with the same weights, equal to single-process training
    expected, expected_losses = reference()
    for out in outputs:
        assert out["weights"] == outputs[0]["weights"]
        for got, want in zip(out["weights"], expected, strict=True):
            assert (torch.tensor(got) - want).abs().max().item() < 1e-5
    per_step = [sum(out["losses"][s] for out in outputs) / 3 for s in range(5)]
    assert max(abs(a - b) for a, b in zip(per_step, expected_losses, strict=True)) < 1e-5
    # a non-OOM error on one rank: raised there, a clear error on the others, no hang
    assert outputs[0]["broken"] == "ValueError: rank 0 has bad data"
    for rank in (1, 2):
        assert outputs[rank]["broken"].startswith("MemguardError: broken: another rank failed")
    assert all(all(out["grads_none"]) for out in outputs)  # entry gradients (none) restored


def test_an_fsdp2_model_on_one_rank_trains_without_a_warning(python_in_subprocess):
    out = python_in_subprocess(f"""
        import json, logging, os
        import torch, torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        import memguard
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{free_port()}")
        dist.init_process_group("gloo", rank=0, world_size=1)
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("memguard").addHandler(handler)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        fully_shard(model)
        step = memguard.auto_microbatch(model)(lambda b: model(b).sum())
        loss = step(torch.ones(8, 4))
        dist.destroy_process_group()
        print(json.dumps({{"warnings": [r.getMessage() for r in records],
                          "loss": loss.shape == ()}}))
    """)
    assert out["loss"] and out["warnings"] == []


def test_a_ddp_communication_hook_is_refused_by_name(python_in_subprocess):
    # auto_microbatch averages a DDP model's gradients itself, once per step: a hook
    # registered with register_comm_hook (fp16 compression, PowerSGD) would be skipped
    out = python_in_subprocess(f"""
        import json, os
        import torch, torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        import memguard
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{free_port()}")
        dist.init_process_group("gloo", rank=0, world_size=1)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
        plain = memguard.auto_microbatch(model)(lambda b: model(b).sum())
        plain(torch.ones(8, 4))  # no hook: trains
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        step = memguard.auto_microbatch(model)(lambda b: model(b).sum())
        try:
            step(torch.ones(8, 4))
            error = None
        except NotImplementedError as err:
            error = str(err)
        dist.destroy_process_group()
        print(json.dumps({{"error": error}}))
    """)
    assert out["error"] and "communication hook registered (fp16_compress_hook)" in out["error"]


def test_a_builtin_comm_hook_and_a_static_graph_are_refused_by_name(python_in_subprocess):
    # a built-in C++ hook leaves no Python hook to see, and DDP's static graph asserts inside
    # torch (then aborts at an out-of-memory) once its reduction is held back: both refused
    # at the first call, by name, before any pass runs
    out = python_in_subprocess(f"""
        import json, os
        import torch, torch.distributed as dist
        import memguard
        from torch.nn.parallel import DistributedDataParallel as DDP
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{free_port()}")
        dist.init_process_group("gloo", rank=0, world_size=1)
        errors = {{}}
        for name in ("builtin", "static"):
            model = DDP(torch.nn.Linear(4, 1), static_graph=name == "static")
            if name == "builtin":
                model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
            step = memguard.auto_microbatch(model)(lambda b: model(b).sum())
            try:
                step(torch.ones(8, 4))
                errors[name] = None
            except NotImplementedError as err:
                errors[name] = str(err)
            errors[name + "_grad"] = model.module.weight.grad is None
        dist.destroy_process_group()
        print(json.dumps(errors))
    """)
    assert "communication hook registered (BuiltinCommHookType.FP16_COMPRESS)" in \
        out["builtin"], out
    assert "static_graph=True" in out["static"] and "static_graph=False" in out["static"], out
    assert out["builtin_grad"] and out["static_grad"]  # refused before any backward


AVERAGING_MODEL = """
import torch

def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(16)))

def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 256, generator=g), torch.randn(8, 256, generator=g)
"""

AVERAGING = AVERAGING_MODEL + """
import ctypes, logging, resource
# M_MMAP_THRESHOLD fixed at 1 MiB: the 4 MiB bucket is always a new mapping, never a free heap
# chunk that needs no address space (which chunks are free depends on what ran before, MKL's
# own cache among it: MKL_DISABLE_FAST_MM, set under pytest, left one that fitted it)
ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)
import torch.distributed as dist
import torch.nn.functional as F
import memguard
from torch.nn.parallel import DistributedDataParallel as DDP
torch.set_num_threads(1)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
HOG, EAT = [], [False]

def eat(grad):
    # on the first layer's weight, the last gradient backward computes: takes the address
    # space left but 2 MiB, so that the 4 MiB bucket that averages the gradients cannot be
    # allocated after backward
    if EAT[0]:
        left = resource.getrlimit(resource.RLIMIT_AS)[0] - vm_size()
        HOG.append(torch.ones((left - (2 << 20)) // 4))

net = make_model()
net[0].weight.register_hook(eat)
model = DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
records = []
handler = logging.Handler()
handler.emit = records.append
logging.getLogger("memguard").addHandler(handler)

@memguard.auto_microbatch(model)
def loss_of(b):
    return F.mse_loss(model(b[0]), b[1])

for step in range(3):
    EAT[0] = rank == 1 and step == 1
    if EAT[0]:
        memguard.free_memory()
        set_budget(64)
    loss_of(batch(step, rank))
    HOG.clear()
    lift_budget()
    opt.step()
    opt.zero_grad()
weights = [p.detach().tolist() for p in net.parameters()]
dist.destroy_process_group()
finish({"rank": rank, "weights": weights,
        "warnings": [r.getMessage() for r in records if r.levelname == "WARNING"]})
"""


def test_an_oom_allocating_the_averaging_buckets_falls_back_to_in_place_on_every_rank():
    # the bucket that averages the gradients is allocated after backward, every step: an
    # out-of-memory there on one rank is agreed on before any collective, and every rank
    # reduces each gradient in place instead (nothing allocated), weights still exact
    outputs = run_ranks(AVERAGING, world=2, timeout=60)
    assert outputs[0]["weights"] == outputs[1]["weights"]
    namespace: dict = {}
    exec(AVERAGING_MODEL, namespace)
    model = namespace["make_model"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        parts = [namespace["batch"](step, rank) for rank in range(2)]
        F.mse_loss(model(torch.cat([p[0] for p in parts])),
                   torch.cat([p[1] for p in parts])).backward()
        opt.step()
        opt.zero_grad()
    for got, want in zip(outputs[0]["weights"], model.parameters(), strict=True):
        assert (torch.tensor(got) - want.detach()).abs().max().item() < 1e-5
    for out in outputs:  # every rank took the in-place path and says so
        assert any("averaged each gradient in place" in w for w in out["warnings"]), out
