"""VQGAN image codec compatible with taming-transformers' released checkpoints, in torch alone.

The seed run encoded LAION images with taming's "VQGAN f=8, 8192 codes, Gumbel quantization"
(OpenImages) model: a 256x256 image becomes a 32x32 grid of codes in [0, 8192). This module rebuilds
that model (and the plain vector-quantized VQModel variant) without importing taming, loads taming's
YAML configs and `.ckpt` / `.safetensors` weights directly, and exposes the image-codec contract of
`recipes.dalle.codec`: `encode(images in [0,1]) -> LongTensor[B, h, w]`, `decode(codes) -> images in [0,1]`,
`codebook_size`, `grid_size`, `image_size`.

    vqgan = VQGAN.from_taming("vqgan_gumbel_f8.yaml", "last.ckpt")   # local files
    vqgan = VQGAN.from_pretrained("someone/vqgan-f8-8192", "last.ckpt", "model.yaml")  # Hub repo
    codes = vqgan.encode(images)        # [B, 32, 32]
    images = vqgan.decode(codes)        # [B, 3, 256, 256] in [0, 1]
"""

import pickle
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml
from torch import nn

from recipes.dalle.vqgan_layers import Decoder, Encoder

# Checkpoint keys that belong to training only (perceptual loss, discriminator): never loaded.
IGNORED_KEY_PREFIXES = ("loss.",)


@dataclass
class VQGANConfig:
    """Architecture of a taming VQGAN; field names are those of taming's YAML (`model.params`).

    Args:
        ch: base channel count of encoder and decoder (multiple of 32: GroupNorm uses 32 groups).
        ch_mult: channel multiplier per resolution level; downsampling factor f = 2**(len(ch_mult)-1).
        num_res_blocks: residual blocks per level (the decoder has one more per level).
        attn_resolutions: feature-map sizes (pixels) that get self-attention after each block.
        z_channels: channels of the encoder output / decoder input.
        embed_dim: dimension of the codebook vectors.
        n_embed: number of codes in the codebook.
        resolution: image size the model was built for (decides where attention sits).
        in_channels: image channels read by the encoder.
        out_ch: image channels written by the decoder.
        dropout: dropout inside residual blocks (0 for released models).
        quantizer: "gumbel" (taming's GumbelVQ) or "vq" (taming's VQModel, nearest-codebook-vector).
    """

    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 4)
    num_res_blocks: int = 2
    attn_resolutions: tuple[int, ...] = (32,)
    z_channels: int = 256
    embed_dim: int = 256
    n_embed: int = 8192
    resolution: int = 256
    in_channels: int = 3
    out_ch: int = 3
    dropout: float = 0.0
    quantizer: str = "gumbel"

    def __post_init__(self):
        self.ch_mult = tuple(int(m) for m in self.ch_mult)
        self.attn_resolutions = tuple(int(r) for r in self.attn_resolutions)
        if self.quantizer not in ("gumbel", "vq"):
            raise ValueError(f"quantizer must be 'gumbel' or 'vq', got {self.quantizer!r}")
        channel_counts = {self.ch * m for m in self.ch_mult}
        if any(c % 32 for c in channel_counts):
            raise ValueError(f"ch * ch_mult must be multiples of 32 (GroupNorm with 32 groups); "
                             f"got ch={self.ch}, ch_mult={list(self.ch_mult)}")
        if self.resolution % self.downsample_factor:
            raise ValueError(f"resolution {self.resolution} is not divisible by the downsampling factor "
                             f"{self.downsample_factor} (2**(len(ch_mult)-1))")
        if self.quantizer == "gumbel" and self.embed_dim != self.z_channels:
            # taming's GumbelQuantize projects `quant_conv`'s embed_dim-channel output with a conv built
            # for z_channels inputs, so only embed_dim == z_channels configs can run at all
            raise ValueError(f"a Gumbel VQGAN needs embed_dim == z_channels, got {self.embed_dim} != {self.z_channels}")

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    @classmethod
    def from_taming_yaml(cls, path: str | Path) -> "VQGANConfig":
        """Read a taming config (`model.target`, `model.params.{embed_dim,n_embed,ddconfig}`)."""
        with open(path) as f:
            document = yaml.safe_load(f)
        try:
            model = document["model"]
            params = model["params"]
            ddconfig = params["ddconfig"]
        except (KeyError, TypeError) as error:
            raise ValueError(f"{path}: not a taming VQGAN config (needs model.params.ddconfig): "
                             f"missing {error}") from None
        target = model.get("target", "")
        if target.endswith("GumbelVQ"):
            quantizer = "gumbel"
        elif target.endswith(("VQModel", "VQNoDiscModel")):
            quantizer = "vq"
        else:
            raise ValueError(f"{path}: model.target {target!r} is not taming's GumbelVQ or VQModel")
        if ddconfig.get("double_z", False):
            raise ValueError(f"{path}: ddconfig.double_z is true; VQGAN checkpoints use double_z: false")
        fields = ("ch", "ch_mult", "num_res_blocks", "attn_resolutions", "z_channels", "resolution",
                  "in_channels", "out_ch")
        missing = [name for name in fields if name not in ddconfig]
        missing += [name for name in ("embed_dim", "n_embed") if name not in params]
        if missing:
            raise ValueError(f"{path}: config lacks {missing}")
        return cls(**{name: ddconfig[name] for name in fields}, dropout=ddconfig.get("dropout", 0.0),
                   embed_dim=params["embed_dim"], n_embed=params["n_embed"], quantizer=quantizer)

    def to_taming_yaml(self, path: str | Path) -> None:
        """Write this config in taming's YAML layout (what `from_taming_yaml` reads back)."""
        target = "taming.models.vqgan.GumbelVQ" if self.quantizer == "gumbel" else "taming.models.vqgan.VQModel"
        ddconfig = dict(double_z=False, z_channels=self.z_channels, resolution=self.resolution,
                        in_channels=self.in_channels, out_ch=self.out_ch, ch=self.ch, ch_mult=list(self.ch_mult),
                        num_res_blocks=self.num_res_blocks, attn_resolutions=list(self.attn_resolutions),
                        dropout=self.dropout)
        document = {"model": {"target": target,
                              "params": {"embed_dim": self.embed_dim, "n_embed": self.n_embed, "ddconfig": ddconfig}}}
        Path(path).write_text(yaml.safe_dump(document, sort_keys=False))


