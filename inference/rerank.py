"""CLIP reranking: load an open_clip model (a named architecture with a pretrained tag, or a local
checkpoint such as the one `python -m recipes.clip fit` exports) and score images against a caption.

    reranker = CLIPReranker.load("ViT-B-32", pretrained="openai")        # real use (downloads weights)
    reranker = CLIPReranker.load("checkpoints/clip_tiny")                # offline: the tiny CLIP recipe
    scores = reranker.score(images, "a big red circle")                  # FloatTensor [B]
    order = rerank(scores, keep=4)                                       # best first
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import open_clip
import torch
import torch.nn.functional as F

LOCAL_CONFIG_NAME = "open_clip_config.json"


def resolve_clip_name(model: str, pretrained: str | None = None) -> tuple[str, str | None]:
    """Turn a user's `--clip-model`/`--clip-pretrained` pair into what `open_clip.create_model_and_transforms`
    takes, validating it first so mistakes fail fast with a clear message (and without downloading).

    Args:
        model: an open_clip architecture name (see `open_clip.list_models()`, e.g. "ViT-B-32"), an
            "hf-hub:org/repo" or "local-dir:/path" identifier, or a local directory holding
            `open_clip_config.json` and weights (the format `recipes.clip` exports).
        pretrained: for an architecture name: a pretrained tag known to open_clip (see
            `open_clip.list_pretrained()`, e.g. "openai") or a path to a weights file; None builds the
            architecture with random weights. Must be None for local directories and hub identifiers.
    Returns:
        (model_name, pretrained) ready for open_clip.
    """
    if model.startswith(("hf-hub:", "local-dir:")):
        if pretrained is not None:
            raise ValueError(f"--clip-pretrained must be empty for {model!r} (its weights come with it)")
        return model, None
    path = Path(model)
    if path.is_dir():
        if not (path / LOCAL_CONFIG_NAME).is_file():
            raise ValueError(f"{path} has no {LOCAL_CONFIG_NAME}; a local CLIP must be a directory exported by "
                             f"`python -m recipes.clip fit` (or any open_clip local-dir checkpoint)")
        if pretrained is not None:
            raise ValueError(f"--clip-pretrained must be empty for the local CLIP directory {path}")
        return f"local-dir:{path}", None
    if model not in open_clip.list_models():
        hint = ""
        if path.suffix or "/" in model:
            hint = (" It looks like a path but does not exist; train the tiny CLIP with "
                    "`python -m recipes.clip fit --config configs/clip_tiny.yaml` or pass a real model name.")
        raise ValueError(f"unknown CLIP model {model!r}: expected a local CLIP directory or an open_clip "
                         f"architecture such as ViT-B-32 (open_clip.list_models()).{hint}")
    if pretrained is not None and not Path(pretrained).is_file():
        tags = open_clip.list_pretrained_tags_by_model(model)
        if pretrained not in tags:
            raise ValueError(f"{model} has no pretrained tag {pretrained!r}; known tags: {tags} "
                             f"(or pass a path to a weights file)")
    return model, pretrained


def rerank(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of the `keep` highest scores, best first (ties keep the earlier candidate first).

    Args:
        scores: FloatTensor [N] of CLIP scores, one per candidate.
        keep: how many to return (capped at N).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[: min(keep, scores.numel())]


@dataclass
class CLIPReranker:
    """An open_clip model with its tokenizer and image normalisation, scoring [0,1] image tensors."""

    model: torch.nn.Module
    tokenizer: object
    image_size: tuple[int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def load(cls, model: str, pretrained: str | None = None, device: str | torch.device = "cpu") -> "CLIPReranker":
        """Build (and, for named models with a tag, download) a CLIP; see `resolve_clip_name` for the arguments."""
        name, pretrained = resolve_clip_name(model, pretrained)
        try:
            clip, _, _ = open_clip.create_model_and_transforms(name, pretrained=pretrained, device=device)
        except Exception as err:  # hub/network errors come in many types; say what to do about them
            if pretrained is None or Path(pretrained).is_file():
                raise
            raise RuntimeError(
                f"could not load pretrained weights {name}/{pretrained} (no Internet access or not in the "
                f"local Hugging Face cache?). Download them where you have access and pass the weights file as "
                f"--clip-pretrained, or use a local CLIP directory such as the tiny CLIP recipe's export."
            ) from err
        clip.eval()
        cfg = open_clip.get_model_preprocess_cfg(clip)
        size = cfg.get("size", 224)
        size = (size, size) if isinstance(size, int) else tuple(size)
        return cls(clip, open_clip.get_tokenizer(name), size, tuple(cfg["mean"]), tuple(cfg["std"]))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """[B,3,H,W] in [0,1] -> the model's input: resize the short side, centre crop, normalise."""
        height, width = self.image_size
        scale = max(height / images.shape[-2], width / images.shape[-1])
        resized = (round(images.shape[-2] * scale), round(images.shape[-1] * scale))
        if resized != tuple(images.shape[-2:]):
            images = F.interpolate(images.float(), size=resized, mode="bicubic", antialias=True, align_corners=False)
        top, left = (resized[0] - height) // 2, (resized[1] - width) // 2
        images = images[..., top : top + height, left : left + width].clamp(0, 1)
        mean = torch.tensor(self.mean, device=images.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=images.device).view(1, -1, 1, 1)
        return (images - mean) / std

    @torch.no_grad()
    def score(self, images: torch.Tensor, caption: str, batch_size: int = 64) -> torch.Tensor:
        """CLIP score of each image for `caption`: 100 x cosine similarity, FloatTensor [B] on the CPU.

        Args:
            images: FloatTensor [B, 3, H, W] in [0, 1] (any size; resized to the model's).
            caption: the prompt the images were generated for.
            batch_size: images encoded per forward pass.
        """
        return self.score_pairs(images, [caption] * images.shape[0], batch_size)

    @torch.no_grad()
    def score_pairs(self, images: torch.Tensor, captions: list[str], batch_size: int = 64) -> torch.Tensor:
        """CLIP score of image i for captions[i] (each distinct caption is encoded once); FloatTensor [B]."""
        if len(captions) != images.shape[0]:
            raise ValueError(f"got {images.shape[0]} images but {len(captions)} captions")
        distinct = list(dict.fromkeys(captions))
        text_features = self.embed_texts(distinct)
        rows = torch.tensor([distinct.index(c) for c in captions], device=self.device)
        scores = []
        for start in range(0, images.shape[0], batch_size):
            image_features = self.embed_images(images[start : start + batch_size])
            scores.append(100.0 * (image_features * text_features[rows[start : start + batch_size]]).sum(-1))
        return torch.cat(scores).cpu()

    @torch.no_grad()
    def embed_texts(self, captions: list[str]) -> torch.Tensor:
        """L2-normalised float32 caption features [len(captions), D] on the model's device."""
        return F.normalize(self.model.encode_text(self.tokenizer(captions).to(self.device)).float(), dim=-1)

    @torch.no_grad()
    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        """L2-normalised float32 features [B, D] of images [B, 3, H, W] in [0, 1] (preprocessed here)."""
        return F.normalize(self.model.encode_image(self.preprocess(images.to(self.device))).float(), dim=-1)
