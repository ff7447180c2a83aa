import copy
import inspect
import io
import math

import pytest
import torch

from lightning_swarm.optim import LAMB8bit


class ReferenceLAMB(torch.optim.Optimizer):
    """Plain float32 LAMB with the same conventions (pytorch-lamb / the seed run), written independently."""

    def __init__(self, params, lr, betas, eps, weight_decay, clamp_value, max_grad_norm, bias_correction):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.clamp_value, self.max_grad_norm, self.bias_correction = clamp_value, max_grad_norm, bias_correction

    @torch.no_grad()
    def step(self):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if self.max_grad_norm is not None:
            total_norm = torch.sqrt(sum(p.grad.square().sum() for p in params))
            scale = min(1.0, self.max_grad_norm / (float(total_norm) + 1e-6))
            for p in params:
                p.grad.mul_(scale)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["step"] += 1
                state["m"] = beta1 * state["m"] + (1 - beta1) * p.grad
                state["v"] = beta2 * state["v"] + (1 - beta2) * p.grad**2
                update = state["m"] / (state["v"].sqrt() + group["eps"]) + group["weight_decay"] * p
                weight_norm = min(float(p.norm()), self.clamp_value)
                update_norm = float(update.norm())
                ratio = weight_norm / update_norm if weight_norm > 0 and update_norm > 0 else 1.0
                t = state["step"]
                correction = math.sqrt(1 - beta2**t) / (1 - beta1**t) if self.bias_correction else 1.0
                p.sub_(group["lr"] * correction * ratio * update)


# the seed run's betas; clipping active in the first steps (initial gradient norm is about 2)
HYPER = dict(lr=0.003, betas=(0.9, 0.96), eps=1e-6, weight_decay=0.01, clamp_value=10.0, max_grad_norm=1.0,
             bias_correction=True)


