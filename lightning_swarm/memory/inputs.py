"""What the memory formulas take: the parameters, the transformer's shape and the training setup.

:class:`ParameterInventory` says how many parameter elements the optimizer sees and how they split into
tensors; :class:`ModelShape` is the transformer's shape (and the ``memory_profile()`` protocol a module uses
to describe itself); :class:`TrainingSetup` is precision, optimizer, offloading, checkpointing, batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

PRECISIONS = ("fp32", "fp16-mixed", "bf16-mixed")
OPTIMIZERS = ("adam", "lamb")
ATTENTIONS = ("naive", "sdpa")
DEVICES = ("cuda", "cpu")

BNB_BLOCK_SIZE = 256  # elements per fp32 absmax in bitsandbytes' blockwise 8-bit optimizer states
BNB_MIN_8BIT_SIZE = 4096  # tensors with fewer elements keep 32-bit states (bitsandbytes' min_8bit_size)
BNB_QUANTIZATION_MAP_BYTES = 2 * 256 * 4  # the two fp32 quantization maps, shared by all tensors


@dataclass(frozen=True)
class ParameterInventory:
    """The trainable parameters as the optimizer sees them, plus frozen weights and buffers.

    Args:
        numel: trainable parameter elements.
        num_tensors: trainable parameter tensors (0 when unknown, e.g. for a named model).
        small_numel: elements in trainable tensors with fewer than 4096 elements (8-bit optimizers keep
            those in 32 bits).
        absmax_blocks: fp32 absmax scales an 8-bit optimizer keeps per moment: the sum over the large
            tensors of ceil(elements / 256).
        largest_numel: elements of the largest trainable tensor (sets per-tensor optimizer temporaries).
        frozen_numel: parameter elements that do not train (weights only: no gradient, no state).
        buffer_bytes: bytes of registered buffers (masks, rotary tables...), kept with the weights.
    """

    numel: int
    num_tensors: int = 0
    small_numel: int = 0
    absmax_blocks: int = 0
    largest_numel: int = 0
    frozen_numel: int = 0
    buffer_bytes: int = 0

    @classmethod
    def from_sizes(
        cls, sizes: Iterable[int], frozen_numel: int = 0, buffer_bytes: int = 0
    ) -> "ParameterInventory":
        """Exact inventory from the element counts of each trainable tensor."""
        sizes = [int(n) for n in sizes]
        large = [n for n in sizes if n >= BNB_MIN_8BIT_SIZE]
        return cls(
            numel=sum(sizes),
            num_tensors=len(sizes),
            small_numel=sum(sizes) - sum(large),
            absmax_blocks=sum(math.ceil(n / BNB_BLOCK_SIZE) for n in large),
            largest_numel=max(sizes, default=0),
            frozen_numel=frozen_numel,
            buffer_bytes=buffer_bytes,
        )

    @classmethod
    def approximate(cls, numel: int, largest_numel: int | None = None) -> "ParameterInventory":
        """Inventory from a bare count: one block scale per 256 elements, no small tensors."""
        numel = int(numel)
        return cls(
            numel=numel,
            absmax_blocks=math.ceil(numel / BNB_BLOCK_SIZE),
            largest_numel=int(largest_numel if largest_numel is not None else numel),
        )


@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder/encoder transformer stack, enough to estimate its activations.

    This is also the protocol a LightningModule (or any of its submodules) follows to describe itself to
    the calculator: a ``memory_profile()`` method returning a dict with these keys (or a ModelShape);
    ``dim_head`` (per-head width) may stand for ``attn_dim`` and ``ff_mult`` (x dim) for ``ff_dim``.

    Args:
        dim: model width h (residual stream size).
        depth: number of transformer layers L (an encoder-decoder counts encoder + decoder layers).
        heads: attention heads a.
        seq_len: tokens per sample s.
        attn_dim: total width of queries/keys/values, heads * dim_head (default: dim).
        ff_dim: hidden width of the feed-forward block (default: 4 * dim).
        glu: the feed-forward is gated (GEGLU/SwiGLU: first projection to 2 * ff_dim).
        vocab_size: output vocabulary; logits per sample default to seq_len * vocab_size.
        logits_per_sample: logit elements per sample when positions have different vocabularies
            (e.g. text positions over the text vocabulary and image positions over the image codebook).
        dropout: the model applies dropout (masks and dropped copies are kept for the backward pass).
        attention: "naive" materialises the (s x s) attention matrix per head; "sdpa" is a fused
            attention kernel (torch's scaled_dot_product_attention) that keeps only the output and the
            log-sum-exp.
        reversible: the model is built with reversible layers (as configured; the calculator can override).
        checkpointing: the model checkpoints its layers (as configured; the calculator can override).
    """

    dim: int
    depth: int
    heads: int
    seq_len: int
    attn_dim: int | None = None
    ff_dim: int | None = None
    glu: bool = False
    vocab_size: int = 0
    logits_per_sample: int | None = None
    dropout: bool = False
    attention: str = "naive"
    reversible: bool = False
    checkpointing: bool = False

    def __post_init__(self):
        for name in ("dim", "depth", "heads", "seq_len"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelShape.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"ModelShape.attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.attn_dim is None:
            object.__setattr__(self, "attn_dim", self.dim)
        if self.ff_dim is None:
            object.__setattr__(self, "ff_dim", 4 * self.dim)

    @classmethod
    def from_profile(cls, profile: "ModelShape | dict") -> "ModelShape":
        """Build from what a module's ``memory_profile()`` returned; unknown keys are an error."""
        if isinstance(profile, ModelShape):
            return profile
        profile = dict(profile)
        # conveniences: per-head width and feed-forward multiplier instead of total widths
        if "dim_head" in profile:
            profile.setdefault("attn_dim", int(profile["heads"]) * int(profile.pop("dim_head")))
        if "ff_mult" in profile:
            profile.setdefault("ff_dim", int(round(int(profile["dim"]) * float(profile.pop("ff_mult")))))
        known = set(cls.__dataclass_fields__)
        unknown = set(profile) - known
        if unknown:
            raise ValueError(
                f"memory_profile() returned unknown keys {sorted(unknown)}; known keys: {sorted(known | {'dim_head', 'ff_mult'})}"
            )
        for flag in ("glu", "dropout", "reversible", "checkpointing"):
            if flag in profile:
                profile[flag] = bool(profile[flag])
        return cls(**profile)

    def logits_elements(self) -> int:
        """Logit elements per sample."""
        if self.logits_per_sample is not None:
            return int(self.logits_per_sample)
        return self.seq_len * self.vocab_size

    def layer_numel(self) -> int:
        """Weights of one layer (attention + feed-forward + two norms), used to model parameter sharing."""
        h, a_dim, f = self.dim, self.attn_dim, self.ff_dim
        return 4 * h * a_dim + (3 if self.glu else 2) * h * f + 4 * h

    def largest_tensor_numel(self) -> int:
        """Largest single weight: the embedding, the fused QKV projection or a feed-forward matrix."""
        f = self.ff_dim * (2 if self.glu else 1)
        return max(self.vocab_size * self.dim, 3 * self.attn_dim * self.dim, f * self.dim)


@dataclass(frozen=True)
class TrainingSetup:
    """How the model is trained.

    Args:
        precision: "fp32", "fp16-mixed" or "bf16-mixed" (autocast with fp32 weights, as in Lightning).
        optimizer: "adam" or "lamb" (both keep two moments per parameter).
        optimizer_bits: 32 or 8 (bitsandbytes blockwise 8-bit states).
        offload: the optimizer lives on the CPU (hivemind ``offload_optimizer=True``).
        checkpointing: gradient checkpointing of every layer.
        reversible: reversible layers (activations recomputed from the outputs, O(1) layers kept).
        batch_size: samples per local forward/backward pass.
        seq_len: tokens per sample; None uses the model's.
        attention: "naive" or "sdpa"; None uses the model's.
        device: "cuda" (GPU peer) or "cpu" (CPU-only peer: everything is counted in the CPU column and
            torch's Adam runs per tensor).
    """

    precision: str = "fp32"
    optimizer: str = "adam"
    optimizer_bits: int = 32
    offload: bool = False
    checkpointing: bool = False
    reversible: bool = False
    batch_size: int = 1
    seq_len: int | None = None
    attention: str | None = None
    device: str = "cuda"

    def __post_init__(self):
        checks = [
            ("precision", PRECISIONS),
            ("optimizer", OPTIMIZERS),
            ("optimizer_bits", (32, 8)),
            ("device", DEVICES),
        ]
        for name, allowed in checks:
            if getattr(self, name) not in allowed:
                raise ValueError(f"TrainingSetup.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.attention is not None and self.attention not in ATTENTIONS:
            raise ValueError(f"TrainingSetup.attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.batch_size <= 0 or (self.seq_len is not None and self.seq_len <= 0):
            raise ValueError("batch_size and seq_len must be positive")
        if self.offload and self.device == "cpu":
            raise ValueError("offload moves the optimizer from the GPU to the CPU; it means nothing with device='cpu'")

    @property
    def compute_bytes(self) -> int:
        """Bytes per activation element: 4 in fp32, 2 under 16-bit autocast."""
        return 4 if self.precision == "fp32" else 2
