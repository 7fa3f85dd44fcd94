"""Survive an out-of-memory in a training loop of your own: the step redoes its batch in slices."""
import torch

import memguard

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


@memguard.auto_microbatch(model)                      # the one added line
def loss_of(batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


with memguard.memory_limit("360MiB", device="host"):  # rehearse a smaller device
    for _ in range(4):
        batch = torch.randn(16384, 32), torch.randn(16384, 1)
        optimizer.zero_grad()
        loss_of(batch)                                # forward and backward, in slices if need be
        optimizer.step()
print(f"4 steps of 16384, in slices of {loss_of.microbatch_size}")
