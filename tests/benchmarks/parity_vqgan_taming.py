"""Parity of recipes.dalle.vqgan with taming-transformers' own Encoder/Decoder/GumbelQuantize code.

Builds taming's modules for the f8-8192 Gumbel config with random weights, loads their state dict
(taming's key names) into our VQGAN and prints whether the key sets, the codes and the decoded images
agree. taming's package does not import on current Lightning, so only its two torch-only module
files are loaded, from an unpacked wheel or a clone:

    pip download taming-transformers-rom1504==0.0.6 --no-deps -d /tmp/taming
    python -m zipfile -e /tmp/taming/taming_transformers_rom1504-0.0.6-py3-none-any.whl /tmp/taming/src
    python tests/benchmarks/parity_vqgan_taming.py --taming-src /tmp/taming/src [--image-size 64]
"""

import argparse
import importlib.util
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from recipes.dalle.vqgan import VQGAN, VQGANConfig


def load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--taming-src", type=Path, required=True, help="directory containing taming/")
    parser.add_argument("--image-size", type=int, default=64, help="test image side (any multiple of 8)")
    args = parser.parse_args()
    if "einops" not in sys.modules and importlib.util.find_spec("einops") is None:
        # quantize.py imports einops.rearrange at module level but the inference path used here never calls it
        sys.modules["einops"] = types.SimpleNamespace(rearrange=None)
    model_py = load_module("taming_model", args.taming_src / "taming/modules/diffusionmodules/model.py")
    quantize_py = load_module("taming_quantize", args.taming_src / "taming/modules/vqvae/quantize.py")

    torch.manual_seed(0)
    config = VQGANConfig()  # the seed's f8-8192 Gumbel model
    ddconfig = dict(double_z=False, z_channels=config.z_channels, resolution=config.resolution, in_channels=3,
                    out_ch=3, ch=config.ch, ch_mult=list(config.ch_mult), num_res_blocks=config.num_res_blocks,
                    attn_resolutions=list(config.attn_resolutions), dropout=0.0)
    taming = torch.nn.ModuleDict({
        "encoder": model_py.Encoder(**ddconfig),
        "decoder": model_py.Decoder(**ddconfig),
        "quant_conv": torch.nn.Conv2d(config.z_channels, config.embed_dim, 1),
        "post_quant_conv": torch.nn.Conv2d(config.embed_dim, config.z_channels, 1),
        "quantize": quantize_py.GumbelQuantize(config.z_channels, config.embed_dim, n_embed=config.n_embed),
    }).eval()
    with torch.no_grad():  # GroupNorm starts at identity; randomise it so a misplaced norm would show
        for name, parameter in taming.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)

    ours = VQGAN(config)
    ours.load_taming_state_dict(taming.state_dict(), source="taming-built modules")  # raises on any key mismatch
    print(f"state dict: {len(taming.state_dict())} taming keys loaded, names and shapes identical")

    images = torch.rand(2, 3, args.image_size, args.image_size)
    with torch.no_grad():
        logits = taming["quantize"].proj(taming["quant_conv"](taming["encoder"](images * 2 - 1)))
        taming_codes = logits.argmax(1)
        one_hot = F.one_hot(taming_codes, config.n_embed).permute(0, 3, 1, 2).float()
        z = torch.einsum("bnhw,nd->bdhw", one_hot, taming["quantize"].embed.weight)
        taming_images = (taming["decoder"](taming["post_quant_conv"](z)).clamp(-1, 1) + 1) / 2
    codes = ours.encode(images)
    decoded = ours.decode(codes)
    print(f"codes identical: {torch.equal(codes, taming_codes)} ({codes.numel()} codes)")
    print(f"decoded images: max |ours - taming| = {(decoded - taming_images).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
