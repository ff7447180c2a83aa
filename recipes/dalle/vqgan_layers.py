"""Encoder and decoder of taming-transformers' VQGAN, rebuilt with torch alone.

Module and parameter names follow taming/modules/diffusionmodules/model.py exactly (`conv_in`,
`down.{i}.block.{j}.norm1`, `mid.attn_1.q`, `up.{i}.upsample.conv`, `norm_out`, ...), so a
`state_dict` saved by taming loads into these modules key for key. The arithmetic is the same too
(GroupNorm(32, eps=1e-6), swish, asymmetric padding before the strided downsampling conv,
nearest-neighbour upsampling), so a released checkpoint gives the same codes and images.
"""

import torch
import torch.nn.functional as F
from torch import nn


def group_norm(channels: int) -> nn.GroupNorm:
    """taming's `Normalize`: 32 groups, so every channel count must be a multiple of 32."""
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    """Pre-activation residual block; a 1x1 `nin_shortcut` when the channel count changes.

    Args:
        in_channels: channels of the input feature map.
        out_channels: channels of the output feature map.
        dropout: dropout probability between the two convolutions (0 for all released models).
    """

    def __init__(self, in_channels: int, out_channels: int, dropout: float = 0.0):
        super().__init__()
        self.norm1 = group_norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)
        self.norm2 = group_norm(out_channels)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1)
        if in_channels != out_channels:
            self.nin_shortcut = nn.Conv2d(in_channels, out_channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        if hasattr(self, "nin_shortcut"):
            x = self.nin_shortcut(x)
        return x + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all spatial positions, with 1x1-conv q/k/v/proj_out.

    Args:
        channels: channels of the feature map (also the attention width).
    """

    def __init__(self, channels: int):
        super().__init__()
        self.norm = group_norm(channels)
        self.q = nn.Conv2d(channels, channels, kernel_size=1)
        self.k = nn.Conv2d(channels, channels, kernel_size=1)
        self.v = nn.Conv2d(channels, channels, kernel_size=1)
        self.proj_out = nn.Conv2d(channels, channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, height, width = x.shape
        h = self.norm(x)
        # [B, C, H, W] -> [B, 1 head, H*W, C]; scaled_dot_product_attention scales by C**-0.5 like taming
        q, k, v = (proj(h).reshape(b, 1, c, height * width).transpose(-1, -2) for proj in (self.q, self.k, self.v))
        h = F.scaled_dot_product_attention(q, k, v)
        h = h.transpose(-1, -2).reshape(b, c, height, width)
        return x + self.proj_out(h)


class Downsample(nn.Module):
    """Stride-2 3x3 conv; pads one pixel on the right and bottom only, as taming does."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0.0))


class Upsample(nn.Module):
    """Nearest-neighbour x2 upsampling followed by a 3x3 conv."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Encoder(nn.Module):
    """Image [B, in_channels, R, R] -> latent [B, z_channels, R/f, R/f], f = 2**(len(ch_mult)-1).

    Args:
        ch: base channel count (multiplied by `ch_mult[level]` at each resolution level).
        ch_mult: channel multiplier per level; one downsampling between consecutive levels.
        num_res_blocks: residual blocks per level.
        attn_resolutions: feature-map sizes (in pixels) at which attention follows each block.
        in_channels: image channels (3).
        resolution: training image size; decides where the attention layers sit.
        z_channels: latent channels produced by `conv_out`.
        dropout: dropout inside the residual blocks.
    """

    def __init__(self, ch: int, ch_mult: tuple[int, ...], num_res_blocks: int, attn_resolutions: tuple[int, ...],
                 in_channels: int, resolution: int, z_channels: int, dropout: float = 0.0):
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, ch, kernel_size=3, padding=1)
        in_ch_mult = (1,) + tuple(ch_mult)
        current_resolution = resolution
        self.down = nn.ModuleList()
        for level, mult in enumerate(ch_mult):
            block_in, block_out = ch * in_ch_mult[level], ch * mult
            down = nn.Module()
            down.block = nn.ModuleList()
            down.attn = nn.ModuleList()
            for _ in range(num_res_blocks):
                down.block.append(ResnetBlock(block_in, block_out, dropout))
                block_in = block_out
                if current_resolution in attn_resolutions:
                    down.attn.append(AttnBlock(block_in))
            if level != len(ch_mult) - 1:
                down.downsample = Downsample(block_in)
                current_resolution //= 2
            self.down.append(down)

        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(block_in, block_in, dropout)
        self.mid.attn_1 = AttnBlock(block_in)
        self.mid.block_2 = ResnetBlock(block_in, block_in, dropout)
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, z_channels, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for down in self.down:
            for i, block in enumerate(down.block):
                h = block(h)
                if len(down.attn) > 0:
                    h = down.attn[i](h)
            if hasattr(down, "downsample"):
                h = down.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    """Latent [B, z_channels, R/f, R/f] -> image [B, out_ch, R, R] (taming's range, about [-1, 1]).

    Args: as for `Encoder`, with `out_ch` the image channels produced (3). Each level has
    `num_res_blocks + 1` residual blocks; `up[i]` is the level at the same resolution as `down[i]`.
    """

    def __init__(self, ch: int, ch_mult: tuple[int, ...], num_res_blocks: int, attn_resolutions: tuple[int, ...],
                 out_ch: int, resolution: int, z_channels: int, dropout: float = 0.0):
        super().__init__()
        num_levels = len(ch_mult)
        block_in = ch * ch_mult[-1]
        current_resolution = resolution // 2 ** (num_levels - 1)
        self.conv_in = nn.Conv2d(z_channels, block_in, kernel_size=3, padding=1)
        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(block_in, block_in, dropout)
        self.mid.attn_1 = AttnBlock(block_in)
        self.mid.block_2 = ResnetBlock(block_in, block_in, dropout)

        up_levels = []
        for level in reversed(range(num_levels)):
            block_out = ch * ch_mult[level]
            up = nn.Module()
            up.block = nn.ModuleList()
            up.attn = nn.ModuleList()
            for _ in range(num_res_blocks + 1):
                up.block.append(ResnetBlock(block_in, block_out, dropout))
                block_in = block_out
                if current_resolution in attn_resolutions:
                    up.attn.append(AttnBlock(block_in))
            if level != 0:
                up.upsample = Upsample(block_in)
                current_resolution *= 2
            up_levels.insert(0, up)  # taming indexes `up` by level, lowest resolution last
        self.up = nn.ModuleList(up_levels)
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, out_ch, kernel_size=3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for up in reversed(self.up):
            for i, block in enumerate(up.block):
                h = block(h)
                if len(up.attn) > 0:
                    h = up.attn[i](h)
            if hasattr(up, "upsample"):
                h = up.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))
