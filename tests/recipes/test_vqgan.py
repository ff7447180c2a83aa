"""VQGAN: taming-compatible names and checkpoints, deterministic encoding, decode range."""

import argparse
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from recipes.dalle.vqgan import VQGAN, VQGANConfig, read_state_dict
from recipes.dalle.vqgan_layers import AttnBlock, Downsample

TINY = dict(ch=32, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=(8,), z_channels=32, embed_dim=32,
            n_embed=64, resolution=16)


def random_vqgan(quantizer: str = "gumbel", seed: int = 0) -> VQGAN:
    torch.manual_seed(seed)
    model = VQGAN(VQGANConfig(**TINY, quantizer=quantizer))
    with torch.no_grad():  # GroupNorm starts at identity; randomise it so a mis-loaded norm shows up
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_taming_checkpoint(model: VQGAN, path, **extra) -> None:
    """What taming's Lightning training writes: state_dict with loss/discriminator keys + metadata."""
    state_dict = dict(model.state_dict())
    state_dict["loss.discriminator.main.0.weight"] = torch.randn(8, 3, 4, 4)
    state_dict["loss.logvar"] = torch.zeros(())
    torch.save({"epoch": 3, "global_step": 1234, "pytorch-lightning_version": "1.0.8",
                "state_dict": state_dict, "optimizer_states": [], "lr_schedulers": [], **extra}, path)


def test_parameter_names_follow_taming():
    names = set(random_vqgan("gumbel").state_dict())
    # names as taming's Encoder/Decoder/GumbelVQ create them, for ch_mult=(1, 2), 1 res block, attention at 8 px
    for expected in [
        "encoder.conv_in.weight", "encoder.down.0.block.0.norm1.weight", "encoder.down.0.block.0.conv2.bias",
        "encoder.down.0.downsample.conv.weight", "encoder.down.1.block.0.nin_shortcut.weight",
        "encoder.down.1.attn.0.q.weight", "encoder.down.1.attn.0.proj_out.bias", "encoder.mid.block_1.norm2.weight",
        "encoder.mid.attn_1.k.weight", "encoder.mid.block_2.conv1.weight", "encoder.norm_out.weight",
        "encoder.conv_out.weight", "decoder.conv_in.weight", "decoder.mid.attn_1.v.bias",
        "decoder.up.1.block.1.conv1.weight", "decoder.up.1.attn.1.norm.weight", "decoder.up.1.upsample.conv.weight",
        "decoder.up.0.block.0.nin_shortcut.weight", "decoder.up.0.block.1.norm1.bias", "decoder.norm_out.bias",
        "decoder.conv_out.weight", "quant_conv.weight", "post_quant_conv.bias", "quantize.proj.weight",
        "quantize.embed.weight",
    ]:
        assert expected in names, expected
    assert not any(n.startswith("decoder.up.0.upsample") or n.startswith("encoder.down.1.downsample") for n in names)
    assert not any(".attn." in n for n in names if n.startswith(("encoder.down.0", "decoder.up.0")))
    assert "quantize.embedding.weight" in random_vqgan("vq").state_dict()


def test_layers_compute_what_taming_computes():
    torch.manual_seed(0)
    x = torch.randn(2, 32, 5, 6)
    attn = AttnBlock(32)
    h = attn.norm(x)
    q, k, v = attn.q(h).flatten(2), attn.k(h).flatten(2), attn.v(h).flatten(2)  # [B, C, HW]
    weights = torch.softmax(q.transpose(1, 2) @ k / math.sqrt(32), dim=2)  # [B, HWq, HWk]
    reference = x + attn.proj_out((v @ weights.transpose(1, 2)).reshape_as(x))
    torch.testing.assert_close(attn(x), reference, atol=1e-5, rtol=1e-5)

    down = Downsample(32)  # asymmetric padding: one row/column of zeros on the bottom/right only
    y = torch.randn(1, 32, 8, 8)
    torch.testing.assert_close(down(y), F.conv2d(F.pad(y, (0, 1, 0, 1)), down.conv.weight, down.conv.bias, stride=2))
    assert down(y).shape[-2:] == (4, 4)


@pytest.mark.parametrize("quantizer", ["gumbel", "vq"])
def test_taming_checkpoint_round_trip(tmp_path, quantizer):
    model = random_vqgan(quantizer)
    model.config.to_taming_yaml(tmp_path / "model.yaml")
    save_taming_checkpoint(model, tmp_path / "last.ckpt")
    loaded = VQGAN.from_taming(tmp_path / "model.yaml", tmp_path / "last.ckpt")
    assert loaded.config == model.config

    images = torch.rand(3, 3, 16, 16)
    codes = model.encode(images)
    assert torch.equal(loaded.encode(images), codes)
    assert torch.equal(loaded.decode(codes), model.decode(codes))
    assert len(codes.unique()) > 1  # random weights still spread over several codes

    # the same weights as safetensors
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    from_safetensors = VQGAN.from_taming(tmp_path / "model.yaml", tmp_path / "model.safetensors")
    assert torch.equal(from_safetensors.encode(images), codes)


