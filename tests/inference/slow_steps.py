"""A callback for the swarm tests' trainers: sleep after every step, leaving CPU to the other processes."""

import time

import lightning.pytorch as pl


class SlowSteps(pl.Callback):
    """Sleep ``seconds`` after every training batch."""

    def __init__(self, seconds: float = 0.1):
        self.seconds = seconds

    def on_train_batch_end(self, *args, **kwargs):
        time.sleep(self.seconds)
