"""What to estimate: a named published model, a bare parameter count, or a LightningCLI config.

A :class:`ModelSource` carries two parameter inventories (with parameter sharing as the model has it,
and as if every shared use had its own copy) and, when known, the transformer's :class:`ModelShape`.

Configs are counted exactly: the ``model`` entry of the YAML (``class_path`` + ``init_args``, as
LightningCLI writes it) is instantiated on the meta device, so even a multi-billion-parameter model costs
no memory. The module describes its shape through the ``memory_profile()`` protocol (see
:class:`~lightning_swarm.memory.estimate.ModelShape`): the LightningModule itself or any of its
submodules may define it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from lightning_swarm.memory.inputs import ModelShape, ParameterInventory
from lightning_swarm.recipe_config import read_recipe_config


@dataclass(frozen=True)
class ModelSource:
    """A model to estimate.

    Args:
        name: what to call it in the report.
        shared: trainable parameters as stored, shared weights counted once.
        unshared: trainable parameters if every shared use had its own copy.
        shape: the transformer's shape, or None when only a count is known.
        note: where the figures come from.
    """

    name: str
    shared: ParameterInventory
    unshared: ParameterInventory
    shape: ModelShape | None
    note: str = ""


@dataclass(frozen=True)
class PublishedModel:
    """Published parameter count and shape of a well-known model."""

    title: str
    parameters: int
    shape: ModelShape
    source: str


# Parameter counts and shapes as published (paper tables or released configs).
PUBLISHED_MODELS: dict[str, PublishedModel] = {
    "bert-large": PublishedModel(
        "BERT-large", 340_000_000,
        ModelShape(dim=1024, depth=24, heads=16, seq_len=512, vocab_size=30522, dropout=True),
        "Devlin et al. 2019: L=24, H=1024, A=16, 340M; 512 tokens, 30522 WordPiece vocab",
    ),
    "t5-11b": PublishedModel(
        "T5-11B", 11_000_000_000,
        ModelShape(dim=1024, depth=48, heads=128, attn_dim=128 * 128, ff_dim=65536, seq_len=512,
                   vocab_size=32128, dropout=True),
        "Raffel et al. 2020: 24+24 layers, d_model 1024, d_ff 65536, 128 heads of 128, 11B; "
        "the encoder-decoder is counted as 48 layers over 512 tokens (cross-attention not modelled)",
    ),
    "gpt2-xl": PublishedModel(
        "GPT-2 1.5B", 1_542_000_000,
        ModelShape(dim=1600, depth=48, heads=25, seq_len=1024, vocab_size=50257, dropout=True),
        "Radford et al. 2019: 48 layers, d_model 1600, 1542M; 25 heads, 1024 tokens (released config)",
    ),
    "gpt3": PublishedModel(
        "GPT-3 175B", 175_000_000_000,
        ModelShape(dim=12288, depth=96, heads=96, seq_len=2048, vocab_size=50257),
        "Brown et al. 2020, table 2.1: 96 layers, d_model 12288, 96 heads of 128, 2048 tokens, 175.0B",
    ),
    "gpt-j": PublishedModel(
        "GPT-J 6B", 6_053_381_344,
        ModelShape(dim=4096, depth=28, heads=16, ff_dim=16384, seq_len=2048, vocab_size=50400),
        "Wang & Komatsuzaki 2021 (model card): 28 layers, d_model 4096, d_ff 16384, 16 heads, "
        "2048 tokens, 6,053,381,344 parameters",
    ),
    "dalle-12b": PublishedModel(
        "DALL-E 12B", 12_000_000_000,
        ModelShape(dim=3968, depth=64, heads=62, seq_len=256 + 1024, vocab_size=16384,
                   logits_per_sample=256 * 16384 + 1024 * 8192),
        "Ramesh et al. 2021: 64 layers, d_model 3968, 62 heads of 64, 256 text + 1024 image tokens, "
        "text vocab 16384, image codebook 8192, 12B",
    ),
}

_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_parameter_count(text: str) -> int | None:
    """'1.5B', '350M', '6e9', '123456' -> an int; None if ``text`` is not a count."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    if match is None:
        return None
    return int(round(float(match.group(1)) * _SUFFIXES[match.group(2)]))


