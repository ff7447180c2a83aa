"""The Lightning callbacks a user names in YAML, e.g. ``class_path: lightning_swarm.callbacks.SwarmCheckpoint``.

Imported on first use (they pull in lightning and hivemind).
"""

__all__ = ["SwarmCheckpoint", "SwarmProgress"]


def __getattr__(name):
    if name == "SwarmCheckpoint":
        from lightning_swarm.checkpoint.callback import SwarmCheckpoint

        return SwarmCheckpoint
    if name == "SwarmProgress":
        from lightning_swarm.callbacks.progress import SwarmProgress

        return SwarmProgress
    raise AttributeError(f"module 'lightning_swarm.callbacks' has no attribute {name!r}")
