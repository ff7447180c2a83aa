"""Autoregressive sampling of image codes from a DALL-E, with or without the key/value cache.

    codes = sample_codes(model, text, top_k=256, temperature=1.0, generator=torch.Generator().manual_seed(0))

With the cache (the default) the caption is run once (`model.prefill`) and every further code costs one
position (`model.decode_step`); without it every code re-runs the whole sequence, as DALLE-pytorch does.
Both draw from the same logits with the same generator calls, so the same seed gives the same codes.

Classifier-free guidance: with `guidance_scale` s != 1 the batch is doubled with all-pad captions (the
unconditional pass, `recipes.dalle.model.unconditional_text`, the captions `text_dropout` trains on) and the
logits become `uncond + s * (cond - uncond)`. The caption tensor passed in is never modified (DALLE-pytorch's
`generate_images` zeroed the caller's prompt in place to build its unconditional batch, so a second call sampled
unconditionally).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inference.filtering import sample_from_logits
from recipes.dalle.model import unconditional_text


def guided_logits(logits: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Split logits of a doubled batch [2B, V] (conditional rows first) into guided logits [B, V]."""
    cond, uncond = logits.chunk(2)
    return uncond + guidance_scale * (cond - uncond)


@torch.no_grad()
def sample_codes(
    model: torch.nn.Module,
    text: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    guidance_scale: float = 1.0,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    on_step: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Sample the image codes of one image per caption row.

    Args:
        model: a `recipes.dalle.model.DALLE` (forward(text, image) and new_cache/prefill/decode_step).
        text: LongTensor [B, text_seq_len] caption ids (0 = pad); left untouched.
        temperature: logit temperature (0: greedy).
        top_k: sample only among the k most likely codes (None: all).
        top_p: then only among the nucleus of mass p (None: all).
        guidance_scale: classifier-free guidance scale s; 1 disables guidance (no unconditional pass).
        use_cache: decode with the key/value cache (fast); False re-runs the full sequence per code.
        generator: torch.Generator on the model's device for reproducible draws.
        on_step: called with the index of each code once it is sampled (progress reporting).
    Returns:
        LongTensor [B, N] of image codes in raster order (N = image_grid_size ** 2).
    """
    config = model.config
    num_codes = config.num_image
    guided = guidance_scale != 1.0
    # a new tensor for the unconditional rows: the caller's `text` is never written to
    batch_text = torch.cat([text, unconditional_text(text)]) if guided else text

    def next_code(logits: torch.Tensor) -> torch.Tensor:
        if guided:
            logits = guided_logits(logits, guidance_scale)
        return sample_from_logits(logits, temperature, top_k, top_p, generator)

    codes = torch.zeros(text.shape[0], num_codes, dtype=torch.long, device=text.device)
    if use_cache:
        cache = model.new_cache(batch_text.shape[0])
        logits = model.prefill(batch_text, cache)
        for j in range(num_codes):
            codes[:, j] = next_code(logits)
            if on_step is not None:
                on_step(j)
            if j < num_codes - 1:
                logits = model.decode_step(torch.cat([codes[:, j]] * (2 if guided else 1)), cache)
        return codes
    for j in range(num_codes):
        # causal attention: position j's logits depend only on codes < j, so the zeros after j are ignored
        image = torch.cat([codes] * (2 if guided else 1))
        logits = model(batch_text, image)[1][:, j]
        codes[:, j] = next_code(logits)
        if on_step is not None:
            on_step(j)
    return codes
