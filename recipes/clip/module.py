"""CLIPModule: a small open_clip CLIP trained contrastively on the embedded shapes data.

The model is a plain `open_clip.CLIP` built from a config dict (the same dict open_clip keeps in its
model-config JSONs), so the trained weights export as an open_clip "local-dir" checkpoint:
`open_clip_config.json` ({"model_cfg", "preprocess_cfg"}) + `open_clip_model.safetensors`, which
`open_clip.create_model_and_transforms("local-dir:DIR")` and `inference.rerank.CLIPReranker.load(DIR)`
read back without unpickling anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import open_clip
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_only
from safetensors.torch import save_file

TINY_CLIP_CONFIG = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 128, "layers": 2, "width": 128, "patch_size": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 128, "heads": 4, "layers": 2},
}


def contrastive_loss(image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """Symmetric CLIP loss where image i matches text i; texts beyond the B images are extra negatives
    for the image->text direction only (with no extra texts this is exactly open_clip's ClipLoss).

    Args:
        image_features: [B, D] L2-normalised image embeddings.
        text_features: [B + M, D] L2-normalised text embeddings; rows B.. are hard negatives.
        logit_scale: the (exponentiated) temperature multiplier.
    """
    num_images = image_features.shape[0]
    logits_per_image = logit_scale * image_features @ text_features.T  # [B, B + M]
    logits_per_text = logits_per_image[:, :num_images].T  # [B, B]
    labels = torch.arange(num_images, device=image_features.device)
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


class CLIPModule(L.LightningModule):
    """Contrastive training of an open_clip CLIP on {"image", "text", "negative_text"} batches.

    Args:
        model_cfg: open_clip model config (embed_dim, vision_cfg, text_cfg), e.g. TINY_CLIP_CONFIG.
        lr: AdamW peak learning rate.
        weight_decay: AdamW weight decay (not applied to gains, biases and the logit scale).
        warmup_steps: linear warmup steps, then cosine decay to 10% over `total_steps`.
        total_steps: length of the cosine schedule in optimizer steps (set it to trainer.max_steps).
        hard_negatives: also contrast each image against its one-detail-changed caption.
        export_dir: directory the trained model is exported to (open_clip local-dir format) when training
            ends; None disables the export.
        mean, std: image normalisation used by the data, recorded in the exported preprocess config.
    """

    def __init__(self, model_cfg: dict | None = None, lr: float = 1e-3, weight_decay: float = 0.1,
                 warmup_steps: int = 50, total_steps: int = 1000, hard_negatives: bool = True,
                 export_dir: str | None = "checkpoints/clip_tiny",
                 mean: tuple[float, float, float] = open_clip.OPENAI_DATASET_MEAN,
                 std: tuple[float, float, float] = open_clip.OPENAI_DATASET_STD):
        super().__init__()
        self.save_hyperparameters()
        self.model_cfg = dict(model_cfg or TINY_CLIP_CONFIG)
        self.model = open_clip.CLIP(**self.model_cfg)

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """L2-normalised (image_features [B, D], text_features [M, D])."""
        return self.model.encode_image(images, normalize=True), self.model.encode_text(texts, normalize=True)

    def _step(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, fraction of images that score their caption above its one-detail-changed caption)."""
        num_images = batch["image"].shape[0]
        image_features, text_features = self(batch["image"], torch.cat([batch["text"], batch["negative_text"]]))
        used_texts = text_features if self.hparams.hard_negatives else text_features[:num_images]
        loss = contrastive_loss(image_features, used_texts, self.model.logit_scale.exp().clamp(max=100))
        positive = (image_features * text_features[:num_images]).sum(-1)
        negative = (image_features * text_features[num_images:]).sum(-1)
        return loss, (positive > negative).float().mean()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, hard_accuracy = self._step(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/hard_negative_acc", hard_accuracy, prog_bar=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss, hard_accuracy = self._step(batch)
        image_features, text_features = self(batch["image"], batch["text"])
        retrieval = (image_features @ text_features.T).argmax(-1) == torch.arange(len(image_features), device=self.device)
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/hard_negative_acc", hard_accuracy, prog_bar=True)
        self.log("val/image_to_text_acc", retrieval.float().mean())

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, param in self.model.named_parameters():
            (no_decay if param.ndim < 2 or "logit_scale" in name else decay).append(param)
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": self.hparams.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=self.hparams.lr)
        warmup, total = self.hparams.warmup_steps, max(self.hparams.total_steps, self.hparams.warmup_steps + 1)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / (total - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item())

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def export(self, directory: str | Path) -> Path:
        """Write the model as an open_clip local-dir checkpoint (config JSON + safetensors weights)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        preprocess_cfg = {"size": self.model_cfg["vision_cfg"]["image_size"], "mean": list(self.hparams.mean),
                          "std": list(self.hparams.std), "interpolation": "bicubic", "resize_mode": "shortest"}
        config = {"model_cfg": self.model_cfg, "preprocess_cfg": preprocess_cfg}
        (directory / "open_clip_config.json").write_text(json.dumps(config, indent=2) + "\n")
        state = {k: v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()}
        save_file(state, directory / "open_clip_model.safetensors")
        return directory

    @rank_zero_only
    def on_train_end(self) -> None:
        if self.hparams.export_dir:
            path = self.export(self.hparams.export_dir)
            print(f"Exported the CLIP reranker to {path} (use it with inference.generate --clip-model {path})")
