"""A Lightning fit as a user runs it (no logging set up, default Trainer output)."""

import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from actcfg.integrations.lightning import ActivationPolicy
from actcfg.probes import BlockStack


class Blocks(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = BlockStack(3, d_model=32, heads=4, ffn=64)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.model(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


x = torch.randn(8, 8, 32, generator=torch.Generator().manual_seed(1))
trainer = pl.Trainer(max_steps=2, accelerator="cpu", default_root_dir=sys.argv[1],
                     callbacks=[ActivationPolicy("version: 1\ncheckpoint: {mode: full, modules: [Block]}\n")])
trainer.fit(Blocks(), DataLoader(TensorDataset(x), batch_size=4))
