"""A tiny LightningModule + data for the checkpoint and monitor tests (also imported by their worker scripts).

It has a tied weight (like DALL-E's tied embeddings) and an Adam + StepLR pair, so the checkpoint format is
exercised on shared tensors, optimizer statistics and scheduler state.
"""

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset


class TinyRegressor(pl.LightningModule):
    """Predicts a fixed random linear map of its input; ``head.weight`` is tied to ``embed.weight``."""

    def __init__(self, dim: int = 8, hidden: int = 16, lr: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.embed = torch.nn.Linear(dim, hidden, bias=False)
        self.mid = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(dim, hidden, bias=False)
        self.head.weight = self.embed.weight  # tied: the state_dict holds two names for one tensor
        self.tie = torch.nn.Parameter(torch.ones(hidden))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = torch.tanh(self.embed(x)) * self.tie
        return torch.nn.functional.linear(self.mid(h), self.head.weight.t())

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.calls += 1
        self.log("train/loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr, betas=(0.9, 0.99))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return [opt], [{"scheduler": sched, "interval": "step"}]


class RandomRegression(IterableDataset):
    """Endless (x, A x) pairs with a fixed A; each iterator draws from its own seed."""

    def __init__(self, dim: int = 8, seed: int = 0):
        self.dim, self.seed = dim, seed
        self.matrix = torch.randn(dim, dim, generator=torch.Generator().manual_seed(1234))

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed)
        while True:
            x = torch.randn(self.dim, generator=gen)
            yield x, self.matrix @ x


class RandomRegressionData(pl.LightningDataModule):
    def __init__(self, dim: int = 8, batch_size: int = 4, seed: int = 0):
        super().__init__()
        self.dim, self.batch_size, self.seed = dim, batch_size, seed

    def train_dataloader(self):
        return DataLoader(RandomRegression(self.dim, self.seed), batch_size=self.batch_size)
