"""Training memory calculator: GPU and CPU bytes per stage of a training step.

``python -m lightning_swarm.memory MODEL`` (or ``lightning-swarm-memory MODEL``) prints, for a published
model, a bare parameter count or a LightningCLI config, the bytes of weights, gradients, optimizer state
and activations, and the totals of the backward pass and the optimizer step, on the GPU and the CPU.
The formulas live in :mod:`lightning_swarm.memory.estimate` (their inputs in
:mod:`lightning_swarm.memory.inputs`); the model sources in
:mod:`lightning_swarm.memory.models`; the command line in :mod:`lightning_swarm.memory.cli`.

A LightningModule describes its shape to the calculator with a ``memory_profile()`` method (on the module
or any submodule) returning a dict of :class:`ModelShape` fields, e.g.::

    def memory_profile(self) -> dict:
        return dict(dim=512, depth=16, heads=8, seq_len=320, logits_per_sample=64 * 49408 + 256 * 1024,
                    attention="sdpa", reversible=True)
"""

from lightning_swarm.memory.cli import main
from lightning_swarm.memory.estimate import DeviceBytes, MemoryEstimate, estimate
from lightning_swarm.memory.inputs import ModelShape, ParameterInventory, TrainingSetup
from lightning_swarm.memory.models import ModelSource, count_module, from_config, named_model, raw_count, resolve

__all__ = [
    "DeviceBytes",
    "MemoryEstimate",
    "ModelShape",
    "ModelSource",
    "ParameterInventory",
    "TrainingSetup",
    "count_module",
    "estimate",
    "from_config",
    "main",
    "named_model",
    "raw_count",
    "resolve",
]