def test_taming_yaml_layout(tmp_path):
    (tmp_path / "gumbel_f8.yaml").write_text("""
model:
  base_learning_rate: 4.5e-06
  target: taming.models.vqgan.GumbelVQ
  params:
    kl_weight: 1.0e-08
    embed_dim: 256
    n_embed: 8192
    monitor: val/rec_loss
    temperature_scheduler_config:
      target: taming.lr_scheduler.LambdaWarmUpCosineScheduler
      params: {warm_up_steps: 0, max_decay_steps: 1000001, lr_start: 0.9, lr_max: 0.9, lr_min: 1.0e-06}
    ddconfig:
      double_z: false
      z_channels: 256
      resolution: 256
      in_channels: 3
      out_ch: 3
      ch: 128
      ch_mult: [1, 1, 2, 4]
      num_res_blocks: 2
      attn_resolutions: [32]
      dropout: 0.0
    lossconfig:
      target: taming.modules.losses.vqperceptual.DummyLoss
""")
    config = VQGANConfig.from_taming_yaml(tmp_path / "gumbel_f8.yaml")
    assert config == VQGANConfig()  # the defaults are the seed's f8-8192 Gumbel model
    assert config.quantizer == "gumbel" and config.downsample_factor == 8

    (tmp_path / "bad.yaml").write_text("model:\n  target: taming.models.cond_transformer.Net2NetTransformer\n"
                                       "  params:\n    ddconfig: {}\n")
    with pytest.raises(ValueError, match="Net2NetTransformer"):
        VQGANConfig.from_taming_yaml(tmp_path / "bad.yaml")


def test_mismatched_checkpoints_fail_naming_the_key(tmp_path):
    model = random_vqgan("gumbel")
    config = model.config

    state_dict = dict(model.state_dict())
    del state_dict["decoder.up.1.attn.0.q.weight"]
    torch.save({"state_dict": state_dict}, tmp_path / "missing.ckpt")
    with pytest.raises(ValueError, match=r"missing keys \['decoder.up.1.attn.0.q.weight'\]"):
        VQGAN.from_taming(config, tmp_path / "missing.ckpt")

    state_dict = dict(model.state_dict())
    state_dict["quantize.embed.weight"] = torch.randn(128, 32)
    torch.save({"state_dict": state_dict}, tmp_path / "misshaped.ckpt")
    with pytest.raises(ValueError, match=r"quantize.embed.weight: checkpoint \(128, 32\) vs model \(64, 32\)"):
        VQGAN.from_taming(config, tmp_path / "misshaped.ckpt")

    # a plain-VQ checkpoint given a Gumbel config: both the extra and the missing names are reported
    torch.save({"state_dict": random_vqgan("vq").state_dict()}, tmp_path / "vq.ckpt")
    with pytest.raises(ValueError, match=r"missing keys \['quantize.embed.weight', 'quantize.proj.bias'.*"
                                         r"unexpected keys \['quantize.embedding.weight'\]"):
        VQGAN.from_taming(config, tmp_path / "vq.ckpt")


def test_checkpoint_with_pickled_objects_is_refused_clearly(tmp_path):
    model = random_vqgan("gumbel")
    # old Lightning stored hyper-parameters as an argparse.Namespace: not a tensor, not loadable safely
    save_taming_checkpoint(model, tmp_path / "old.ckpt", hparams=argparse.Namespace(lr=4.5e-6))
    with pytest.raises(ValueError, match=r"holds Python objects besides tensors.*safetensors") as refusal:
        read_state_dict(tmp_path / "old.ckpt")
    assert "weights_only=False" not in str(refusal.value)  # never coaches anyone into unpickling the file
    with pytest.raises(FileNotFoundError):
        read_state_dict(tmp_path / "nope.ckpt")


def test_encode_is_deterministic_and_decode_is_an_image():
    model = random_vqgan("gumbel")
    images = torch.rand(4, 3, 16, 16)
    codes = model.encode(images)
    assert codes.dtype == torch.long and codes.shape == (4, model.grid_size, model.grid_size) == (4, 8, 8)
    for _ in range(3):
        assert torch.equal(model.encode(images), codes)
    # the code is the argmax of the quantizer's logits (the mode of taming's Gumbel sampling)
    with torch.no_grad():
        logits = model.quantize.proj(model.quant_conv(model.encoder(images * 2 - 1)))
    assert torch.equal(codes, logits.argmax(1))
    assert 0 <= codes.min() and codes.max() < model.codebook_size

    decoded = model.decode(codes)
    assert decoded.shape == (4, 3, 16, 16) and decoded.dtype == torch.float32
    assert decoded.min() >= 0.0 and decoded.max() <= 1.0
    assert decoded.std() > 0  # not a constant image
    assert torch.equal(model.decode(codes.flatten(1)), decoded)  # flat [B, h*w] codes are accepted too
    with pytest.raises(ValueError, match="codes must lie in"):
        model.decode(torch.full((1, 8, 8), 64))


def test_vector_quantizer_picks_the_nearest_code():
    model = random_vqgan("vq")
    z = torch.randn(2, 32, 3, 3)
    codes = model.quantize.codes(z)
    distances = torch.cdist(z.permute(0, 2, 3, 1).reshape(-1, 32), model.quantize.embedding.weight)
    assert torch.equal(codes.flatten(), distances.argmin(1))


def test_bad_config_is_explained():
    with pytest.raises(ValueError, match="multiples of 32"):
        VQGANConfig(ch=24)
    with pytest.raises(ValueError, match="embed_dim == z_channels"):
        VQGANConfig(embed_dim=128)


def test_from_pretrained_reads_a_hub_cache(tmp_path):
    """The Hub code path, offline: files laid out as huggingface_hub's cache stores a downloaded repo."""
    model = random_vqgan("gumbel")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--someone--tiny-vqgan"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    model.config.to_taming_yaml(snapshot / "model.yaml")
    save_taming_checkpoint(model, snapshot / "last.ckpt")

    loaded = VQGAN.from_pretrained("someone/tiny-vqgan", "last.ckpt", "model.yaml", cache_dir=tmp_path,
                                   local_files_only=True)
    images = torch.rand(1, 3, 16, 16)
    assert torch.equal(loaded.encode(images), model.encode(images))
