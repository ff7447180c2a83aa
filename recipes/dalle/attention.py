"""Sparse causal attention over [bos] + text + image-grid sequences, with rotary embeddings and a KV cache.

Sequence layout (shared with model.py): positions ``0 .. T`` hold ``bos, text_0 .. text_{T-1}`` (the "text
part", ``num_text = T + 1`` tokens), positions ``T + 1 .. T + N`` hold the image codes of the ``G x G`` grid
in raster order (the "image part", ``N = G * G``). Who may attend to whom (``dense_mask`` is the definition):

- text queries: causal over the text part (never see the image);
- image query at cell (r, c): all of the text part, plus image keys chosen by the layer type:
    - ``full``:      every cell at or before (r, c) in raster order;
    - ``axial_row``: cells (r, c') with c' <= c   (earlier-or-same in its row);
    - ``axial_col``: cells (r', c) with r' <= r   (earlier-or-same in its column);
    - ``conv_like``: cells in the k x k window centred on (r, c) that are at or before (r, c) in raster order.

Two implementations of the whole-sequence pass (``attention_function``), equal up to rounding (tested):

- ``grouped`` (default): text queries run one causal SDPA over the text part; image queries are split into
  groups (a row, a column, or a row plus the rows above it for conv_like) and take one softmax over their
  scores against the text keys and against their group's own few image keys (``GroupedImageAttentionLayout``),
  never building the (T+N)^2 scores: on bench-small an axial layer's image query scores 81 keys instead of
  up to 321, and the whole attention costs about 2.5x less than ``dense`` in fp32 on this CPU
  (tests/benchmarks/bench_dalle_train.py).
- ``dense``: one fused ``scaled_dot_product_attention`` call per layer with the layer's boolean
  ``dense_mask`` (the reference; SDPA's CPU kernel computes every masked-out score too).

Step-by-step decoding uses the dense mask row of the current position over the cached keys, so it matches
the full forward by construction.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from recipes.dalle.cpu_linear import linear

ATTENTION_TYPES = ("full", "axial_row", "axial_col", "conv_like")


def dense_mask(attn_type: str, num_text: int, grid_size: int, conv_kernel_size: int = 5) -> torch.Tensor:
    """Reference boolean mask ``[L, L]`` on the CPU (True = query row may attend to key column), L = num_text + grid^2.

    Args:
        attn_type: one of ``ATTENTION_TYPES``.
        num_text: length of the text part (bos + text tokens).
        grid_size: side G of the image grid.
        conv_kernel_size: odd window side k for ``conv_like``.
    """
    if attn_type not in ATTENTION_TYPES:
        raise ValueError(f"unknown attention type {attn_type!r}; expected one of {ATTENTION_TYPES}")
    with torch.device("cpu"):
        return _dense_mask(attn_type, num_text, grid_size, conv_kernel_size)


def _dense_mask(attn_type, num_text, grid_size, conv_kernel_size):
    num_image = grid_size * grid_size
    length = num_text + num_image
    mask = torch.ones(length, length, dtype=torch.bool).tril()  # causal in raster order
    cell = torch.arange(num_image)
    row, col = cell // grid_size, cell % grid_size
    if attn_type == "axial_row":
        image_keys = row[:, None] == row[None, :]
    elif attn_type == "axial_col":
        image_keys = col[:, None] == col[None, :]
    elif attn_type == "conv_like":
        half = conv_kernel_size // 2
        image_keys = ((row[:, None] - row[None, :]).abs() <= half) & ((col[:, None] - col[None, :]).abs() <= half)
    else:
        image_keys = torch.ones(num_image, num_image, dtype=torch.bool)
    mask[num_text:, num_text:] &= image_keys
    return mask


class GroupedImageAttentionLayout:
    """How image queries attend in small groups instead of one (T+N)^2 masked attention.

    Image queries are split into ``num_groups`` groups of ``group_size`` cells; each group attends to the
    whole text part plus ``keys_per_group`` image keys of its own, under ``mask``
    ``[num_groups, group_size, num_text + keys_per_group]`` (``score_bias``: the same as 0 / -inf):

    - ``axial_row``: a group is a grid row; its keys are the same row.
    - ``axial_col``: a group is a grid column; its keys are the same column.
    - ``conv_like``: a group is a grid row; its keys are that row and the ``k // 2`` rows above it (rows above
      the grid are clamped to row 0 and masked out).
    - ``full``: one group of every cell; its keys are every cell.

    Built on the CPU (also when the model is created on the meta device); ``to(device)`` copies it.
    """

    def __init__(self, attn_type: str, num_text: int, grid_size: int, conv_kernel_size: int = 5):
        if attn_type not in ATTENTION_TYPES:
            raise ValueError(f"unknown attention type {attn_type!r}; expected one of {ATTENTION_TYPES}")
        self.attn_type, self.grid_size = attn_type, grid_size
        with torch.device("cpu"):
            self._build(attn_type, num_text, grid_size, conv_kernel_size)

    def _build(self, attn_type, num_text, grid_size, conv_kernel_size):
        g = grid_size
        cells = torch.arange(g * g).view(g, g)
        rows = wanted_rows = None
        if attn_type == "axial_row":
            query_index, key_index = cells, cells
        elif attn_type == "axial_col":
            query_index, key_index = cells.t(), cells.t()
        elif attn_type == "conv_like":
            half = conv_kernel_size // 2
            wanted_rows = torch.arange(g)[:, None] + torch.arange(-half, 1)[None, :]  # [g, half + 1]
            rows = wanted_rows.clamp(min=0)
            query_index, key_index = cells, cells[rows].reshape(g, (half + 1) * g)
        else:  # full
            query_index, key_index = cells.reshape(1, -1), cells.reshape(1, -1)
        reference = dense_mask(attn_type, num_text, grid_size, conv_kernel_size)[num_text:, num_text:]
        image_mask = reference[query_index[:, :, None], key_index[:, None, :]]
        if rows is not None:  # rows clamped at the top edge are duplicates: count each key once
            image_mask &= (rows == wanted_rows).repeat_interleave(g, dim=1)[:, None, :]
        text_mask = torch.ones(*query_index.shape, num_text, dtype=torch.bool)
        self.image_key_index = key_index.reshape(-1).contiguous()
        self.mask = torch.cat([text_mask, image_mask], dim=-1)
        self.num_groups, self.group_size = query_index.shape
        self.keys_per_group = key_index.shape[1]
        # additive form of the mask for the score blocks of ``grouped_attention``: 0 where allowed, -inf elsewhere
        self.score_bias = torch.zeros(self.mask.shape).masked_fill_(~self.mask, float("-inf"))

    def to(self, device) -> "GroupedImageAttentionLayout":
        moved = object.__new__(GroupedImageAttentionLayout)
        moved.__dict__.update({k: v.to(device) if torch.is_tensor(v) else v for k, v in self.__dict__.items()})
        return moved

    def group_queries(self, x: torch.Tensor) -> torch.Tensor:
        """Image-part tensor ``[B, H, N, d]`` -> ``[B, H, num_groups, group_size, d]`` (a view where possible)."""
        b, h, _, d = x.shape
        grid = x.view(b, h, self.grid_size, self.grid_size, d)
        if self.attn_type == "axial_col":
            return grid.transpose(2, 3)
        return x.view(b, h, self.num_groups, self.group_size, d)

    def group_keys(self, x: torch.Tensor) -> torch.Tensor:
        """Image-part keys or values ``[B, H, N, d]`` -> ``[B, H, num_groups, keys_per_group, d]``."""
        if self.attn_type == "conv_like":
            b, h, _, d = x.shape
            return x.index_select(2, self.image_key_index).view(b, h, self.num_groups, self.keys_per_group, d)
        return self.group_queries(x)

    def ungroup(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, num_groups, group_size, d]`` -> image part ``[B, H, N, d]`` in raster order."""
        if self.attn_type == "axial_col":
            x = x.transpose(2, 3)
        return x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1])


