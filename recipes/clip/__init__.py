"""The tiny CLIP reranker recipe: ``class_path: recipes.clip.CLIPModule`` and ``recipes.clip.ShapesCLIPDataModule``."""

from lightning_swarm.exports import lazy_exports

_EXPORTS = {"CLIPModule": "recipes.clip.module", "ShapesCLIPDataModule": "recipes.clip.data"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
