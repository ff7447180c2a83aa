"""``linear(x, weight, bias)``: ``F.linear`` whose fp32 CPU matmuls (forward and backward) run in oneDNN.

PyTorch sends fp32 CPU matmuls to MKL's sgemm, which takes its AVX2 code path on AMD CPUs; oneDNN (bundled
with PyTorch; ``torch.ops.mkldnn._linear_pointwise`` is the kernel Inductor emits for CPU linears) picks its
kernels from the CPU's actual instruction set and runs AVX-512 there: about 2x faster at the DALL-E's shapes
on this machine's AMD EPYC (tests/benchmarks/bench_dalle_train.py). The arithmetic stays fp32 (oneDNN's
default strict math mode: no TF32/BF16 down-conversion); only the summation order differs from MKL, as it
would between any two BLAS libraries (relative differences ~1e-6, tested in tests/recipes/test_cpu_linear.py).

Falls back to ``F.linear`` for anything else: other devices and dtypes, under autocast (bf16-mixed keeps
autocast's own casting and kernels), or when this PyTorch build has no oneDNN.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

__all__ = ["linear", "onednn_available", "use_onednn"]

_enabled = True


def onednn_available() -> bool:
    """Whether this PyTorch build can run fp32 linears in oneDNN."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_AVAILABLE = onednn_available()


@contextlib.contextmanager
def use_onednn(enabled: bool):
    """Context manager switching the oneDNN path on or off (e.g. to compare against ``F.linear``).

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
    """``a @ b.T (+ bias)`` in oneDNN: a ``[..., K]``, b ``[N, K]`` (any strides), bias ``[N]`` -> ``[..., N]``."""
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")


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
            # (x.T @ grad).T: the small x.T is copied, the big grad.T is read as a strided weight
            x_2d = x.reshape(-1, x.shape[-1])
            grad_weight = _matmul_transposed(x_2d.t().contiguous(), grad_2d.t()).t().contiguous()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_2d.sum(0)
        return grad_x, grad_weight, grad_bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, computed by oneDNN for fp32 CPU tensors outside autocast.

    Args:
        x: input ``[..., in_features]``.
        weight: ``[out_features, in_features]``.
        bias: ``[out_features]`` or None.
    """
    if (
        _enabled
        and _AVAILABLE
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and x.dim() >= 2
        and x.numel() > 0
        and not torch.is_autocast_enabled("cpu")
    ):
        return _OneDNNLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)
