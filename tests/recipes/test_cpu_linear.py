"""oneDNN fp32 linear: same values and gradients as F.linear (to fp32 rounding), fallbacks where it must not run."""

import pytest
import torch
import torch.nn.functional as F

from recipes.dalle import cpu_linear
from recipes.dalle.cpu_linear import (CPUFacts, cpu_facts, kernel_choice, linear, linear_cross_entropy,
                                      onednn_available, use_onednn)

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")


def reference(x, weight, bias):
    """F.linear in float64: the exact result both fp32 paths approximate."""
    out = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return out


@needs_onednn
@pytest.mark.parametrize("shape,out_features,with_bias", [((3, 7, 16), 24, True), ((40, 64), 300, False),
                                                          ((2, 5, 1, 32), 8, True), ((9, 16), 16, True)])
def test_values_and_gradients_match_float64_like_f_linear(shape, out_features, with_bias):
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    weight = torch.randn(out_features, shape[-1], requires_grad=True)
    bias = torch.randn(out_features, requires_grad=True) if with_bias else None
    grad_out = torch.randn(*shape[:-1], out_features)
    inputs = [t for t in (x, weight, bias) if t is not None]

    with use_onednn(True):  # whatever this CPU's choice, the oneDNN kernel must be right
        out = linear(x, weight, bias)
    assert out.grad_fn is not None and "OneDNN" in type(out.grad_fn).__name__  # the oneDNN path really ran
    grads = torch.autograd.grad(out, inputs, grad_out)
    x64 = [t.detach().double().requires_grad_() for t in inputs]
    out64 = reference(x64[0], x64[1], x64[2] if with_bias else None)
    grads64 = torch.autograd.grad(out64, x64, grad_out.double())

    assert out.dtype == torch.float32 and out.shape == out64.shape
    for ours, exact in zip((out, *grads), (out64, *grads64)):
        assert ours.shape == exact.shape
        scale = exact.abs().max().item()
        assert (ours.double() - exact).abs().max().item() <= 1e-5 * scale  # fp32 rounding, no TF32/BF16


@needs_onednn
def test_only_the_needed_gradients_are_computed_and_noncontiguous_inputs_work():
    torch.manual_seed(0)
    x = torch.randn(16, 6, 10).transpose(0, 1)  # not contiguous
    weight = torch.randn(12, 10, requires_grad=True)
    with use_onednn(True):
        out = linear(x, weight)
    (grad_weight,) = torch.autograd.grad(out.square().sum(), [weight])
    expected = torch.autograd.grad(F.linear(x, weight).square().sum(), [weight])[0]
    torch.testing.assert_close(grad_weight, expected, rtol=1e-5, atol=1e-5)


def test_falls_back_to_f_linear_under_autocast_for_other_dtypes_and_when_disabled():
    x, weight = torch.randn(4, 8, requires_grad=True), torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear(x, weight)
    assert out.dtype == torch.bfloat16  # autocast's own casting applied
    out = linear(x.double(), weight.double())
    assert out.dtype == torch.float64 and "OneDNN" not in type(out.grad_fn).__name__
    with use_onednn(False):
        out = linear(x, weight)
    assert "OneDNN" not in type(out.grad_fn).__name__
    torch.testing.assert_close(out, F.linear(x, weight))


