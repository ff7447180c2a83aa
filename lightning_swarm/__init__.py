"""lightning_swarm: collaborative training over the Internet for PyTorch Lightning, built on hivemind.

Heavy imports (hivemind, lightning) happen on first use of an exported name.
"""

__all__ = ["HivemindStrategy", "SwarmProgress"]


def __getattr__(name):
    if name == "HivemindStrategy":
        from lightning_swarm.strategy import HivemindStrategy

        return HivemindStrategy
    if name == "SwarmProgress":
        from lightning_swarm.callbacks.progress import SwarmProgress

        return SwarmProgress
    raise AttributeError(f"module 'lightning_swarm' has no attribute {name!r}")
