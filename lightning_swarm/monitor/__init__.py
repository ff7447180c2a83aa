"""The swarm's auxiliary peer (``python -m lightning_swarm.monitor --config ...``): stable bootstrap address,
swarm-wide metrics and contribution table, periodic checkpoints, and reverting the swarm to a checkpoint.

- :mod:`.aggregate`: metrics records -> swarm figures and the per-peer contribution table (no DHT needed)
- :mod:`.config`: build the LightningModule and read the swarm settings from the trainers' YAML
- :mod:`.peer`: :class:`MonitorPeer`, the DHT node + never-stepping hivemind.Optimizer (state download/revert)
- :mod:`.runner`: :class:`Monitor`, the refresh loop (logging, checkpoints)
- ``__main__``: the command line
"""

from lightning_swarm.monitor.aggregate import ContributionTable, SwarmSnapshot, aggregate

__all__ = ["ContributionTable", "SwarmSnapshot", "aggregate"]
