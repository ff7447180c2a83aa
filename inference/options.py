"""The command-line options ``inference.generate`` and ``inference.evaluate`` share: one definition of each.

The two tools sample the same way but for different ends, so three defaults differ and are passed in:
``generate`` draws pictures to look at (many candidates, top-k 256 for cleaner samples), ``evaluate`` measures
the model's own distribution (no top-k filter) on many captions (fewer candidates each).
"""

from __future__ import annotations

import argparse

import torch

# where `python -m recipes.clip fit --config configs/clip_tiny.yaml` exports the offline reranker
DEFAULT_CLIP = "checkpoints/clip_tiny"


def add_sampling_arguments(parser: argparse.ArgumentParser, *, checkpoint_help: str, num_candidates: int,
                           batch_size: int, top_k: int) -> None:
    """Add the DALL-E checkpoint, reranker, sampling and device options to ``parser``.

    Args:
        parser: the tool's parser.
        checkpoint_help: what the tool expects of the checkpoint.
        num_candidates: default images sampled per caption.
        batch_size: default images sampled together.
        top_k: default top-k filter (0 = off).
    """
    parser.add_argument("--checkpoint", required=True,
                        help=f"{checkpoint_help}: a directory or URL (hf://owner/repo, any fsspec URL) of checkpoints "
                             "as SwarmCheckpoint and the monitor write them, or an old Lightning .ckpt file")
    parser.add_argument("--allow-model-package", dest="allow_model_packages", action="append", default=[],
                        metavar="PACKAGE",
                        help="a package besides the project's recipes whose DALL-E classes a checkpoint may name "
                             "(its code is imported and runs: only packages you trust); repeat for several")
    parser.add_argument("--authority-public-key", default=None,
                        help="the run's authority public key (ssh-rsa ... or a file holding it): only checkpoints "
                             "its monitor signed load")
    parser.add_argument("--clip-model", default=DEFAULT_CLIP,
                        help="local CLIP directory (open_clip local-dir format) or open_clip name such as ViT-B-32")
    parser.add_argument("--clip-pretrained", default=None,
                        help="pretrained tag (e.g. openai) or weights file, with an open_clip name")
    parser.add_argument("--num-candidates", type=int, default=num_candidates, help="images sampled per caption")
    parser.add_argument("--batch-size", type=int, default=batch_size, help="images sampled together")
    parser.add_argument("--temperature", type=float, default=1.0, help="logit temperature (0 = greedy)")
    parser.add_argument("--top-k", type=int, default=top_k, help="sample among the k most likely codes (0 = all)")
    parser.add_argument("--top-p", type=float, default=None, help="then among the nucleus of this mass, e.g. 0.75")
    parser.add_argument("--guidance-scale", type=float, default=1.0,
                        help="classifier-free guidance scale (1 = off; unconditional pass on all-pad text); "
                             "needs a DALL-E trained with model.text_dropout > 0")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
