"""Does the compact text vocabulary change what the tiny DALL-E learns early? Validation losses side by side.

Trains the recipe's module (configs/dalle_tiny.yaml, built as the CLI builds it, with its optimizer and LR
schedule stepped per batch as for a lone peer) with the full CLIP BPE vocabulary and with the compact shapes
vocabulary, from the same initial weights (the compact model takes the full one's rows) on the same shapes batches, and prints the validation image and text losses every
``--every`` steps (a JSON line each, as they come). Both variants run at once, one thread each. A short probe, not the recipe's quality figures
(those come from `inference.evaluate` after a full fit).

    python tests/benchmarks/probe_tiny_vocabulary.py [--steps 100] [--every 25]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paths import REPO  # noqa: E402

VOCABULARIES = ("full", "shapes")


def _batches(tokenizer, split: str, start: int, count: int, batch_size: int):
    import torch

    from recipes.shapes import generate_example

    for first in range(start, start + count * batch_size, batch_size):
        examples = [generate_example(i, split) for i in range(first, first + batch_size)]
        text = tokenizer([caption for caption, _, _ in examples])
        image = torch.stack([torch.from_numpy(codes.astype("int64")).flatten() for _, codes, _ in examples])
        yield text, image


def _copy_full_init(recipe, compact) -> None:
    """Load into `compact` the initial weights of the full-vocabulary model of the same seed (its rows of bos, the
    listed ids and the pads; the unknown row stays as initialised)."""
    import torch

    torch.manual_seed(0)
    recipe.model_init_args["text_vocabulary"] = "full"
    state = recipe.build_model().model.state_dict()
    config = compact.config
    rows = torch.tensor([0, *config.text_token_ids])
    pads = torch.arange(config.text_vocab_size, config.text_vocab_size + config.text_seq_len)
    own = compact.model.state_dict()
    for name in ("text_emb.weight", "text_logits_bias"):
        unknown = own[name][config.text_rows - 1 : config.text_rows]
        state[name] = torch.cat([state[name][rows], unknown, state[name][pads]])
    compact.model.load_state_dict(state)


def worker(vocabulary: str, steps: int, every: int, val_batches: int) -> None:
    import torch

    from lightning_swarm.recipe_config import read_recipe_config
    from recipes.dalle.tokenizer import TextTokenizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    recipe = read_recipe_config(REPO / "configs" / "dalle_tiny.yaml")
    recipe.model_init_args["text_vocabulary"] = vocabulary
    module = recipe.build_model()
    if vocabulary == "shapes":  # start from the full model's initial weights: only the vocabulary differs
        _copy_full_init(recipe, module)
    optimizers = module.configure_optimizers()
    optimizer, scheduler = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
    batch_size = recipe.data_init_args["batch_size"]
    tokenizer = TextTokenizer(module.config.text_seq_len)
    validation = list(_batches(tokenizer, "val", 0, val_batches, batch_size))
    accumulate = max(1, recipe.strategy["target_batch_size"] // batch_size)  # local steps per global step alone

    def validate(step: int, start: float) -> None:
        with torch.no_grad():
            losses = [module.model.compute_loss(text, image) for text, image in validation]
        print(json.dumps({"vocabulary": vocabulary, "step": step, "cpu_s": time.process_time() - start,
                          "val_image_loss": sum(float(x["image_loss"]) for x in losses) / len(losses),
                          "val_text_loss": sum(float(x["text_loss"]) for x in losses) / len(losses)}), flush=True)

    start = time.process_time()
    for step, (text, image) in enumerate(_batches(tokenizer, "train", 0, steps, batch_size), 1):
        (module.model.compute_loss(text, image)["loss"] / accumulate).backward()
        if step % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        if step % every == 0:
            validate(step, start)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="local training steps (batches)")
    parser.add_argument("--every", type=int, default=25, help="validate every this many steps")
    parser.add_argument("--val-batches", type=int, default=4, help="validation batches (val split)")
    parser.add_argument("--worker", choices=VOCABULARIES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.every, args.val_batches)
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    # each worker prints a JSON line per validation as it goes (one thread each, so both run at once)
    processes = [subprocess.Popen([sys.executable, __file__, "--worker", v, "--steps", str(args.steps), "--every",
                                   str(args.every), "--val-batches", str(args.val_batches)], cwd=REPO, env=env)
                 for v in VOCABULARIES]
    if any(p.wait() != 0 for p in processes):
        raise RuntimeError("a probe worker failed")

if __name__ == "__main__":
    main()
