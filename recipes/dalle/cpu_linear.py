"""``linear(x, weight, bias)``: ``F.linear`` whose fp32 CPU matmuls (forward and backward) run in oneDNN.

PyTorch sends fp32 CPU matmuls to MKL's sgemm, which takes its AVX2 code path on AMD CPUs; oneDNN (bundled
with PyTorch; ``torch.ops.mkldnn._linear_pointwise`` is the kernel Inductor emits for CPU linears) picks its
kernels from the CPU's actual instruction set and runs AVX-512 there: about 2x faster at the DALL-E's shapes
on this machine's AMD EPYC (tests/benchmarks/bench_dalle_train.py). The arithmetic stays fp32 (oneDNN's
default strict math mode: no TF32/BF16 down-conversion); only the summation order differs from MKL, as it
would between any two BLAS libraries (relative differences ~1e-6, tested in tests/recipes/test_cpu_linear.py).

Falls back to ``F.linear`` for anything else: other devices and dtypes, under autocast (bf16-mixed keeps
autocast's own casting and kernels), or when this PyTorch build has no oneDNN.

Which kernel runs is chosen once from the measured CPU (:func:`kernel_choice`, a pure function of
:class:`CPUFacts`; figures from ``tests/benchmarks/bench_cpu_linear.py``, table in docs/precision.md):

- x86 with AVX-512 from AMD: oneDNN (MKL takes its AVX2 path there; oneDNN ~2x at the DALL-E's shapes);
- x86 with AVX2 only: see KERNEL_BY_CPU (measured on a 2-core AMD EPYC with AVX2);
- any other CPU (Intel AVX-512, ARM, no oneDNN): ``F.linear``, the baseline, where oneDNN was not measured faster.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lightning_swarm.precision import cpu_arch

__all__ = ["CPUFacts", "cpu_facts", "kernel_choice", "linear", "linear_cross_entropy", "onednn_available",
           "use_onednn"]

log = logging.getLogger(__name__)
ONEDNN, F_LINEAR = "onednn", "F.linear"


def onednn_available() -> bool:
    """Whether this PyTorch build can run fp32 linears in oneDNN."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@dataclass(frozen=True)
class CPUFacts:
    """What the kernel choice depends on.

    Args:
        arch: "x86", "arm" or "other".
        vendor: the x86 vendor string ("AuthenticAMD", "GenuineIntel"), "" if unknown.
        capability: ATen's kernel level, ``torch.backends.cpu.get_cpu_capability()`` ("AVX2", "AVX512", ...);
            ``ATEN_CPU_CAPABILITY=avx2`` lowers it, as on a laptop.
        onednn: this PyTorch build has oneDNN's linear (``onednn_available()``).
    """

    arch: str
    vendor: str
    capability: str
    onednn: bool


# (arch, vendor, capability) -> kernel, measured with tests/benchmarks/bench_cpu_linear.py; anything else: F.linear
KERNEL_BY_CPU = {
    ("x86", "AuthenticAMD", "AVX512"): ONEDNN,   # ~2x (bench_dalle_train.py on an AVX-512 EPYC)
    ("x86", "AuthenticAMD", "AVX2"): F_LINEAR,
}


def kernel_choice(facts: CPUFacts) -> str:
    """``"onednn"`` or ``"F.linear"``: the faster fp32 linear on a CPU with these facts."""
    if not facts.onednn:
        return F_LINEAR
    return KERNEL_BY_CPU.get((facts.arch, facts.vendor, facts.capability), F_LINEAR)


def _x86_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_facts() -> CPUFacts:
    """This machine's :class:`CPUFacts`."""
    arch = cpu_arch()
    return CPUFacts(arch=arch, vendor=_x86_vendor() if arch == "x86" else "",
                    capability=torch.backends.cpu.get_cpu_capability(), onednn=onednn_available())


_AVAILABLE = onednn_available()
_enabled = kernel_choice(cpu_facts()) == ONEDNN


@contextlib.contextmanager
def use_onednn(enabled: bool):
    """Context manager switching the oneDNN path on or off, whatever ``kernel_choice`` picked for this CPU.

    Args:
        enabled: True routes eligible fp32 CPU linears through oneDNN; False always uses ``F.linear``.
    """
    global _enabled
    previous, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = previous


