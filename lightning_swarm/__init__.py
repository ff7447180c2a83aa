"""lightning_swarm: collaborative training over the Internet for PyTorch Lightning, built on hivemind.

The names users write in YAML have short paths: ``lightning_swarm.HivemindStrategy``,
``lightning_swarm.callbacks.SwarmCheckpoint``, ``lightning_swarm.optim.LAMB8bit``. Heavy imports (hivemind,
lightning) happen on first use of an exported name.
"""

from lightning_swarm.exports import lazy_exports
from lightning_swarm.platforms import warn_about_platform

warn_about_platform()  # Windows: one line pointing to WSL2; macOS: one line, partially supported (platforms.py)

_EXPORTS = {
    "HivemindStrategy": "lightning_swarm.strategy",
    "SwarmCheckpoint": "lightning_swarm.checkpoint.callback",
    "SwarmProgress": "lightning_swarm.callbacks.progress",
    "LAMB8bit": "lightning_swarm.optim",
    "default_compression": "lightning_swarm.compression",
    "load_checkpoint": "lightning_swarm.checkpoint.checkpoint_io",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
