"""The DALL-E LightningModule: the model of `model.py`, its loss, optimizer and LR schedule."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import OptimizerCallable

from lightning_swarm.lr_schedule import check_schedule, warmup_decay_scheduler
from recipes.dalle.model import DALLE, DALLEConfig, unconditional_text
from recipes.dalle.tokenizer import text_token_ids


def default_optimizer(params) -> torch.optim.Optimizer:
    """AdamW as in small-scale runs; swarm configs use `lightning_swarm.optim.LAMB8bit` instead."""
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.96), weight_decay=0.01, fused=True)


class DALLEModule(L.LightningModule):
    """Trains a `DALLE` on batches `{"text": LongTensor[B, T], "image": LongTensor[B, N]}`.

    Args:
        config: the model's shape (see `DALLEConfig`).
        image_codec: the codec of the image codes, "palette" (embedded shapes data) or "vqgan";
            stored with the checkpoint so inference can decode samples (see `codec.load_image_codec`).
        vqgan_config: taming YAML config of the VQGAN (path or hf://OWNER/REPO/FILE), with "vqgan".
        vqgan_checkpoint: taming checkpoint of the VQGAN (path or hf://OWNER/REPO/FILE), with "vqgan".
        optimizer: builds the optimizer from the parameters (LightningCLI: `optimizer: {class_path: ...}`).
        warmup_steps: optimizer steps of linear LR warm-up. Under HivemindStrategy a step is a global epoch.
        decay_steps: optimizer steps of decay after warm-up (None: constant LR after warm-up).
        decay: shape of the decay, "cosine" or "linear" (see `lightning_swarm.lr_schedule`).
        min_lr_ratio: the LR at the end of the decay, as a fraction of the peak LR.
        text_dropout: probability that a training example's caption is replaced by `unconditional_text`
            (caption dropout), so that the model also learns p(image) and classifier-free guidance
            (`--guidance-scale`) has an unconditional model to push away from. Validation always uses the captions.
        text_vocabulary: sets `config.text_token_ids` by name: "shapes" (a compact vocabulary of the embedded
            shapes captions' few dozen CLIP BPE ids, for the tiny recipe) or "full" (a row per CLIP BPE id, for
            real captions). None keeps `config.text_token_ids` as given (checkpoints store the resolved ids).
    """

    def __init__(
        self,
        config: DALLEConfig,
        image_codec: str = "palette",
        vqgan_config: str | None = None,
        vqgan_checkpoint: str | None = None,
        optimizer: OptimizerCallable = default_optimizer,
        warmup_steps: int = 100,
        decay_steps: int | None = None,
        decay: str = "cosine",
        min_lr_ratio: float = 0.1,
        text_dropout: float = 0.0,
        text_vocabulary: str | None = None,
    ):
        super().__init__()
        if text_vocabulary is not None:
            config = replace(config, text_token_ids=text_token_ids(text_vocabulary))
        if image_codec not in ("palette", "vqgan"):
            raise ValueError(f"image_codec must be 'palette' or 'vqgan', got {image_codec!r}")
        check_schedule(warmup_steps, decay_steps, decay, min_lr_ratio)
        if not 0.0 <= text_dropout <= 1.0:
            raise ValueError(f"text_dropout must lie in [0, 1], got {text_dropout}")
        # Plain types only, so checkpoints load with torch.load(weights_only=True).
        self.save_hyperparameters({
            "config": asdict(config), "image_codec": image_codec, "vqgan_config": vqgan_config,
            "vqgan_checkpoint": vqgan_checkpoint, "warmup_steps": warmup_steps, "decay_steps": decay_steps,
            "decay": decay, "min_lr_ratio": min_lr_ratio, "text_dropout": text_dropout,
        })
        self.config = config
        self.model = DALLE(config)
        self.optimizer_factory = optimizer
        self.initial_val_image_loss: float | None = None  # measured by the sanity check, before any step
        self._val_image_losses: list[torch.Tensor] = []

    @classmethod
    def config_from_hparams(cls, hparams: dict[str, Any]) -> DALLEConfig:
        """The `DALLEConfig` stored in a checkpoint's hyper-parameters."""
        fields = dict(hparams["config"])
        for key in ("attn_types", "shared_layer_ids", "text_token_ids"):
            if fields.get(key) is not None:
                fields[key] = tuple(fields[key])
        return DALLEConfig(**fields)

    @classmethod
    def from_checkpoint(cls, path: str, map_location: str | torch.device = "cpu") -> "DALLEModule":
        """Load a Lightning checkpoint of this module without unpickling anything but tensors and plain types."""
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
        hparams = checkpoint["hyper_parameters"]
        module = cls(cls.config_from_hparams(hparams), image_codec=hparams["image_codec"],
                     vqgan_config=hparams.get("vqgan_config"), vqgan_checkpoint=hparams.get("vqgan_checkpoint"))
        module.load_state_dict(checkpoint["state_dict"])
        return module.eval()

    def image_codec(self):
        """The codec that decodes this model's image codes into pictures."""
        from recipes.dalle.codec import load_image_codec

        return load_image_codec(self.hparams["image_codec"], self.hparams["vqgan_config"], self.hparams["vqgan_checkpoint"])

    def memory_profile(self) -> dict:
        """Transformer shape for `lightning_swarm.memory` (activation and logits estimates)."""
        c = self.config
        return {"dim": c.dim, "depth": c.depth, "heads": c.heads, "dim_head": c.dim_head,
                "seq_len": c.num_text + c.image_grid_size ** 2, "ff_mult": c.ff_mult, "glu": True,
                "attention": "sdpa", "vocab_size": c.image_vocab_size,
                # text positions score the text vocabulary, image positions the codebook (never the union)
                "logits_per_sample": c.text_seq_len * (c.text_rows + c.text_seq_len)
                                     + c.image_grid_size ** 2 * c.image_vocab_size,
                "reversible": bool(c.reversible)}

    def forward(self, text: torch.Tensor, image: torch.Tensor):
        return self.model(text, image)

    def _check_batch(self, batch: dict[str, torch.Tensor]) -> None:
        c = self.config
        text, image = batch["text"], batch["image"]
        if text.shape[1] != c.text_seq_len or image.shape[1] != c.image_grid_size ** 2:
            raise ValueError(
                f"batch has text length {text.shape[1]} and {image.shape[1]} image codes, but the model expects "
                f"text_seq_len={c.text_seq_len} and image_grid_size**2={c.image_grid_size ** 2}: make "
                f"data.text_seq_len / data.image_grid_size match model.config")

    def drop_captions(self, text: torch.Tensor) -> torch.Tensor:
        """`text` [B, T] with each row replaced by `unconditional_text` with probability `text_dropout`."""
        p = self.hparams["text_dropout"]
        if p == 0.0:
            return text
        dropped = torch.rand(text.shape[0], device=text.device) < p
        return torch.where(dropped[:, None], unconditional_text(text), text)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._check_batch(batch)
        losses = self.model.compute_loss(self.drop_captions(batch["text"]), batch["image"])
        batch_size = batch["text"].shape[0]
        self.log("train/loss", losses["loss"], prog_bar=True, batch_size=batch_size)
        self.log("train/text_loss", losses["text_loss"], batch_size=batch_size)
        self.log("train/image_loss", losses["image_loss"], prog_bar=True, batch_size=batch_size)
        return losses["loss"]

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._check_batch(batch)
        losses = self.model.compute_loss(batch["text"], batch["image"])
        batch_size = batch["text"].shape[0]
        self._val_image_losses.append(losses["image_loss"].detach() * batch_size)
        self._val_image_losses.append(torch.tensor(float(batch_size)))
        self.log("val/loss", losses["loss"], batch_size=batch_size)
        self.log("val/text_loss", losses["text_loss"], batch_size=batch_size)
        self.log("val/image_loss", losses["image_loss"], prog_bar=True, batch_size=batch_size)

    def on_validation_epoch_end(self) -> None:
        if not self._val_image_losses:
            return
        total = torch.stack(self._val_image_losses[0::2]).sum().item()
        count = torch.stack(self._val_image_losses[1::2]).sum().item()
        self._val_image_losses.clear()
        mean = total / count
        if self.trainer.sanity_checking and self.initial_val_image_loss is None and self.global_step == 0:
            # Lightning does not log during the sanity check; keep it as the step-0 reference instead.
            self.initial_val_image_loss = mean
            self.print(f"val/image_loss at step 0: {mean:.4f}")
        elif self.initial_val_image_loss is not None:
            self.log("val/image_loss_ratio", mean / self.initial_val_image_loss)

    def configure_optimizers(self):
        decay_params = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        other_params = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        optimizer = self.optimizer_factory([{"params": decay_params}, {"params": other_params, "weight_decay": 0.0}])
        hp = self.hparams
        scheduler = warmup_decay_scheduler(optimizer, hp["warmup_steps"], hp["decay_steps"], hp.get("decay", "cosine"),
                                           hp["min_lr_ratio"])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
