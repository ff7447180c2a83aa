"""The DALL-E recipe: ``class_path: recipes.dalle.DALLEModule`` and ``recipes.dalle.DALLEDataModule`` in YAML."""

from lightning_swarm.exports import lazy_exports

_EXPORTS = {
    "DALLEModule": "recipes.dalle.module",
    "DALLEDataModule": "recipes.dalle.data",
    "SampleGrid": "recipes.dalle.sample_grid",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
