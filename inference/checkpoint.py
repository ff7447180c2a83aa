"""Load a trained DALL-E for sampling: the model, its caption tokenizer and the image codec its config names."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from recipes.dalle.model import DALLE
from recipes.dalle.tokenizer import TextTokenizer


@dataclass
class LoadedDALLE:
    """What sampling needs from a checkpoint."""

    model: DALLE
    tokenizer: TextTokenizer
    codec: object  # PaletteCodec or VQGAN: decode(codes [B, G, G]) -> images [B, 3, H, W] in [0, 1]

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Image codes [B, N] (raster order) -> RGB images [B, 3, H, W] in [0, 1]."""
        grid = self.model.config.image_grid_size
        return self.codec.decode(codes.reshape(codes.shape[0], grid, grid)).float().clamp(0, 1)


def load_dalle(checkpoint: str | Path, device: str | torch.device = "cpu", allowed_model_packages: tuple[str, ...] = (),
               authority_public_key: str | None = None) -> LoadedDALLE:
    """Load a trained `recipes.dalle.module.DALLEModule` and build the image codec its config names.

    Args:
        checkpoint: where the swarm's checkpoints are, as `SwarmCheckpoint` and the monitor write them: a
            checkpoint directory, a directory with a `latest` file (its newest checkpoint is read), or a URL
            of either (`hf://owner/repo`, `s3://...`, `file://...`, any fsspec URL). Their meta.json names the
            model and its init args. An old Lightning `.ckpt` file also works (read with
            torch.load(weights_only=True)). Nothing is unpickled.
        device: where the model runs.
        allowed_model_packages: packages besides the project's `recipes` whose DALLEModule subclasses the
            checkpoint may name (their code is imported and runs: name only packages you trust).
        authority_public_key: the run's authority public key (`ssh-rsa ...` or a file holding it): given, only a
            checkpoint its monitor signed loads.
    """
    from recipes.dalle.module import DALLEModule

    if str(checkpoint).endswith(".ckpt"):
        path = Path(checkpoint)
        if not path.is_file():
            raise ValueError(f"no DALL-E checkpoint at {path}: train one with "
                             f"`python -m recipes.dalle fit --config configs/dalle_tiny.yaml` (it writes "
                             f"runs/dalle_tiny/checkpoints/) and pass that directory or the swarm's URL as --checkpoint")
        module = DALLEModule.from_checkpoint(str(path), map_location=device)
    else:
        from lightning_swarm.checkpoint.checkpoint_io import read_checkpoint

        try:
            saved = read_checkpoint(str(checkpoint), training_state=False, authority_public_key=authority_public_key)
        except FileNotFoundError as e:
            raise ValueError(f"{e}. Train with `python -m recipes.dalle fit --config configs/dalle_tiny.yaml` "
                             f"(it writes runs/dalle_tiny/checkpoints/) or pass the swarm's checkpoint URL") from None
        # the class is checked against DALLEModule before anything is built (see model_spec.build_model)
        module = saved.build_model(device, allowed_model_packages, base_class=DALLEModule)
    model = module.model.to(device).eval()
    codec = module.image_codec()
    if hasattr(codec, "to"):
        codec = codec.to(device).eval()
    if codec.codebook_size != model.config.image_vocab_size:
        raise ValueError(f"the checkpoint's codec has {codec.codebook_size} codes but the model samples "
                         f"{model.config.image_vocab_size}; check image_codec / vqgan_* in its config")
    return LoadedDALLE(model, TextTokenizer(model.config.text_seq_len), codec)