def grouped_attention(q, k, v, num_text: int, layout: GroupedImageAttentionLayout) -> torch.Tensor:
    """Sparse causal attention for a whole sequence. q, k, v: ``[B, H, num_text + N, d]`` -> same shape.

    Text queries run one causal SDPA over the text part. Image queries take one softmax over two score blocks,
    their scores against the text keys and against their group's own image keys, so keys and values are
    never copied into every group (the score blocks are small: ``num_text + keys_per_group`` per query).
    """
    b, h, length, d = q.shape
    groups, size, keys = layout.num_groups, layout.group_size, layout.keys_per_group
    parts = [num_text, length - num_text]
    (qt, qi), (kt, ki), (vt, vi) = q.split(parts, dim=2), k.split(parts, dim=2), v.split(parts, dim=2)
    out_text = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    queries = layout.group_queries(qi * d**-0.5)  # [B, H, groups, size, d]; SDPA's default scale
    text_scores = torch.matmul(queries.reshape(b, h, groups * size, d), kt.transpose(-1, -2))
    image_scores = torch.matmul(queries, layout.group_keys(ki).transpose(-1, -2))  # [B, H, groups, size, keys]
    scores = torch.cat([text_scores.view(b, h, groups, size, num_text), image_scores], dim=-1)
    text_probs, image_probs = (scores + layout.score_bias).softmax(dim=-1).split([num_text, keys], dim=-1)
    out_image = torch.matmul(text_probs.reshape(b, h, groups * size, num_text), vt).view(b, h, groups, size, d)
    out_image = out_image + torch.matmul(image_probs, layout.group_keys(vi))
    return torch.cat([out_text, layout.ungroup(out_image)], dim=2)


