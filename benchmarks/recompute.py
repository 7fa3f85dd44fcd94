"""One sample too long: auto_microbatch's recompute rung against plain torch and static
gradient checkpointing."""

from __future__ import annotations

from benchmarks.common import TRAIN_UNDER_BUDGET, Result, run_python

WORKLOAD = """
import json, resource, time
import torch, memguard
from torch.utils.checkpoint import checkpoint
torch.set_num_threads(1)
MODE, BUDGET, STEPS = "{mode}", {budget}, {steps}

def vm_size():
    return int(open("/proc/self/statm").read().split()[0]) * 4096

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))

torch.manual_seed(0)
model = torch.nn.Sequential(*[Block() for _ in range(12)], torch.nn.Linear(256, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(1)
samples = [(torch.randn(1, 8192, 256, generator=g), torch.randn(1, 8192, 1, generator=g))
           for _ in range(STEPS)]

def loss_of(batch):
    x, y = batch
    if MODE == "static":
        for block in model[:-1]:
            x = checkpoint(block, x, use_reentrant=False)
        return torch.nn.functional.mse_loss(model[-1](x), y)
    return torch.nn.functional.mse_loss(model(x), y)

# warm-up, the same in every mode: a short sample, its gradients dropped
loss_of((samples[0][0][:, :64], samples[0][1][:, :64])).backward()
opt.zero_grad()
memguard.free_memory()
step = memguard.auto_microbatch(model)(loss_of) if MODE == "memguard" else None
batches = samples
""" + TRAIN_UNDER_BUDGET + """
print(json.dumps({{"seconds": seconds, "failed": failed, "history": history,
                  "weights": weights.tolist()}}))
"""

ENV = {"MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"}
BUDGET = 700  # MiB: one sample needs about 968 plain, about 396 with every block checkpointed


def recompute(quick: bool) -> list[Result]:
    """Benchmark 13: one sample too long. 12 residual blocks (Linear 256 -> 1024 -> 256, GELU)
    and a Linear(256, 1) head, MSE, SGD at lr 0.01, on N samples (3; quick: 2) of 8,192
    positions each, one sample per step, under a 700 MiB address-space budget (RLIMIT_AS)
    set after a warm-up on 64 positions. Four fresh processes: the reference (no budget,
    plain), plain torch under the budget (runs out), memguard (``auto_microbatch(model)`` at
    its defaults: the first pass of each step runs out, the recompute rung redoes it) and
    static checkpointing (every block under ``checkpoint(..., use_reentrant=False)`` in every
    step, what a user would write knowing in advance). Reported: whether plain torch failed,
    memguard's wall time against static checkpointing's (memguard pays the failed plain pass
    of every step: it remembers nothing about recompute between batches), and the largest
    relative weight difference from the reference.
    """
    steps = 2 if quick else 3
    runs = {mode: run_python(WORKLOAD.format(mode=mode, budget=BUDGET, steps=steps), env=ENV)
            for mode in ("reference", "plain", "memguard", "static")}
    reference = runs["reference"]["weights"]
    norm = max(abs(w) for w in reference)

    def drift(run: dict) -> float:
        return max(abs(a - b) for a, b in zip(run["weights"], reference, strict=True)) / norm

    plain, mine, static = runs["plain"], runs["memguard"], runs["static"]
    scenario = (plain["failed"] is not None and "memory" in plain["failed"]
                and mine["failed"] is None and static["failed"] is None)
    shape = "" if scenario else "SCENARIO NOT REPRODUCED (budget); "
    note = (f"{shape}plain torch: {'out of memory' if plain['failed'] else 'fit'}; memguard "
            f"attempts per step {mine['history']} (size, ok, slices, recompute); reference "
            f"{runs['reference']['seconds']:.2f} s")
    return [
        Result(f"13 one sample too long: wall time ({steps} steps)", mine["seconds"],
               static["seconds"], "s", "static checkpointing", "report", None, note),
        Result("13 one sample too long: max |W - W_ref| / max |W_ref|", drift(mine),
               drift(static), "rel", "static checkpointing", "<= 1e-5",
               scenario and drift(mine) <= 1e-5),
    ]


BENCHMARKS = [recompute]
