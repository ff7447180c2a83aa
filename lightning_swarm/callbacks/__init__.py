"""The Lightning callbacks a user names in YAML, e.g. ``class_path: lightning_swarm.callbacks.SwarmCheckpoint``.

Imported on first use (they pull in lightning and hivemind).
"""

from lightning_swarm.exports import lazy_exports

_EXPORTS = {
    "SwarmCheckpoint": "lightning_swarm.checkpoint.callback",
    "SwarmProgress": "lightning_swarm.callbacks.progress",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