def masked_attention(q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
    """One fused SDPA over the whole sequence with a boolean ``[L, L]`` mask (None: plain causal)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


ATTENTION_IMPLEMENTATIONS = ("dense", "grouped")


def attention_function(impl: str, attn_type: str, num_text: int, grid_size: int, conv_kernel_size: int, device):
    """``attend(q, k, v)`` for one layer type, with its mask or grouping tables built on ``device``.

    ``grouped``: text queries causal over the text, image queries per row/column group over the text plus
    their own few image keys (see ``grouped_attention``). ``dense``: one fused SDPA call with the
    ``dense_mask`` (``full`` layers use the causal flag).
    """
    if impl == "grouped":
        layout = GroupedImageAttentionLayout(attn_type, num_text, grid_size, conv_kernel_size).to(device)
        return functools.partial(grouped_attention, num_text=num_text, layout=layout)
    if impl != "dense":
        raise ValueError(f"unknown attention implementation {impl!r}; expected one of {ATTENTION_IMPLEMENTATIONS}")
    mask = None if attn_type == "full" else dense_mask(attn_type, num_text, grid_size, conv_kernel_size).to(device)
    return functools.partial(masked_attention, mask=mask)


def rotary_tables(num_text: int, grid_size: int, dim_head: int, theta: float = 10000.0) -> torch.Tensor:
    """Complex rotations ``[num_text + G^2, dim_head // 2]`` (on the CPU) for 3-band rotary embeddings.

    Consecutive pairs of a head's dims are rotated. ``dim_head`` is split into three equal even bands (the
    rest stays unrotated): band 1 rotates by the 1-D sequence position (text tokens 0..T; every image token
    sits at T + 1, right after the text), band 2 by the grid row and band 3 by the grid column (text tokens
    sit at row = column = -1, just before the grid).
    """
    band = (dim_head // 3) // 2 * 2
    if band < 2:
        raise ValueError(f"rotary embeddings need dim_head >= 6 (got {dim_head}); raise dim_head or set rotary=False")
    with torch.device("cpu"):
        num_image = grid_size * grid_size
        cell = torch.arange(num_image)
        seq_pos = torch.cat([torch.arange(num_text), torch.full((num_image,), num_text)]).double()
        row_pos = torch.cat([torch.full((num_text,), -1), cell // grid_size]).double()
        col_pos = torch.cat([torch.full((num_text,), -1), cell % grid_size]).double()
        inv_freq = theta ** (-torch.arange(0, band, 2).double() / band)  # [band / 2]
        angles = torch.cat([pos[:, None] * inv_freq[None, :] for pos in (seq_pos, row_pos, col_pos)], dim=1)
        angles = torch.cat([angles, torch.zeros(angles.shape[0], (dim_head - 3 * band) // 2)], dim=1)
        return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def apply_rotary(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of x's last dim: x ``[..., d]``, rotations complex, broadcastable to ``[..., d/2]``."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotations).flatten(-2).to(x.dtype)


@dataclass
class LayerCache:
    """Keys/values of one layer for every position decoded so far: ``[B, H, max_len, d]`` each."""

    keys: torch.Tensor
    values: torch.Tensor


class Attention(nn.Module):
    """Multi-head attention whose mask comes from the caller (shared weights serve every layer type).

    Args:
        dim: model width.
        heads: number of attention heads.
        dim_head: width of each head (heads * dim_head need not equal dim).
    """

    def __init__(self, dim: int, heads: int, dim_head: int):
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim)

    def _project(self, x, rotations):
        """x ``[B, L, dim]`` -> q, k, v ``[B, H, L, d]``; rotary (``rotations [L, d/2]`` or None) on q and k."""
        qkv = linear(x, self.to_qkv.weight).unflatten(-1, (3, self.heads, self.dim_head))  # [B, L, 3, H, d]
        qk, v = qkv.split([2, 1], dim=2)  # split, not slicing: its backward is one cat, not zeros + copies
        if rotations is not None:  # one complex multiply rotates q and k together
            qk = apply_rotary(qk, rotations[:, None, None])
        q, k = qk.permute(2, 0, 3, 1, 4)
        return q, k, v.squeeze(2).transpose(1, 2)

    def _merge(self, out):
        return linear(out.transpose(1, 2).flatten(2), self.to_out.weight, self.to_out.bias)

    def forward(self, x, attend, rotations=None):
        """Whole-sequence attention.

        Args:
            x: ``[B, num_text + N, dim]``.
            attend: ``attend(q, k, v) -> out`` on ``[B, H, L, d]`` tensors, e.g. ``masked_attention`` or
                ``grouped_attention`` with the layer's pattern bound (see ``attention_function``).
            rotations: ``rotary_tables(...)`` on x's device, or None.
        """
        q, k, v = self._project(x, rotations)
        return self._merge(attend(q, k, v))

    def forward_text(self, x, rotations=None, cache: LayerCache | None = None):
        """Causal attention over a text prefix ``[B, num_text, dim]``; stores its keys/values in ``cache``."""
        q, k, v = self._project(x, rotations)
        if cache is not None:
            cache.keys[:, :, : x.shape[1]] = k
            cache.values[:, :, : x.shape[1]] = v
        return self._merge(F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def forward_step(self, x, position: int, mask_row, cache: LayerCache, rotations=None):
        """One new token at ``position``: x ``[B, 1, dim]``; ``mask_row`` ``[position + 1]`` bool over keys."""
        q, k, v = self._project(x, rotations)
        cache.keys[:, :, position : position + 1] = k
        cache.values[:, :, position : position + 1] = v
        keys, values = cache.keys[:, :, : position + 1], cache.values[:, :, : position + 1]
        return self._merge(F.scaled_dot_product_attention(q, keys, values, attn_mask=mask_row.view(1, -1)))

