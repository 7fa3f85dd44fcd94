"""Survive an out-of-memory in a Lightning fit: the step redoes its batch in slices."""
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import memguard
from memguard.integrations.lightning import MemguardCallback


class Wide(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 4096), torch.nn.ReLU(),
                                       torch.nn.Linear(4096, 1))

    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


data = TensorDataset(torch.randn(65536, 32), torch.randn(65536, 1))
callback = MemguardCallback(microbatch=True)                  # the one added argument
trainer = pl.Trainer(max_epochs=1, callbacks=[callback], logger=False, enable_model_summary=False,
                     enable_checkpointing=False, enable_progress_bar=False)
with memguard.memory_limit("360MiB", device="host"):         # rehearse a smaller device
    trainer.fit(Wide(), DataLoader(data, batch_size=16384))
print(f"{trainer.global_step} steps of 16384, in slices of {callback.microbatch_size}")
