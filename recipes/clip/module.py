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

from lightning_swarm.lr_schedule import check_schedule, warmup_decay_scheduler
from recipes.clip.data import NEGATIVE_KINDS, NUM_LAYOUTS

def contrastive_loss(image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                     same_caption: torch.Tensor | None = None,
                     extra_image_features: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric CLIP loss where image i matches text i; texts beyond the B images are extra negatives
    for the image->text direction only (with no extra texts this is exactly open_clip's ClipLoss).

    Args:
        image_features: [B, D] L2-normalised image embeddings.
        text_features: [B + M, D] L2-normalised text embeddings; rows B.. are hard negatives.
        logit_scale: the (exponentiated) temperature multiplier.
        same_caption: optional BoolTensor [B, B + M], True where text j is the very caption of image i. Those
            pairs (other than the positive i, i) are left out of both directions: the shapes grammar has few
            captions, so a batch often holds one caption twice, and neither copy is a negative of the other.
        extra_image_features: optional [E, D] L2-normalised embeddings of pictures that show none of the
            B captions: extra negatives for the text->image direction only.
    """
    num_images = image_features.shape[0]
    logits_per_image = logit_scale * image_features @ text_features.T  # [B, B + M]
    if same_caption is not None:
        duplicate = same_caption.clone()
        duplicate.fill_diagonal_(False)  # the positives (the diagonal of the first B columns) stay
        logits_per_image = logits_per_image.masked_fill(duplicate, float("-inf"))
    logits_per_text = logits_per_image[:, :num_images].T  # [B, B]
    if extra_image_features is not None:
        extra_logits = logit_scale * text_features[:num_images] @ extra_image_features.T  # [B, E]
        logits_per_text = torch.cat([logits_per_text, extra_logits], 1)
    labels = torch.arange(num_images, device=image_features.device)
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


def same_caption_mask(image_texts: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
    """BoolTensor [B, M]: whether token row `texts[j]` equals `image_texts[i]` (the caption of image i)."""
    return (image_texts[:, None, :] == texts[None, :, :]).all(-1)


class CLIPModule(L.LightningModule):
    """Contrastive training of an open_clip CLIP on the batches of `recipes.clip.data.ShapesCLIPDataModule`:
    {"image", "text"} plus hard negatives {"negative_text" [B, K, L], "negative_kind" [B, K], "negative_image"}
    and, if present, sloppy drawings the caption checker rejects {"perturbed_image" [B, P, 3, H, W]}: extra
    negative pictures for their caption, and the layout of two-shape examples {"layout" [B]}.

    Args:
        model_cfg: open_clip model config (embed_dim, vision_cfg, text_cfg), e.g. configs/clip_tiny.yaml's.
        lr: AdamW peak learning rate.
        weight_decay: AdamW weight decay (not applied to gains, biases and the logit scale).
        warmup_steps: linear warmup steps, then decay to 10% of `lr` until `total_steps`
            (`lightning_swarm.lr_schedule`).
        total_steps: length of the whole schedule (warm-up included) in optimizer steps (set it to trainer.max_steps).
        decay: shape of the decay, "cosine" or "linear".
        hard_negatives: also contrast each image against its hard-negative captions.
        negative_images: also train on the pictures of the first hard negative of each example, as pairs
            of their own (image and caption): then each caption must also pick its picture over a picture
            that differs in one detail.
        layout_weight: weight of an auxiliary loss where one linear head, shared by both towers, names the layout
            of each two-shape example (side by side or stacked, and the left/top object's colour: `layout_class`)
            from its picture's embedding and from its caption's. Contrast alone never teaches the relation words:
            while neither tower tells the places of two shapes apart, a caption's pull towards its picture and
            its push away from the picture with the places swapped cancel over the data (each is the other's
            positive). The shared head makes a layout one direction in both embeddings, which starts both towers
            on it. The head is not part of the exported CLIP; 0 disables the term.
        export_dir: directory the trained model is exported to (open_clip local-dir format) when training
            ends; None disables the export.
        mean, std: image normalisation used by the data, recorded in the exported preprocess config.
    """

    def __init__(self, model_cfg: dict, lr: float = 1e-3, weight_decay: float = 0.1,
                 warmup_steps: int = 50, total_steps: int = 1000, decay: str = "cosine", hard_negatives: bool = True,
                 negative_images: bool = True, layout_weight: float = 0.0,
                 export_dir: str | None = "checkpoints/clip_tiny",
                 mean: tuple[float, float, float] = open_clip.OPENAI_DATASET_MEAN,
                 std: tuple[float, float, float] = open_clip.OPENAI_DATASET_STD):
        super().__init__()
        check_schedule(warmup_steps, max(total_steps - warmup_steps, 1), decay, min_lr_ratio=0.1)
        self.save_hyperparameters()
        self.model_cfg = dict(model_cfg)
        self.model = open_clip.CLIP(**self.model_cfg)
        if layout_weight > 0:
            self.layout_head = torch.nn.Linear(self.model_cfg["embed_dim"], NUM_LAYOUTS, bias=False)

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """L2-normalised float32 (image_features [B, D], text_features [M, D]), see `encode_images`."""
        return self.encode_images(images), F.normalize(self.model.encode_text(texts).float(), dim=-1)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """L2-normalised float32 image features. The encoders may run in bf16, but features are normalised and
        compared in float32: a caption's score and its hard negatives' scores are closer than bf16's steps
        (~0.4%, 0.125 at a logit scale of 20)."""
        return F.normalize(self.model.encode_image(images).float(), dim=-1)

    def _step(self, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, {name: BoolTensor of hits}) where the hits say, per example (and per hard negative), whether
        the image scores its caption above a hard-negative caption ("text", [B, K]), whether the caption
        scores its image above the first hard negative's picture ("image", [B]) and above its sloppy wrong
        drawings ("perturbed", [B, P])."""
        num_images = batch["image"].shape[0]
        negative_text = batch["negative_text"]  # [B, K, L]
        # texts: the B captions, the B first negatives (captions of the negative pictures), the other negatives
        texts = torch.cat([batch["text"], negative_text[:, 0], negative_text[:, 1:].flatten(0, 1)])
        images = batch["image"]
        use_images = self.hparams.negative_images and "negative_image" in batch
        if use_images:
            images = torch.cat([images, batch["negative_image"]])
        image_features, text_features = self(images, texts)
        # without hard negatives only the captions of the pictures (originals and negative pictures) take part
        num_used = len(texts) if self.hparams.hard_negatives else image_features.shape[0]
        extra = batch.get("perturbed_image")  # [B, P, 3, H, W] or absent
        extra_features = None
        if extra is not None and extra.shape[1] > 0:
            extra_features = self.encode_images(extra.flatten(0, 1))
        with torch.autocast(self.device.type, enabled=False):  # float32 scores, see `encode_images`
            loss = contrastive_loss(image_features, text_features[:num_used], self.model.logit_scale.exp().clamp(max=100),
                                    same_caption_mask(texts[: image_features.shape[0]], texts[:num_used]), extra_features)

            originals = image_features[:num_images]
            negative_features = torch.cat([text_features[num_images : 2 * num_images, None],
                                           text_features[2 * num_images :].view(num_images, -1, text_features.shape[-1])], 1)
            positive = (originals * text_features[:num_images]).sum(-1)  # [B]
            hits = {"text": positive[:, None] > (originals[:, None] * negative_features).sum(-1)}  # [B, K]
            if use_images:
                negative_image_score = (image_features[num_images:] * text_features[:num_images]).sum(-1)
                hits["image"] = positive > negative_image_score
            if extra_features is not None:  # [B, P]: the caption scores its picture above its sloppy wrong drawings
                sloppy_scores = (extra_features.view(num_images, -1, extra_features.shape[-1]) * text_features[:num_images, None]).sum(-1)
                hits["perturbed"] = positive[:, None] > sloppy_scores
            if self.hparams.layout_weight > 0 and "layout" in batch and (batch["layout"] >= 0).any():
                layout = batch["layout"]  # -1 (single shapes) is left out
                layout_loss = (F.cross_entropy(self.layout_head(originals), layout, ignore_index=-1)
                               + F.cross_entropy(self.layout_head(text_features[:num_images]), layout, ignore_index=-1))
                loss = loss + self.hparams.layout_weight * layout_loss / 2
        return loss, hits

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, hits = self._step(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/hard_negative_acc", hits["text"].float().mean(), prog_bar=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss, hits = self._step(batch)
        image_features, text_features = self(batch["image"], batch["text"])
        retrieval = (image_features @ text_features.T).argmax(-1) == torch.arange(len(image_features), device=self.device)
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/hard_negative_acc", hits["text"].float().mean(), prog_bar=True)
        if "image" in hits:
            self.log("val/negative_image_acc", hits["image"].float().mean())
        if "perturbed" in hits:
            self.log("val/perturbed_image_acc", hits["perturbed"].float().mean())
        for index, kind in enumerate(NEGATIVE_KINDS):  # which details the model can tell apart
            of_kind = batch["negative_kind"] == index
            if of_kind.any():
                self.log(f"val/hard_negative_acc/{kind}", hits["text"][of_kind].float().mean(),
                         batch_size=int(of_kind.sum()))
        self.log("val/image_to_text_acc", retrieval.float().mean())

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, param in self.named_parameters():  # the model and the layout head (if any)
            (no_decay if param.ndim < 2 or "logit_scale" in name else decay).append(param)
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": self.hparams.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=self.hparams.lr)
        warmup = self.hparams.warmup_steps
        decay_steps = max(self.hparams.total_steps - warmup, 1)  # total_steps counts the warm-up too
        scheduler = warmup_decay_scheduler(optimizer, warmup, decay_steps, self.hparams.decay, min_lr_ratio=0.1)
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