def named_model(key: str, unique_layers: int | None = None) -> ModelSource:
    """A published model; ``unique_layers`` models ALBERT-style sharing (that many distinct layers)."""
    if key not in PUBLISHED_MODELS:
        raise ValueError(f"unknown model {key!r}; choose one of {sorted(PUBLISHED_MODELS)}")
    model = PUBLISHED_MODELS[key]
    largest = model.shape.largest_tensor_numel()
    unshared = ParameterInventory.approximate(model.parameters, largest)
    shared = unshared
    if unique_layers is not None:
        if not 1 <= unique_layers <= model.shape.depth:
            raise ValueError(f"--unique-layers must be between 1 and {model.shape.depth} for {key}")
        saved = (model.shape.depth - unique_layers) * model.shape.layer_numel()
        shared = ParameterInventory.approximate(model.parameters - saved, largest)
    return ModelSource(model.title, shared, unshared, model.shape, model.source)


def raw_count(numel: int, shape: ModelShape | None = None) -> ModelSource:
    """A bare parameter count (with a shape if the caller gave one)."""
    if numel <= 0:
        raise ValueError(f"a parameter count must be positive, got {numel}")
    largest = shape.largest_tensor_numel() if shape is not None else None
    inventory = ParameterInventory.approximate(numel, min(largest, numel) if largest else None)
    return ModelSource("bare parameter count", inventory, inventory, shape, "a bare parameter count")


def count_module(module: nn.Module) -> tuple[ParameterInventory, ParameterInventory]:
    """Exact (shared, unshared) inventories of a module's parameters.

    Shared weights are the same Parameter object reached from several places (tied embeddings, a layer
    reused at several depths): ``named_parameters()`` yields them once, ``remove_duplicate=False`` yields
    every use, which is what the model would hold without sharing.
    """
    shared = list(module.parameters())
    every_use = [p for _, p in module.named_parameters(remove_duplicate=False)]
    buffer_bytes = sum(b.numel() * b.element_size() for b in module.buffers())

    def inventory(ps):
        return ParameterInventory.from_sizes(
            (p.numel() for p in ps if p.requires_grad),
            frozen_numel=sum(p.numel() for p in ps if not p.requires_grad),
            buffer_bytes=buffer_bytes,
        )

    return inventory(shared), inventory(every_use)


def module_shape(module: nn.Module) -> ModelShape | None:
    """The first ``memory_profile()`` found on the module or its submodules, as a ModelShape."""
    for sub in module.modules():
        profile = getattr(sub, "memory_profile", None)
        if callable(profile):
            return ModelShape.from_profile(profile())
    return None


def from_config(path: str | Path, model_class: str | None = None) -> ModelSource:
    """Count a LightningCLI YAML config's model exactly on the meta device."""
    config = read_recipe_config(path, model_class)
    with torch.device("meta"):
        module = config.build_model()
    shared, unshared = count_module(module)
    path = Path(path)
    return ModelSource(f"{path.name} ({type(module).__name__})", shared, unshared, module_shape(module),
                       f"counted exactly from {path} on the meta device")


def resolve(spec: str, model_class: str | None = None, unique_layers: int | None = None,
            shape: ModelShape | None = None) -> ModelSource:
    """Turn the command line's MODEL argument into a ModelSource.

    ``spec`` is a published model name, a parameter count ('1.5B', '350M', '6e9') or a YAML config path.
    ``shape`` is used for a bare count (there is nothing else to read it from).
    """
    key = spec.lower()
    if key in PUBLISHED_MODELS:
        return named_model(key, unique_layers)
    if unique_layers is not None:
        raise ValueError("--unique-layers applies to published models; a config's sharing is read from the model")
    numel = parse_parameter_count(spec)
    if numel is not None:
        return raw_count(numel, shape)
    if Path(spec).suffix in (".yaml", ".yml") or Path(spec).is_file():
        return from_config(spec, model_class)
    raise ValueError(
        f"{spec!r} is not a published model ({', '.join(sorted(PUBLISHED_MODELS))}), "
        "a parameter count (e.g. 1.5B, 350M, 6e9) or a YAML config file"
    )


def source_with_shape(source: ModelSource, **overrides) -> ModelSource:
    """Apply command-line shape overrides (non-None values) to a source that has a shape."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if not overrides or source.shape is None:
        return source
    return replace(source, shape=replace(source.shape, **overrides))


def describe_count(numel: int) -> str:
    """1_542_000_000 -> '1.54 B'."""
    if numel < 1000:
        return str(numel)
    exponent = min(int(math.log10(numel)) // 3, 4)
    return f"{numel / 10 ** (3 * exponent):.3g} {['', 'K', 'M', 'B', 'T'][exponent]}"
