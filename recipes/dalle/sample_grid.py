"""Pictures while the run trains: a grid of samples of fixed prompts at each validation.

``SampleGrid`` (named in ``configs/dalle_tiny.yaml``) draws ``samples_per_prompt`` images of each prompt with the
model's key/value-cache decoding, writes ``<default_root_dir>/samples/step_<N>.png`` (one row per prompt, N = local
steps so far) and hands the grid to the loggers that take images: TensorBoard (``add_image``) and W&B
(``log_image``). The noise is the same at every validation (a fixed seed), so successive grids differ only by what
the model learned.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from torchvision.utils import make_grid, save_image
from typing_extensions import override

from recipes.dalle.tokenizer import TextTokenizer

DEFAULT_PROMPTS = (
    "a small blue triangle",
    "a big red circle",
    "a green square to the left of a yellow cross",
    "a purple circle above a black triangle",
)


class SampleGrid(Callback):
    """Sample a small grid of fixed prompts at each validation, save it as a PNG and log it.

    Args:
        prompts: the captions, one grid row each.
        samples_per_prompt: images per prompt (grid columns).
        temperature: logit temperature of the draws (0: greedy).
        top_k: draw only among the k most likely codes (None: all).
        seed: seed of the draws' generator, the same at every validation.
        dirname: folder under the Trainer's ``default_root_dir`` the PNGs go to.
        cell_padding: pixels of white between two images of the grid.
    """

    def __init__(self, prompts: Sequence[str] = DEFAULT_PROMPTS, samples_per_prompt: int = 2,
                 temperature: float = 1.0, top_k: Optional[int] = None, seed: int = 0, dirname: str = "samples",
                 cell_padding: int = 2):
        if not prompts or samples_per_prompt < 1:
            raise ValueError(f"SampleGrid needs at least one prompt and samples_per_prompt >= 1, got {len(prompts)} "
                             f"prompts and samples_per_prompt={samples_per_prompt}")
        if temperature < 0:
            raise ValueError(f"SampleGrid's temperature must be >= 0, got {temperature}")
        self.prompts = list(prompts)
        self.samples_per_prompt = samples_per_prompt
        self.temperature = temperature
        self.top_k = top_k
        self.seed = seed
        self.dirname = dirname
        self.cell_padding = cell_padding
        self.paths: list[Path] = []  # the PNGs written, in order
        self.seconds: list[float] = []  # the wall time each grid took (sampling, decoding, writing, logging)
        self.cpu_seconds: list[float] = []  # the process's CPU time (all threads) each grid took: steadier under load
        self._codec = None
        self._tokenizer = None

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        start, start_cpu = time.perf_counter(), time.process_time()
        grid = self.sample_grid(pl_module)
        path = Path(trainer.default_root_dir) / self.dirname / f"step_{trainer.global_step}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_image(grid, path)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image("samples", grid, global_step=trainer.global_step)
            elif isinstance(logger, WandbLogger):
                logger.log_image("samples", [str(path)], step=trainer.global_step, caption=[" | ".join(self.prompts)])
        self.paths.append(path)
        self.seconds.append(time.perf_counter() - start)
        self.cpu_seconds.append(time.process_time() - start_cpu)

    @torch.no_grad()
    def sample_grid(self, pl_module: pl.LightningModule) -> torch.Tensor:
        """The grid image ``[3, H, W]`` in [0, 1]: ``samples_per_prompt`` draws of each prompt, a row per prompt."""
        model = pl_module.model
        config = model.config
        device = model.image_emb.weight.device
        if self._tokenizer is None or self._tokenizer.text_seq_len != config.text_seq_len:
            self._tokenizer = TextTokenizer(config.text_seq_len)
        text = self._tokenizer(
            [p for p in self.prompts for _ in range(self.samples_per_prompt)]).to(device)
        generator = torch.Generator(device=device).manual_seed(self.seed)
        was_training = model.training
        model.eval()
        try:
            codes = torch.zeros(text.shape[0], config.num_image, dtype=torch.long, device=device)
            cache = model.new_cache(text.shape[0])
            logits = model.prefill(text, cache)
            for j in range(config.num_image):
                codes[:, j] = self._draw(logits.float(), generator)
                if j + 1 < config.num_image:
                    logits = model.decode_step(codes[:, j], cache)
        finally:
            model.train(was_training)
        if self._codec is None:
            self._codec = pl_module.image_codec()
        images = self._codec.decode(codes.cpu().view(-1, config.image_grid_size, config.image_grid_size))
        return make_grid(images.float().clamp(0, 1), nrow=self.samples_per_prompt, padding=self.cell_padding,
                         pad_value=1.0)

    def _draw(self, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if self.temperature == 0:
            return logits.argmax(-1)
        logits = logits / self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
