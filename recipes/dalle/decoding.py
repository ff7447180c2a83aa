"""Incremental (key/value cache) decoding for the DALL-E model: prefill bos + text, then one code at a time.

Usage (``model`` is a ``recipes.dalle.model.DALLE``; T = text_seq_len, N = image_grid_size ** 2)::

    cache = model.new_cache(batch_size)
    logits = model.prefill(text, cache)              # [B, image_vocab_size]: logits of code_0
    for j in range(N - 1):
        code = sample(logits)                         # LongTensor[B], the code of grid cell j
        logits = model.decode_step(code, cache)      # logits of code_{j+1} given text and code_0 .. code_j
    # the code of the last cell (sampled from the last logits) needs no forward pass

Every layer type keeps all keys/values; a step attends to the cached positions its layer's mask allows
(the row of ``attention.dense_mask`` for the current position), so the logits equal the full forward's.
Reversible layers run as a plain forward of the same coupling here (no gradients are needed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recipes.dalle.attention import LayerCache


@dataclass
class DALLECache:
    """Per-layer keys/values ``[B, heads, T + 1 + N, dim_head]``; ``length`` = sequence positions filled."""

    layers: list[LayerCache]
    length: int = 0
    batch_size: int = 0


class IncrementalDecodingMixin:
    """``new_cache`` / ``prefill`` / ``decode_step`` for ``DALLE`` (which provides the embedding/layer helpers)."""

    def new_cache(self, batch_size: int, device=None, dtype=None) -> DALLECache:
        """Empty key/value cache for ``batch_size`` sequences (defaults: the model's device and dtype)."""
        c = self.config
        reference = self.image_emb.weight
        device, dtype = device or reference.device, dtype or reference.dtype
        shape = (batch_size, c.heads, c.num_text + c.num_image, c.dim_head)
        layers = [LayerCache(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
                  for _ in range(c.depth)]
        return DALLECache(layers=layers, length=0, batch_size=batch_size)

    def _rotary_at(self, device, start: int, stop: int):
        rotations = self.tables(device)["rotary"]
        return None if rotations is None else rotations[start:stop]

    @torch.no_grad()
    def prefill(self, text: torch.Tensor, cache: DALLECache) -> torch.Tensor:
        """Run bos + text through the model, filling ``cache``.

        Args:
            text: ``LongTensor[B, text_seq_len]`` caption ids (0 = pad).
            cache: a fresh cache from ``new_cache(B)``.

        Returns:
            logits of the first image code, ``[B, image_vocab_size]``.
        """
        if cache.length != 0:
            raise ValueError("prefill needs an empty cache (from new_cache)")
        h = self._embed_text(self.text_tokens(text))
        rotations = self._rotary_at(h.device, 0, h.shape[1])

        def attend(i, block, x):
            return block.attn.forward_text(x, rotations, cache.layers[i])

        h = self._run_layers(h, attend, allow_recompute=False)
        cache.length = h.shape[1]
        return self._image_logits(h[:, -1])

    @torch.no_grad()
    def decode_step(self, code: torch.Tensor, cache: DALLECache) -> torch.Tensor:
        """Feed the next image code and return the logits of the code after it.

        Args:
            code: ``LongTensor[B]``, the code of grid cell ``j = cache.length - (text_seq_len + 1)``.
            cache: a cache filled by ``prefill`` and earlier ``decode_step`` calls (updated in place).

        Returns:
            logits of code ``j + 1``, ``[B, image_vocab_size]``.
        """
        c = self.config
        position = cache.length
        cell = position - c.num_text
        if cell < 0:
            raise ValueError("call prefill(text, cache) before decode_step")
        if cell >= c.num_image - 1:
            raise ValueError(f"all {c.num_image} codes are known after {c.num_image - 1} decode steps; nothing left to predict")
        h = self._embed_image(code.view(-1, 1), start=cell)
        rotations = self._rotary_at(h.device, position, position + 1)

        def attend(i, block, x):
            mask_row = self._dense_mask(self.layer_types[i], x.device)[position, : position + 1]
            return block.attn.forward_step(x, position, mask_row, cache.layers[i], rotations)

        h = self._run_layers(h, attend, allow_recompute=False)
        cache.length = position + 1
        return self._image_logits(h[:, -1])