@pytest.mark.parametrize("kernel", [True, False], ids=["onednn", "f-linear"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_cross_entropy_matches_float64_cross_entropy_and_gradients(with_bias, kernel, monkeypatch):
    monkeypatch.setattr(cpu_linear, "FUSED_MIN_CLASSES", 1)  # the fused path at a small size
    torch.manual_seed(0)
    x = torch.randn(3, 37, 16, requires_grad=True)  # 111 rows: several chunks of the row-wise passes
    weight = (torch.randn(500, 16) * 3).requires_grad_()  # large logits: the log-sum-exp must be stable
    bias = torch.randn(500, requires_grad=True) if with_bias else None
    target = torch.randint(0, 500, (3, 37))
    inputs = [t for t in (x, weight, bias) if t is not None]

    with use_onednn(kernel and onednn_available()):
        loss = linear_cross_entropy(x, weight, bias, target)
        assert "LinearCrossEntropy" in type(loss.grad_fn).__name__  # the fused path, in either kernel
        grads = torch.autograd.grad(loss * 2.5, inputs)  # a non-unit upstream gradient
    x64 = [t.detach().double().requires_grad_() for t in inputs]
    logits64 = F.linear(x64[0], x64[1], x64[2] if with_bias else None)
    loss64 = F.cross_entropy(logits64.flatten(0, 1), target.flatten())
    grads64 = torch.autograd.grad(loss64 * 2.5, x64)

    assert abs(loss.item() - loss64.item()) <= 1e-5 * abs(loss64.item())
    for ours, exact in zip(grads, grads64):
        assert ours.shape == exact.shape and ours.dtype == torch.float32
        assert (ours.double() - exact).abs().max().item() <= 1e-5 * exact.abs().max().item()


def test_linear_cross_entropy_refuses_a_second_backward_and_falls_back_under_autocast(monkeypatch):
    monkeypatch.setattr(cpu_linear, "FUSED_MIN_CLASSES", 1)
    x, weight = torch.randn(4, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    target = torch.randint(0, 6, (4,))
    loss = linear_cross_entropy(x, weight, None, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):  # the logits buffer became the gradient
        loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(x, weight, None, target)
        logits = F.linear(x, weight)
    assert loss.dtype == torch.float32 and logits.dtype == torch.bfloat16  # bf16 logits, loss in fp32
    expected = F.cross_entropy(logits.float(), target)
    torch.testing.assert_close(loss, expected)


def test_few_classes_take_f_cross_entropy():
    """Below FUSED_MIN_CLASSES (measured: the row-chunked passes lose to F.cross_entropy there) the loss is
    F.cross_entropy's, gradients through autograd."""
    x, weight = torch.randn(8, 16, requires_grad=True), torch.randn(cpu_linear.FUSED_MIN_CLASSES - 1, 16)
    target = torch.randint(0, len(weight), (8,))
    loss = linear_cross_entropy(x, weight, None, target)
    assert "LinearCrossEntropy" not in type(loss.grad_fn).__name__
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(x, weight), target))


AMD_AVX512 = CPUFacts(arch="x86", vendor="AuthenticAMD", capability="AVX512", onednn=True)
AMD_AVX2 = CPUFacts(arch="x86", vendor="AuthenticAMD", capability="AVX2", onednn=True)
INTEL_AVX512 = CPUFacts(arch="x86", vendor="GenuineIntel", capability="AVX512", onednn=True)
INTEL_AVX2 = CPUFacts(arch="x86", vendor="GenuineIntel", capability="AVX2", onednn=True)
ARM = CPUFacts(arch="arm", vendor="", capability="DEFAULT", onednn=True)
ARM_SVE = CPUFacts(arch="arm", vendor="", capability="SVE256", onednn=True)
NO_ONEDNN = CPUFacts(arch="x86", vendor="AuthenticAMD", capability="AVX512", onednn=False)


@pytest.mark.parametrize("facts, expected", [
    (AMD_AVX512, "onednn"), (AMD_AVX2, cpu_linear.KERNEL_BY_CPU[("x86", "AuthenticAMD", "AVX2")]),
    (INTEL_AVX512, "F.linear"), (INTEL_AVX2, "F.linear"), (ARM, "F.linear"), (ARM_SVE, "F.linear"),
    (NO_ONEDNN, "F.linear"),
], ids=["amd-avx512", "amd-avx2", "intel-avx512", "intel-avx2", "arm", "arm-sve", "no-onednn"])
def test_kernel_choice_table(facts, expected):
    """oneDNN only where it was measured faster than F.linear (tests/benchmarks/bench_cpu_linear.py)."""
    assert kernel_choice(facts) == expected


def test_this_cpu_runs_the_kernel_chosen_for_it():
    facts = cpu_facts()
    assert facts.capability == torch.backends.cpu.get_cpu_capability() and facts.onednn == onednn_available()
    x, weight = torch.randn(4, 8, requires_grad=True), torch.randn(3, 8)
    ran_onednn = "OneDNN" in type(linear(x, weight).grad_fn).__name__
    assert ran_onednn == (kernel_choice(facts) == "onednn")