class VectorQuantizer(nn.Module):
    """taming's VectorQuantizer2 at inference: the code is the nearest codebook vector (L2)."""

    def __init__(self, n_embed: int, embed_dim: int):
        super().__init__()
        self.embedding = nn.Embedding(n_embed, embed_dim)

    def codes(self, z: torch.Tensor) -> torch.Tensor:
        """z [B, embed_dim, h, w] -> codes [B, h, w] (argmin of squared distance, ties -> lowest index)."""
        flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
        codebook = self.embedding.weight
        distances = flat.pow(2).sum(1, keepdim=True) + codebook.pow(2).sum(1) - 2 * flat @ codebook.t()
        return distances.argmin(dim=1).reshape(z.shape[0], z.shape[2], z.shape[3])

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, h, w] -> quantized latents [B, embed_dim, h, w]."""
        return self.embedding(codes).permute(0, 3, 1, 2)


class GumbelQuantizer(nn.Module):
    """taming's GumbelQuantize at inference: `proj` gives per-code logits; encoding takes their argmax.

    taming samples a Gumbel-softmax even in eval mode, so its codes are random; ours are the mode of
    that distribution, which makes encoding deterministic (as the seed's preprocessing needs).
    """

    def __init__(self, z_channels: int, n_embed: int, embed_dim: int):
        super().__init__()
        self.proj = nn.Conv2d(z_channels, n_embed, kernel_size=1)
        self.embed = nn.Embedding(n_embed, embed_dim)

    def codes(self, z: torch.Tensor) -> torch.Tensor:
        return self.proj(z).argmax(dim=1)

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        return self.embed(codes).permute(0, 3, 1, 2)


class VQGAN(nn.Module):
    """taming's VQModel / GumbelVQ without the training losses, as an image codec.

    Submodule names match taming (`encoder`, `decoder`, `quant_conv`, `quantize`, `post_quant_conv`)
    so `load_state_dict` takes taming's checkpoints as they are.

    Args:
        config: the architecture (see `VQGANConfig`).
    """

    def __init__(self, config: VQGANConfig):
        super().__init__()
        self.config = config
        layers = dict(ch=config.ch, ch_mult=config.ch_mult, num_res_blocks=config.num_res_blocks,
                      attn_resolutions=config.attn_resolutions, resolution=config.resolution,
                      z_channels=config.z_channels, dropout=config.dropout)
        self.encoder = Encoder(in_channels=config.in_channels, **layers)
        self.decoder = Decoder(out_ch=config.out_ch, **layers)
        self.quant_conv = nn.Conv2d(config.z_channels, config.embed_dim, kernel_size=1)
        self.post_quant_conv = nn.Conv2d(config.embed_dim, config.z_channels, kernel_size=1)
        if config.quantizer == "gumbel":
            self.quantize = GumbelQuantizer(config.z_channels, config.n_embed, config.embed_dim)
        else:
            self.quantize = VectorQuantizer(config.n_embed, config.embed_dim)
        self.eval()

    # ----- image-codec contract -----
    @property
    def codebook_size(self) -> int:
        return self.config.n_embed

    @property
    def grid_size(self) -> int:
        """Codes per side for an image of `image_size` pixels (32 for the f8 model at 256)."""
        return self.config.resolution // self.config.downsample_factor

    @property
    def image_size(self) -> int:
        return self.config.resolution

    @torch.inference_mode()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """images FloatTensor[B, 3, H, W] in [0, 1] (H, W multiples of the downsampling factor)
        -> LongTensor[B, H/f, W/f] of codes; deterministic."""
        if images.dim() != 4 or images.shape[1] != self.config.in_channels:
            raise ValueError(f"expected images [B, {self.config.in_channels}, H, W], got {tuple(images.shape)}")
        f = self.config.downsample_factor
        if images.shape[2] % f or images.shape[3] % f:
            raise ValueError(f"image height and width must be multiples of {f}, got {tuple(images.shape[2:])}")
        parameter = self.quant_conv.weight
        x = images.to(device=parameter.device, dtype=parameter.dtype) * 2.0 - 1.0  # taming works in [-1, 1]
        # NHWC convolutions: ~25% less CPU time per image for the f8 encoder, same codes (the decoder's
        # input, an embedding lookup permuted to [B, C, h, w], is NHWC already)
        x = x.contiguous(memory_format=torch.channels_last)
        return self.quantize.codes(self.quant_conv(self.encoder(x))).long()

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes LongTensor[B, h, w] (or [B, h*w] for a square grid) -> images FloatTensor[B, 3, h*f, w*f] in [0, 1]."""
        if codes.dim() == 2:
            side = int(round(codes.shape[1] ** 0.5))
            if side * side != codes.shape[1]:
                raise ValueError(f"flat codes must hold a square grid, got {codes.shape[1]} codes per image")
            codes = codes.reshape(codes.shape[0], side, side)
        if codes.dim() != 3:
            raise ValueError(f"expected codes [B, h, w] or [B, h*w], got {tuple(codes.shape)}")
        if codes.numel() and (codes.min() < 0 or codes.max() >= self.codebook_size):
            raise ValueError(f"codes must lie in [0, {self.codebook_size}), got [{codes.min()}, {codes.max()}]")
        z = self.quantize.embed_codes(codes.long().to(self.quant_conv.weight.device))
        images = self.decoder(self.post_quant_conv(z))
        return ((images.float().clamp(-1.0, 1.0) + 1.0) / 2.0)

    # ----- taming checkpoints -----
    def load_taming_state_dict(self, state_dict: dict[str, torch.Tensor], source: str = "state_dict") -> None:
        """Load taming parameter names; loss/discriminator keys are dropped. Raises ValueError naming
        every missing, unexpected or misshaped key (nothing is loaded in that case)."""
        state_dict = {k: v for k, v in state_dict.items() if not k.startswith(IGNORED_KEY_PREFIXES)}
        expected = self.state_dict()
        missing = sorted(set(expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(expected))
        misshaped = [f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(expected[k].shape)}"
                     for k in expected if k in state_dict and state_dict[k].shape != expected[k].shape]
        problems = []
        if missing:
            problems.append(f"missing keys {missing}")
        if unexpected:
            problems.append(f"unexpected keys {unexpected}")
        if misshaped:
            problems.append(f"shape mismatches {misshaped}")
        if problems:
            raise ValueError(f"{source} does not match the VQGAN config {asdict(self.config)}: " + "; ".join(problems)
                             + ". Check that the YAML config belongs to this checkpoint.")
        self.load_state_dict(state_dict, strict=True)

    @classmethod
    def from_taming(cls, config: str | Path | VQGANConfig, checkpoint: str | Path,
                    map_location: str | torch.device = "cpu") -> "VQGAN":
        """Build from a taming YAML config (or a `VQGANConfig`) and load a `.ckpt` / `.safetensors` file."""
        if not isinstance(config, VQGANConfig):
            config = VQGANConfig.from_taming_yaml(config)
        model = cls(config)
        model.load_taming_state_dict(read_state_dict(checkpoint, map_location), source=str(checkpoint))
        return model

    @classmethod
    def from_pretrained(cls, repo_id: str, checkpoint_filename: str, config_filename: str,
                        revision: str | None = None, map_location: str | torch.device = "cpu",
                        cache_dir: str | Path | None = None, local_files_only: bool = False) -> "VQGAN":
        """Download a taming checkpoint and its YAML config from a Hugging Face Hub model repo.

        Args:
            repo_id: Hub repository, e.g. "owner/vqgan-gumbel-f8-8192".
            checkpoint_filename: file in the repo holding the weights (`.ckpt` or `.safetensors`).
            config_filename: taming YAML config in the repo.
            revision: branch, tag or commit (default: the main branch).
            map_location: device the tensors are loaded to.
            cache_dir: Hub cache directory (default: huggingface_hub's, ~/.cache/huggingface/hub).
            local_files_only: use only files already in the cache (no network).
        """
        from huggingface_hub import hf_hub_download

        download = dict(revision=revision, cache_dir=cache_dir, local_files_only=local_files_only)
        config_path = hf_hub_download(repo_id, config_filename, **download)
        checkpoint_path = hf_hub_download(repo_id, checkpoint_filename, **download)
        return cls.from_taming(config_path, checkpoint_path, map_location)


def read_state_dict(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Tensors of a taming checkpoint: a Lightning `.ckpt` (its "state_dict"), a bare state dict
    saved with torch.save, or a `.safetensors` file. Never unpickles arbitrary objects."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"VQGAN checkpoint {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device=str(map_location))
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        # torch's message is long; the line naming the refused class is the useful one
        reason = next((line.strip() for line in str(error).splitlines() if "Unsupported global" in line),
                      str(error).splitlines()[0])
        raise ValueError(
            f"{path} holds Python objects besides tensors (old Lightning metadata such as callback classes "
            f"or hyper-parameters) and is refused: unpickling them can run arbitrary code, so this loader "
            f"never does, and neither should you for a file you did not make. Pass a .safetensors file of the "
            f"same weights instead: many published VQGANs ship one, and whoever made this checkpoint can "
            f"export one where they already load it, with safetensors.torch.save_file(state_dict, "
            f"'{path.with_suffix('.safetensors').name}'). "
            f"torch said: {reason}") from None
    if isinstance(checkpoint, dict) and isinstance(checkpoint.get("state_dict"), dict):
        checkpoint = checkpoint["state_dict"]
    if not isinstance(checkpoint, dict) or not all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
        raise ValueError(f"{path} is neither a Lightning checkpoint with a 'state_dict' nor a dict of tensors")
    return checkpoint
