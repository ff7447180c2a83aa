"""DALL-E: a decoder-only transformer over [bos] + text tokens + image codes (Training Transformers Together).

Sequence and targets (T = text_seq_len, G = image_grid_size, N = G * G):

    position  0        1 .. T                T + 1 .. T + N
    input     bos      text_0 .. text_{T-1}   code_0 .. code_{N-1}      (codes in raster order)
    predicts  text_0   text_1 .. code_0       code_1 .. (nothing)

- Text pads (id 0) at text position i become id ``V + i`` (per-position pad ids, as in DALLE-pytorch), so
  the text embedding has ``V + text_seq_len`` rows; ``bos`` is row 0 (id 0 never occurs after the pad
  remapping). Targets use the same remapped ids. V is ``text_vocab_size`` (a row per tokenizer id), or, with
  a compact vocabulary (``text_token_ids``: the ids a dataset's captions use), ``len(text_token_ids) + 2``:
  row 0, a row per listed id and one shared row for any other id (``DALLEConfig.text_rows``).
- Text logits (positions 0 .. T-1) are over the ``V + text_seq_len`` text rows only; image
  logits (positions T .. T+N-1; position T is the last text token and predicts the first code) are over the
  image codebook only. Both reuse the input embedding matrices (tied) plus a bias.
- loss = (text CE + w * image CE) / (1 + w), w = ``image_loss_weight`` (7 in the seed run).

Each layer: attention of a type (see ``attention.py``: ``axial_row``, ``axial_col``, ``conv_like``, ``full``)
and a GEGLU feed-forward, both pre-norm, wired as a reversible coupling (or plain residuals). The
attention+feed-forward weights ("block") may be shared by several layers (``shared_layer_ids``); layer norms
are always per layer.

Incremental decoding (for sampling)::

    cache = model.new_cache(batch_size)
    logits = model.prefill(text, cache)              # [B, image_vocab_size]: logits of code_0
    for j in range(N - 1):
        code = sample(logits)                         # LongTensor[B]
        logits = model.decode_step(code, cache)      # logits of code_{j+1}, given code_0 .. code_j
    # the last sampled code needs no forward pass

This gives the same logits as ``model(text, codes)[1]`` (up to float rounding); see ``decoding.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from recipes.dalle.attention import (
    ATTENTION_IMPLEMENTATIONS,
    ATTENTION_TYPES,
    Attention,
    attention_function,
    dense_mask,
    rotary_tables,
)
from recipes.dalle.cpu_linear import linear, linear_cross_entropy
from recipes.dalle.decoding import DALLECache, IncrementalDecodingMixin
from recipes.dalle.reversible import reversible_forward, reversible_forward_eager

__all__ = ["DALLE", "DALLECache", "DALLEConfig", "unconditional_text"]

# the seed run's configuration, in the checkout's configs/
SEED_1B_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "dalle_1b.yaml"


def unconditional_text(text: torch.Tensor) -> torch.Tensor:
    """The caption of "no caption" for `text` [B, T]: a new tensor of all pads (id 0), same shape.

    Training with `text_dropout` shows the model these captions, and classifier-free guidance
    (`inference.sampling.sample_codes`) runs its unconditional pass on them: both must use this one definition.
    """
    return torch.zeros_like(text)


@dataclass
class DALLEConfig:
    """Shape of a DALL-E model.

    Args:
        dim: model width.
        depth: number of layers.
        heads: attention heads per layer.
        dim_head: width of each attention head (heads * dim_head may differ from dim).
        text_vocab_size: text tokenizer vocabulary (CLIP BPE: 49408); id 0 is the pad.
        text_seq_len: number of text tokens per caption (T).
        image_vocab_size: image codebook size.
        image_grid_size: side G of the image-code grid (N = G * G codes).
        attn_types: attention types cycled over the layers (``full``, ``axial_row``, ``axial_col``, ``conv_like``).
        last_layer_conv: make the last layer ``conv_like`` with its own (unshared) block, as in the seed run.
        conv_kernel_size: odd window side of ``conv_like`` layers (at most image_grid_size).
        shared_layer_ids: block ids cycled over the layers; layers with the same id share their attention and
            feed-forward weights (norms stay per layer). None: every layer has its own block.
        reversible: reversible residual coupling (activations recomputed in backward, memory flat in depth).
        rotary: rotary position embeddings (1-D over text, row/column over the grid); else learned embeddings.
        rotary_theta: rotary frequency base.
        ff_mult: feed-forward hidden width as a multiple of dim (GEGLU).
        image_loss_weight: weight w of the image loss in (text + w * image) / (1 + w).
        text_token_ids: a compact text vocabulary: the tokenizer ids (> 0) the text embedding has rows for, e.g.
            every id of the embedded shapes captions (``recipes.dalle.tokenizer.shapes_token_ids``); any other id
            shares one "unknown" row. Captions stay tokenizer ids (the data contract); the model maps them. With
            a few dozen words instead of 49,408 the text logits, the text embedding's gradient and its optimizer
            update cost almost nothing. None: a row for every id below text_vocab_size.
        attention_impl: ``grouped`` (text queries causal over the text; image queries per row/column group
            over the text plus their own few image keys: fewer FLOPs, fastest on CPU) or ``dense`` (one
            masked SDPA over the whole sequence per layer; the reference).
    """

    dim: int = 512
    depth: int = 8
    heads: int = 8
    dim_head: int = 64
    text_vocab_size: int = 49408
    text_seq_len: int = 64
    image_vocab_size: int = 8192
    image_grid_size: int = 32
    attn_types: tuple[str, ...] = ("axial_row", "axial_col", "axial_row", "axial_row")
    last_layer_conv: bool = True
    conv_kernel_size: int = 5
    shared_layer_ids: tuple[int, ...] | None = None
    reversible: bool = True
    rotary: bool = True
    rotary_theta: float = 10000.0
    ff_mult: int = 4
    image_loss_weight: float = 7.0
    attention_impl: str = "grouped"
    text_token_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        self.attn_types = tuple(self.attn_types)
        if self.text_token_ids is not None:
            self.text_token_ids = tuple(int(i) for i in self.text_token_ids)
            bad = [i for i in self.text_token_ids if not 0 < i < self.text_vocab_size]
            if bad or len(set(self.text_token_ids)) != len(self.text_token_ids) or not self.text_token_ids:
                raise ValueError(f"DALLEConfig.text_token_ids must be distinct ids in [1, text_vocab_size="
                                 f"{self.text_vocab_size}), at least one; got {len(self.text_token_ids)} ids"
                                 + (f", out of range: {bad[:5]}" if bad else ""))
        if self.shared_layer_ids is not None:
            self.shared_layer_ids = tuple(int(i) for i in self.shared_layer_ids)
        for name in ("dim", "depth", "heads", "dim_head", "text_vocab_size", "text_seq_len",
                     "image_vocab_size", "image_grid_size", "ff_mult"):
            if getattr(self, name) < 1:
                raise ValueError(f"DALLEConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.attn_types:
            raise ValueError("DALLEConfig.attn_types is empty; give at least one attention type")
        for attn_type in self.attn_types:
            if attn_type not in ATTENTION_TYPES:
                raise ValueError(f"DALLEConfig.attn_types has unknown type {attn_type!r}; use {ATTENTION_TYPES}")
        if "conv_like" in self.layer_attn_types():
            k = self.conv_kernel_size
            if k % 2 == 0 or k < 1 or k > self.image_grid_size:
                raise ValueError(
                    f"DALLEConfig.conv_kernel_size must be odd and between 1 and image_grid_size "
                    f"({self.image_grid_size}), got {k}"
                )
        if self.shared_layer_ids is not None and len(self.shared_layer_ids) == 0:
            raise ValueError("DALLEConfig.shared_layer_ids is empty; use None for no sharing")
        if self.rotary and self.dim_head % 2:
            raise ValueError(f"rotary embeddings need an even dim_head, got {self.dim_head}")
        if self.rotary and self.dim_head < 6:
            raise ValueError(f"rotary embeddings need dim_head >= 6, got {self.dim_head}; or set rotary=False")
        if self.attention_impl not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"DALLEConfig.attention_impl must be one of {ATTENTION_IMPLEMENTATIONS}, "
                             f"got {self.attention_impl!r}")
        if self.image_loss_weight < 0:
            raise ValueError(f"DALLEConfig.image_loss_weight must be >= 0, got {self.image_loss_weight}")

    @classmethod
    def seed_1b(cls, **overrides) -> "DALLEConfig":
        """The seed run's ~1.1B-parameter model (about 0.14B unique parameters thanks to weight sharing), read
        from ``configs/dalle_1b.yaml`` (``model.init_args.config``) in the checkout, the one place it is defined.

        Args:
            **overrides: fields to change, e.g. ``shared_layer_ids=None``.
        """
        from lightning_swarm.recipe_config import load_yaml

        path = SEED_1B_CONFIG
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: DALLEConfig.seed_1b reads the repository's configs/")
        values = dict(load_yaml(path)["model"]["init_args"]["config"])
        values.update(overrides)
        return cls(**values)

    @property
    def text_rows(self) -> int:
        """Text ids the model tells apart before the per-position pads (V in the module docstring)."""
        return self.text_vocab_size if self.text_token_ids is None else len(self.text_token_ids) + 2

    @property
    def num_text(self) -> int:
        """Length of the text part of the sequence: bos + text tokens."""
        return self.text_seq_len + 1

    @property
    def num_image(self) -> int:
        return self.image_grid_size**2

    def layer_attn_types(self) -> list[str]:
        """Attention type of every layer."""
        types = [self.attn_types[i % len(self.attn_types)] for i in range(self.depth)]
        if self.last_layer_conv:
            types[-1] = "conv_like"
        return types

    def layer_block_ids(self) -> list[int]:
        """Index of the (possibly shared) attention+feed-forward block each layer uses (0 .. num_blocks-1)."""
        if self.shared_layer_ids is None:
            return list(range(self.depth))
        ids = [self.shared_layer_ids[i % len(self.shared_layer_ids)] for i in range(self.depth)]
        if self.last_layer_conv:
            ids[-1] = max(ids) + 1  # the conv layer gets its own block
        renumber = {block_id: i for i, block_id in enumerate(dict.fromkeys(ids))}
        return [renumber[i] for i in ids]


class _GEGLU(torch.autograd.Function):
    """``a * gelu(gate)`` for ``[a, gate] = hidden.chunk(2, -1)``, whose backward writes the gradients of ``a``
    and ``gate`` straight into one buffer (autograd's chunk backward would concatenate two copies)."""

    @staticmethod
    def forward(ctx, hidden):
        a, gate = hidden.chunk(2, dim=-1)
        gelu_gate = F.gelu(gate)
        ctx.save_for_backward(hidden, gelu_gate)
        return a * gelu_gate

    @staticmethod
    def backward(ctx, grad_out):
        hidden, gelu_gate = ctx.saved_tensors
        a, gate = hidden.chunk(2, dim=-1)
        grad_hidden = torch.empty_like(hidden)
        grad_a, grad_gate = grad_hidden.chunk(2, dim=-1)
        torch.mul(grad_out, gelu_gate, out=grad_a)
        torch.ops.aten.gelu_backward.grad_input(grad_out * a, gate, grad_input=grad_gate)
        return grad_hidden


class FeedForward(nn.Module):
    """GEGLU feed-forward: ``W2 (a * gelu(b))`` with ``[a, b] = W1 x``."""

    def __init__(self, dim: int, mult: int):
        super().__init__()
        self.proj_in = nn.Linear(dim, 2 * mult * dim)
        self.proj_out = nn.Linear(mult * dim, dim)

    def forward(self, x):
        hidden = linear(x, self.proj_in.weight, self.proj_in.bias)
        if hidden.dtype in (torch.float32, torch.float64):
            gated = _GEGLU.apply(hidden)
        else:  # bf16/fp16 (autocast): autograd's chunk + mul, so gradients keep autocast's usual precision
            a, gate = hidden.chunk(2, dim=-1)
            gated = a * F.gelu(gate)
        return linear(gated, self.proj_out.weight, self.proj_out.bias)


class Block(nn.Module):
    """The weights one or more layers share: attention and feed-forward."""

    def __init__(self, config: DALLEConfig):
        super().__init__()
        self.attn = Attention(config.dim, config.heads, config.dim_head)
        self.ff = FeedForward(config.dim, config.ff_mult)


class DALLE(IncrementalDecodingMixin, nn.Module):
    """DALL-E transformer (see the module docstring for the sequence layout and the decoding API).

    Args:
        config: the model shape (``DALLEConfig``).
    """

    def __init__(self, config: DALLEConfig):
        super().__init__()
        self.config = c = config
        self.text_emb = nn.Embedding(c.text_rows + c.text_seq_len, c.dim)  # row 0 doubles as bos
        if c.text_token_ids is not None:  # tokenizer id -> row; derived from the config, so not in state_dict
            id_to_row = torch.full((c.text_vocab_size,), c.text_rows - 1, dtype=torch.long)  # unknown row
            id_to_row[0] = 0
            id_to_row[torch.tensor(c.text_token_ids)] = torch.arange(1, len(c.text_token_ids) + 1)
            self.register_buffer("text_id_to_row", id_to_row, persistent=False)
        self.image_emb = nn.Embedding(c.image_vocab_size, c.dim)
        if not c.rotary:
            self.text_pos_emb = nn.Embedding(c.num_text, c.dim)
            self.image_row_emb = nn.Embedding(c.image_grid_size, c.dim)
            self.image_col_emb = nn.Embedding(c.image_grid_size, c.dim)
        self.layer_types = c.layer_attn_types()
        self.layer_block_ids = c.layer_block_ids()
        self.blocks = nn.ModuleList(Block(c) for _ in range(max(self.layer_block_ids) + 1))
        self.attn_norms = nn.ModuleList(nn.LayerNorm(c.dim) for _ in range(c.depth))
        self.ff_norms = nn.ModuleList(nn.LayerNorm(c.dim) for _ in range(c.depth))
        self.final_norm = nn.LayerNorm(c.dim)
        self.text_logits_bias = nn.Parameter(torch.zeros(c.text_rows + c.text_seq_len))
        self.image_logits_bias = nn.Parameter(torch.zeros(c.image_vocab_size))
        self._tables: dict = {}  # per device: attention layouts, rotary tables, dense masks (built lazily)
        self._init_weights()

    def _init_weights(self):
        """GPT-2 style: N(0, 0.02) weights, zero biases, residual output projections scaled by depth."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for linear in (block.attn.to_out, block.ff.proj_out):
                nn.init.normal_(linear.weight, std=0.02 / (2 * self.config.depth) ** 0.5)

    def num_parameters(self, unique: bool = True) -> int:
        """Parameter count; ``unique=False`` counts a shared block once per layer that uses it."""
        total = sum(p.numel() for p in self.parameters())
        if unique:
            return total
        block_sizes = [sum(p.numel() for p in block.parameters()) for block in self.blocks]
        return total - sum(block_sizes) + sum(block_sizes[i] for i in self.layer_block_ids)

    # ----- tables -----------------------------------------------------------------------------------
    def tables(self, device: torch.device) -> dict:
        """Attention functions, rotary rotations and dense reference masks on ``device`` (cached)."""
        key = str(device)
        if key not in self._tables:
            # built outside inference mode: a first call under it (Lightning's sanity-check validation) must
            # not leave inference tensors, which training cannot save for backward
            with torch.inference_mode(False):
                self._tables[key] = self._build_tables(device)
        return self._tables[key]

    def _build_tables(self, device: torch.device) -> dict:
        c = self.config
        tables = {"attend": {}, "dense": {}}
        for attn_type in set(self.layer_types):
            tables["attend"][attn_type] = attention_function(
                c.attention_impl, attn_type, c.num_text, c.image_grid_size, c.conv_kernel_size, device)
            tables["dense"][attn_type] = None  # built on first decode
        if c.rotary:
            tables["rotary"] = rotary_tables(c.num_text, c.image_grid_size, c.dim_head, c.rotary_theta).to(device)
        else:
            tables["rotary"] = None
        return tables

    def _dense_mask(self, attn_type: str, device) -> torch.Tensor:
        tables = self.tables(device)
        if tables["dense"][attn_type] is None:
            c = self.config
            mask = dense_mask(attn_type, c.num_text, c.image_grid_size, c.conv_kernel_size)
            tables["dense"][attn_type] = mask.to(device)
        return tables["dense"][attn_type]

    # ----- embedding and heads ----------------------------------------------------------------------
    def text_tokens(self, text: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` caption ids (0 = pad) -> ``[B, T]`` text rows, with per-position pad ids (and, with a
        compact vocabulary, tokenizer ids mapped to their rows)."""
        c = self.config
        if text.shape[1] != c.text_seq_len:
            raise ValueError(f"text has {text.shape[1]} tokens per row, the model expects {c.text_seq_len}")
        if c.text_token_ids is not None:
            text = self.text_id_to_row[text]
        positions = torch.arange(c.text_seq_len, device=text.device)
        return torch.where(text == 0, c.text_rows + positions, text)

    def unknown_text_ids(self, text: torch.Tensor) -> list[int]:
        """The distinct ids of ``text`` that a compact vocabulary has no row for (they all read as one
        "unknown" word); empty without a compact vocabulary."""
        if self.config.text_token_ids is None:
            return []
        unknown = text[self.text_id_to_row.to(text.device)[text] == self.config.text_rows - 1]
        return sorted(set(unknown.tolist()))

    def _embed_text(self, text_ids: torch.Tensor) -> torch.Tensor:
        """Remapped text ids ``[B, T]`` -> embedded text part (bos + text) ``[B, T + 1, dim]``."""
        bos = torch.zeros_like(text_ids[:, :1])
        h = self.text_emb(torch.cat([bos, text_ids], dim=1))
        if not self.config.rotary:
            h = h + self.text_pos_emb.weight
        return h

    def _embed_image(self, image: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Codes ``[B, n]`` for grid cells ``start .. start+n-1`` -> ``[B, n, dim]``."""
        h = self.image_emb(image)
        if not self.config.rotary:
            cells = torch.arange(start, start + image.shape[1], device=image.device)
            g = self.config.image_grid_size
            h = h + self.image_row_emb(cells // g) + self.image_col_emb(cells % g)
        return h

    def _text_logits(self, h):
        return linear(self.final_norm(h), self.text_emb.weight, self.text_logits_bias)

    def _image_logits(self, h):
        return linear(self.final_norm(h), self.image_emb.weight, self.image_logits_bias)

    # ----- layers -----------------------------------------------------------------------------------
    def _branches(self, attend):
        """Per layer, (f, g) callables and the parameters each reads; ``attend(layer, block, x)`` is f's core."""
        layers, params = [], []
        for i, block_id in enumerate(self.layer_block_ids):
            block, attn_norm, ff_norm = self.blocks[block_id], self.attn_norms[i], self.ff_norms[i]

            def f(x, i=i, block=block, attn_norm=attn_norm):
                return attend(i, block, attn_norm(x))

            def g(x, block=block, ff_norm=ff_norm):
                return block.ff(ff_norm(x))

            layers.append((f, g))
            params.append((list(attn_norm.parameters()) + list(block.attn.parameters()),
                           list(ff_norm.parameters()) + list(block.ff.parameters())))
        return layers, params

    def _run_layers(self, h, attend, allow_recompute: bool = True):
        layers, params = self._branches(attend)
        if self.config.reversible:
            run = reversible_forward if allow_recompute else lambda a, b, lay, _: reversible_forward_eager(a, b, lay)
            y1, y2 = run(h, h, layers, params)
            return (y1 + y2) / 2
        for f, g in layers:
            h = h + f(h)
            h = h + g(h)
        return h

    def hidden_states(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[B, T + 1 + N, dim]`` (before the final norm) of the whole sequence."""
        c = self.config
        if image.shape[1] != c.num_image:
            raise ValueError(f"image has {image.shape[1]} codes per row, the model expects {c.num_image}")
        h = torch.cat([self._embed_text(self.text_tokens(text)), self._embed_image(image)], dim=1)
        tables = self.tables(h.device)
        def attend(i, block, x):
            return block.attn(x, tables["attend"][self.layer_types[i]], tables["rotary"])

        return self._run_layers(h, attend)

    def forward(self, text: torch.Tensor, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits for a batch of captions and images.

        Args:
            text: ``LongTensor[B, text_seq_len]`` caption token ids, 0 = pad.
            image: ``LongTensor[B, image_grid_size ** 2]`` image codes in raster order.

        Returns:
            ``text_logits [B, T, text_rows + T]`` (position i predicts the remapped text id i) and
            ``image_logits [B, N, image_vocab_size]`` (position j predicts code j).
        """
        t = self.config.text_seq_len
        h = self.hidden_states(text, image)
        return self._text_logits(h[:, :t]), self._image_logits(h[:, t : t + self.config.num_image])

    def compute_loss(self, text: torch.Tensor, image: torch.Tensor) -> dict[str, torch.Tensor]:
        """Cross-entropy losses: ``dict(loss, text_loss, image_loss)`` (see ``DALLEConfig.image_loss_weight``)."""
        c = self.config
        h = self.hidden_states(text, image)
        # the logits never leave the loss (a fused linear + cross-entropy reuses their buffer in backward)
        text_loss = linear_cross_entropy(self.final_norm(h[:, : c.text_seq_len]), self.text_emb.weight,
                                         self.text_logits_bias, self.text_tokens(text))
        image_loss = linear_cross_entropy(self.final_norm(h[:, c.text_seq_len : c.text_seq_len + c.num_image]),
                                          self.image_emb.weight, self.image_logits_bias, image)
        w = self.config.image_loss_weight
        return {"loss": (text_loss + w * image_loss) / (1 + w), "text_loss": text_loss, "image_loss": image_loss}

