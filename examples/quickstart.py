"""memguard in one minute: measure a block, clean up after every step, serve inference.

Runs on a CPU in a few seconds: ``python examples/quickstart.py``.
"""

import gc
import logging

import torch

import memguard

logging.basicConfig(level=logging.WARNING, format="%(message)s")
gc.disable()  # let memguard, not Python's collector, clean up the cycles below

model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
history = []

print("1. memory_scope measures a block and frees what it left in a reference cycle")
with memguard.memory_scope("load") as scope:
    batch = torch.randn(50_000, 512)  # 100 MB
    holder = [batch]
    holder.append(holder)  # a cycle: only a garbage collection can free it
    del batch, holder
print("  ", scope)

print("2. @frees_memory keeps a leaky training step flat")


@memguard.frees_memory
def train_step(x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    record = {"loss": loss, "inputs": x}
    record["self"] = record  # the kind of cycle that makes steps creep upward
    history.append(loss.item())


before = memguard.snapshot("host")
for _ in range(20):
    train_step(torch.randn(4096, 512), torch.randint(0, 10, (4096,)))
growth = (memguard.snapshot("host") - before)["host"].reserved
print(f"   20 steps, resident memory grew by {memguard.format_bytes(growth)}")

print("3. inference_mode: no autograd, eval mode, restored afterwards")
model.train()
with memguard.inference_mode(model):
    logits = model(torch.randn(8, 512))
print(f"   requires_grad={logits.requires_grad}, model.training after={model.training}")

print("4. a snapshot of every device this process uses")
print(memguard.snapshot())
