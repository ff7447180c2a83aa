"""Saving kept candidates: a PNG grid per prompt (best first, row-major) and a JSON of their scores."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from PIL import Image
from torchvision.utils import make_grid


def prompt_slug(prompt: str, index: int, max_len: int = 60) -> str:
    """A file-name-safe stem for a prompt: its index then its words, e.g. "00_a-big-red-circle"."""
    words = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:max_len].rstrip("-")
    return f"{index:02d}_{words or 'prompt'}"


def save_grid(images: torch.Tensor, path: str | Path, columns: int | None = None, padding: int = 2) -> Path:
    """Write images [K, 3, H, W] in [0, 1] as one PNG grid, row-major in the given order.

    Args:
        images: the kept images, best first.
        path: output .png path (parent directories are created).
        columns: images per row; default ceil(sqrt(K)).
        padding: pixels of white between images.
    """
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images [K, 3, H, W], got {tuple(images.shape)}")
    columns = columns or math.ceil(math.sqrt(images.shape[0]))
    grid = make_grid(images.float().clamp(0, 1).cpu(), nrow=columns, padding=padding, pad_value=1.0)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = (grid * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    Image.fromarray(pixels).save(path)
    return path


def save_results(results: list[dict], path: str | Path) -> Path:
    """Write the per-prompt results (prompt, grid file, kept images with CLIP scores) as indented JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path