def _matmul_transposed(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b.T (+ bias)`` in the chosen kernel: a ``[..., K]``, b ``[N, K]`` (any strides), bias ``[N]``."""
    if _enabled and _AVAILABLE:
        return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")
    return F.linear(a, b, bias)


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _matmul_transposed(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # grad @ W: W.T as a strided "weight" (oneDNN reorders weights anyway; cheaper than a copy)
            grad_x = _matmul_transposed(grad_2d, weight.t()).view(*x.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            # grad.T @ x: copy the narrower of grad and x transposed (transposed copies are slow) and read the
            # other one as a strided "weight"
            x_2d = x.reshape(-1, x.shape[-1])
            if weight.shape[0] < weight.shape[1]:
                grad_weight = _matmul_transposed(grad_2d.t().contiguous(), x_2d.t())
            else:
                grad_weight = _matmul_transposed(x_2d.t().contiguous(), grad_2d.t()).t().contiguous()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_2d.sum(0)
        return grad_x, grad_weight, grad_bias


def _fp32_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and x.dim() >= 2
        and x.numel() > 0
        and not torch.is_autocast_enabled("cpu")
    )


def _onednn_eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return _enabled and _AVAILABLE and _fp32_cpu(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, computed by oneDNN for fp32 CPU tensors outside autocast where
    ``kernel_choice`` picked oneDNN for this CPU.

    Args:
        x: input ``[..., in_features]``.
        weight: ``[out_features, in_features]``.
        bias: ``[out_features]`` or None.
    """
    if _onednn_eligible(x, weight, bias):
        return _OneDNNLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


_ROWS_PER_CHUNK = 16  # rows of logits per elementwise pass: a chunk's temporaries stay in the CPU's cache
# Fewer classes than this take F.cross_entropy: its fused log-softmax beats the row-chunked passes there
# (bench_cpu_linear.py, AVX2: 0.28x at 8 classes, 0.93x at 1024, 0.76x at 8192; 1.15x at 49,424)
FUSED_MIN_CLASSES = 16384


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``x @ weight.T + bias`` against class ids, with the logits buffer reused.

    The forward keeps the logits and their row-wise log-sum-exp; the backward turns the logits into
    ``softmax - one_hot`` in place, so besides the logits no ``[rows, classes]`` tensor is ever allocated
    (``F.cross_entropy`` allocates the log-softmax, a zero-filled gradient and the softmax gradient).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, target):
        x_2d, target = x.reshape(-1, x.shape[-1]), target.reshape(-1)
        logits = _matmul_transposed(x_2d, weight, bias)
        log_normalizer = torch.cat([torch.logsumexp(chunk, dim=-1) for chunk in logits.split(_ROWS_PER_CHUNK)])
        loss = (log_normalizer - logits.gather(1, target[:, None]).squeeze(1)).mean()
        ctx.save_for_backward(x_2d, weight, target)
        ctx.logits, ctx.log_normalizer, ctx.x_shape, ctx.has_bias = logits, log_normalizer, x.shape, bias is not None
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        x_2d, weight, target = ctx.saved_tensors
        if ctx.logits is None:
            raise RuntimeError("linear_cross_entropy reuses its logits in backward: it can run backward only once")
        probs, ctx.logits = ctx.logits, None
        for chunk, log_normalizer in zip(probs.split(_ROWS_PER_CHUNK), ctx.log_normalizer.split(_ROWS_PER_CHUNK)):
            chunk.sub_(log_normalizer[:, None]).exp_()
        probs[torch.arange(len(target)), target] -= 1  # d(sum of losses) / d logits
        scale = grad_loss / len(target)  # the mean, applied to the small results
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = (_matmul_transposed(probs, weight.t()) * scale).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_weight = torch.mm(probs.t(), x_2d * scale)  # MKL beats oneDNN here: no transposed copies
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = probs.sum(0) * scale
        return grad_x, grad_weight, grad_bias, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         target: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(F.linear(x, weight, bias), target)`` (mean over every position), in fp32.

    fp32 CPU tensors outside autocast with at least ``FUSED_MIN_CLASSES`` classes reuse the logits buffer in
    backward (see ``_LinearCrossEntropy``; its matmuls run in the kernel chosen for this CPU); anything else
    computes the logits with ``linear`` and the loss in fp32 with ``F.cross_entropy``.

    Args:
        x: features ``[..., in_features]``.
        weight: class embeddings ``[num_classes, in_features]``.
        bias: ``[num_classes]`` or None.
        target: class ids, ``x.shape[:-1]``.
    """
    if _fp32_cpu(x, weight, bias) and weight.shape[0] >= FUSED_MIN_CLASSES:
        return _LinearCrossEntropy.apply(x, weight, bias, target)
    logits = linear(x, weight, bias)
    return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten())
