"""Image codecs by name: what a DALL-E config's `image_codec` field means.

Both codecs follow one contract: `encode(images) -> LongTensor[B, h, w]`,
`decode(codes) -> images in [0, 1]`, `codebook_size`, `grid_size`, `image_size`.
"""

from __future__ import annotations


def load_image_codec(image_codec: str = "palette", vqgan_config: str | None = None,
                     vqgan_checkpoint: str | None = None):
    """Build the codec a recipe's config names.

    Args:
        image_codec: "palette" (the embedded shapes data, exact and weightless) or "vqgan" (taming-compatible).
        vqgan_config: with "vqgan": a taming YAML config path, or "hf://OWNER/REPO/FILE.yaml" on the Hub.
        vqgan_checkpoint: with "vqgan": a taming `.ckpt` / `.safetensors` path, or "hf://OWNER/REPO/FILE".
    """
    if image_codec == "palette":
        from recipes.shapes import PaletteCodec

        return PaletteCodec()
    if image_codec == "vqgan":
        if not vqgan_config or not vqgan_checkpoint:
            raise ValueError("image_codec 'vqgan' needs vqgan_config (taming YAML) and vqgan_checkpoint (.ckpt or "
                             ".safetensors), local paths or hf://OWNER/REPO/FILE")
        from recipes.dalle.vqgan import VQGAN

        return VQGAN.from_taming(_resolve(vqgan_config), _resolve(vqgan_checkpoint))
    raise ValueError(f"unknown image_codec {image_codec!r}: use 'palette' or 'vqgan'")


def _resolve(path: str) -> str:
    """A local path as is; hf://OWNER/REPO/FILE downloaded (and cached) with huggingface_hub."""
    if not path.startswith("hf://"):
        return path
    from huggingface_hub import hf_hub_download

    owner, repo, filename = path[len("hf://"):].split("/", 2)
    return hf_hub_download(f"{owner}/{repo}", filename)
