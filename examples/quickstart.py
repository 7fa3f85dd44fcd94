"""memguard in one minute: measure a block, clean up after every step, serve inference.

Runs on a CPU in a few seconds: ``python examples/quickstart.py``.
"""

import gc
import logging

import torch

import memguard

logging.basicConfig(level=logging.WARNING, format="%(message)s")
gc.disable()  # let memguard, not Python's collector, clean up the cycles below

model = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
history = []

print("1. memory_scope measures a block and frees what it left in a reference cycle")
with memguard.memory_scope("load") as scope:
    batch = torch.randn(50_000, 512)  # 100 MB
    holder = [batch]
    holder.append(holder)  # a cycle: only a garbage collection can free it
    del batch, holder
print("  ", scope)

print("2. @frees_memory keeps a leaky training step flat: 20 steps without it, then with it")


def train_step(x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    record = {"loss": loss, "inputs": x}
    record["self"] = record  # the kind of cycle that makes steps creep upward
    history.append(loss.item())


def growth_over_20_steps(step):
    """What 20 calls of ``step`` left in use on the host (glibc's in-use bytes)."""
    before = memguard.snapshot("host")
    for _ in range(20):
        step(torch.randn(4096, 512), torch.randint(0, 10, (4096,)))
    return (memguard.snapshot("host") - before)["host"].allocated


plain = growth_over_20_steps(train_step)
memguard.free_memory()  # start the guarded run from the same place
guarded = growth_over_20_steps(memguard.frees_memory(train_step))
print(f"   without @frees_memory: +{memguard.format_bytes(plain)} in use after 20 steps")
print(f"   with @frees_memory:    +{memguard.format_bytes(guarded)} in use after 20 steps")

print("3. inference_mode: no autograd, eval mode, restored afterwards")
model.train()
with memguard.inference_mode(model):
    logits = model(torch.randn(8, 512))
print(f"   requires_grad={logits.requires_grad}, model.training after={model.training}")

print("4. a snapshot of every device this process uses")
print(memguard.snapshot())