def make_problem():
    """Linear regression: a 64 -> 32 layer (2048 weights, 32 biases) fitting a noisy linear map."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, 64, generator=generator)
    true_weight = torch.randn(64, 32, generator=generator) / 8
    targets = inputs @ true_weight + 0.05 * torch.randn(256, 32, generator=generator)
    return torch.nn.Linear(64, 32), inputs, targets


def train(model, optimizer, inputs, targets, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_large_tensors_have_uint8_state_and_small_ones_float32():
    model, inputs, targets = make_problem()  # weight of 2048 values, bias of 32
    optimizer = LAMB8bit(model.parameters(), min_8bit_size=1024, block_size=256)
    train(model, optimizer, inputs, targets, 2)
    weight, bias = model.weight, model.bias
    for key in ("exp_avg", "exp_avg_sq"):
        assert optimizer.state[weight][key].dtype == torch.uint8
        assert optimizer.state[weight][key].shape == weight.shape
        assert optimizer.state[weight][f"{key}_absmax"].shape == (weight.numel() // 256,)
        assert optimizer.state[bias][key].dtype == torch.float32
        assert f"{key}_absmax" not in optimizer.state[bias]
    # 2 bytes per weight + 2 float32 absmax per 256 weights, 8 bytes per bias
    assert optimizer.state_bytes() == 2 * 2048 + 2 * 4 * 8 + 8 * 32


def test_float32_path_equals_reference_and_8bit_tracks_it():
    model, inputs, targets = make_problem()
    reference_model, full_model, quantized_model = (copy.deepcopy(model) for _ in range(3))
    reference_losses = train(
        reference_model, ReferenceLAMB(reference_model.parameters(), **HYPER), inputs, targets, 300
    )
    full_losses = train(
        full_model, LAMB8bit(full_model.parameters(), **HYPER, min_8bit_size=10**9), inputs, targets, 300
    )
    quantized = LAMB8bit(quantized_model.parameters(), **HYPER, min_8bit_size=0)  # every tensor 8-bit
    quantized_losses = train(quantized_model, quantized, inputs, targets, 300)
    assert all(state["exp_avg"].dtype == torch.uint8 for state in quantized.state.values())

    torch.testing.assert_close(torch.tensor(full_losses), torch.tensor(reference_losses), rtol=1e-3, atol=1e-5)
    assert reference_losses[-1] < 0.5 * reference_losses[0]  # the problem is actually being learned
    relative_gap = [abs(q - r) / r for q, r in zip(quantized_losses, reference_losses)]
    assert max(relative_gap) < 0.05, max(relative_gap)
    for quantized_param, reference_param in zip(quantized_model.parameters(), reference_model.parameters()):
        drift = (quantized_param - reference_param).norm() / reference_param.norm()
        assert drift < 0.1, drift


def test_global_grad_norm_clipping():
    weights = [torch.nn.Parameter(torch.randn(100)), torch.nn.Parameter(torch.randn(50, 100))]
    optimizer = LAMB8bit(weights, max_grad_norm=2.0, min_8bit_size=10**9, betas=(0.5, 0.9))
    grads = [torch.full((100,), 3.0), torch.full((50, 100), -1.0)]
    for weight, grad in zip(weights, grads):
        weight.grad = grad.clone()
    optimizer.step()
    total_norm = torch.sqrt(sum(g.square().sum() for g in grads))
    for weight, grad in zip(weights, grads):
        clipped = grad * 2.0 / total_norm  # one scale for all tensors, global norm exactly 2
        torch.testing.assert_close(weight.grad, clipped)
        torch.testing.assert_close(optimizer.state[weight]["exp_avg"], 0.5 * clipped)


def test_no_clipping_below_the_threshold():
    weight = torch.nn.Parameter(torch.randn(100))
    weight.grad = torch.full((100,), 0.01)
    optimizer = LAMB8bit([weight], max_grad_norm=2.0, min_8bit_size=10**9, betas=(0.5, 0.9))
    optimizer.step()
    torch.testing.assert_close(weight.grad, torch.full((100,), 0.01))
    torch.testing.assert_close(optimizer.state[weight]["exp_avg"], torch.full((100,), 0.005))


@pytest.mark.parametrize("weight_scale, expected_ratio_norm", [(1000.0, 10.0), (0.5, None)])
def test_trust_ratio_clamps_weight_norm(weight_scale, expected_ratio_norm):
    """One step moves the weights by lr * c_1 * min(||w||, clamp_value) (the update is rescaled to that norm)."""
    generator = torch.Generator().manual_seed(0)
    direction = torch.randn(4096, generator=generator)
    weight = torch.nn.Parameter(direction / direction.norm() * weight_scale)
    weight.grad = torch.randn(4096, generator=generator)
    lr, betas = 0.01, (0.9, 0.999)
    optimizer = LAMB8bit([weight], lr=lr, betas=betas, clamp_value=10.0)
    before = weight.detach().clone()
    optimizer.step()
    correction = math.sqrt(1 - betas[1]) / (1 - betas[0])
    expected = lr * correction * (expected_ratio_norm or weight_scale)
    assert float((weight.detach() - before).norm()) == pytest.approx(expected, rel=1e-3)


def test_state_dict_round_trip_with_weights_only_load():
    model, inputs, targets = make_problem()
    optimizer = LAMB8bit(model.parameters(), **HYPER)
    train(model, optimizer, inputs, targets, 5)

    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    state_dict = torch.load(buffer, weights_only=True)
    model_copy = copy.deepcopy(model)
    restored = type(optimizer)(model_copy.parameters(), **optimizer.defaults)  # how hivemind re-creates it
    restored.load_state_dict(state_dict)

    for original_param, restored_param in zip(model.parameters(), model_copy.parameters()):
        original_state, restored_state = optimizer.state[original_param], restored.state[restored_param]
        assert original_state.keys() == restored_state.keys()
        for key, value in original_state.items():
            if isinstance(value, torch.Tensor):
                assert restored_state[key].dtype == value.dtype and torch.equal(restored_state[key], value)
            else:
                assert restored_state[key] == value
    # identical next steps
    train(model, optimizer, inputs, targets, 3)
    train(model_copy, restored, inputs, targets, 3)
    for original_param, restored_param in zip(model.parameters(), model_copy.parameters()):
        torch.testing.assert_close(original_param, restored_param, rtol=0, atol=0)


def test_all_constructor_arguments_are_in_defaults():
    names = [name for name in inspect.signature(LAMB8bit.__init__).parameters if name not in ("self", "params")]
    optimizer = LAMB8bit([torch.nn.Parameter(torch.zeros(3))])
    assert sorted(optimizer.defaults) == sorted(names)


@pytest.mark.parametrize(
    "kwargs", [dict(lr=-1.0), dict(betas=(1.0, 0.9)), dict(clamp_value=0.0), dict(max_grad_norm=0.0)]
)
def test_bad_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        LAMB8bit([torch.nn.Parameter(torch.zeros(3))], **kwargs)


def test_built_from_lightning_cli_style_config():
    from jsonargparse import ArgumentParser
    from lightning.pytorch.cli import OptimizerCallable

    parser = ArgumentParser()
    parser.add_argument("--optimizer", type=OptimizerCallable)
    config = parser.parse_object(
        {
            "optimizer": {
                "class_path": "lightning_swarm.optim.LAMB8bit",
                "init_args": {"lr": 0.003, "betas": [0.9, 0.96], "max_grad_norm": 4.0, "clamp_value": 1e4},
            }
        }
    )
    optimizer_factory = parser.instantiate_classes(config).optimizer
    optimizer = optimizer_factory([torch.nn.Parameter(torch.zeros(3))])
    assert isinstance(optimizer, LAMB8bit)
    assert optimizer.defaults["lr"] == 0.003 and optimizer.defaults["betas"] == (0.9, 0.96)
    assert optimizer.defaults["max_grad_norm"] == 4.0 and optimizer.defaults["clamp_value"] == 1e4
