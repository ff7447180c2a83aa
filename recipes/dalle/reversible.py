"""Reversible residual coupling (RevNet / Reformer) with activations recomputed in the backward pass.

The hidden state is two streams (x1, x2); each layer computes

    y1 = x1 + f(x2)        (f = attention branch)
    y2 = x2 + g(y1)        (g = feed-forward branch)

which can be inverted exactly (up to rounding): ``x2 = y2 - g(y1)``, ``x1 = y1 - f(x2)``. The training
forward therefore keeps only the last layer's output; the backward walks the layers in reverse,
rebuilding each layer's input and differentiating f and g on the fly, so activation memory does not grow
with depth. Weight-shared branches are fine: a parameter used by several layers receives the sum.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

Branch = Callable[[torch.Tensor], torch.Tensor]


def reversible_forward_eager(x1, x2, layers: Sequence[tuple[Branch, Branch]]):
    """The coupling under ordinary autograd (used for inference and as the reference in tests)."""
    for f, g in layers:
        x1 = x1 + f(x2)
        x2 = x2 + g(x1)
    return x1, x2


class _ReversibleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x1, x2, layers, layer_params, *params):
        # layers: [(f, g)]; layer_params: [(f_param_indices, g_param_indices)] into `params`
        with torch.no_grad():
            y1, y2 = reversible_forward_eager(x1, x2, layers)
        ctx.layers, ctx.layer_params = layers, layer_params
        # the backward recomputes f and g: under the same autocast state as this forward
        ctx.device_type = x1.device.type
        ctx.autocast = (torch.is_autocast_enabled(ctx.device_type), torch.get_autocast_dtype(ctx.device_type))
        ctx.save_for_backward(y1, y2, *params)
        return y1, y2

    @staticmethod
    def backward(ctx, dy1, dy2):
        enabled, dtype = ctx.autocast
        with torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled):
            return _ReversibleFunction._backward(ctx, dy1, dy2)

    @staticmethod
    def _backward(ctx, dy1, dy2):
        y1, y2, *params = ctx.saved_tensors
        param_grads: list[torch.Tensor | None] = [None] * len(params)

        def accumulate(indices, grads):
            for index, grad in zip(indices, grads):
                if grad is not None:
                    param_grads[index] = grad if param_grads[index] is None else param_grads[index] + grad

        y1, y2 = y1.detach(), y2.detach()
        for (f, g), (f_indices, g_indices) in zip(reversed(ctx.layers), reversed(ctx.layer_params)):
            with torch.enable_grad():
                y1.requires_grad_(True)
                g_out = g(y1)
                grads = torch.autograd.grad(g_out, [y1] + [params[i] for i in g_indices], dy2, allow_unused=True)
            dy1 = dy1 + grads[0]
            accumulate(g_indices, grads[1:])
            with torch.no_grad():
                x2 = y2 - g_out
            del g_out
            with torch.enable_grad():
                x2.requires_grad_(True)
                f_out = f(x2)
                grads = torch.autograd.grad(f_out, [x2] + [params[i] for i in f_indices], dy1, allow_unused=True)
            dy2 = dy2 + grads[0]
            accumulate(f_indices, grads[1:])
            with torch.no_grad():
                x1 = y1 - f_out
            del f_out
            y1, y2 = x1.detach(), x2.detach()
        return (dy1, dy2, None, None, *param_grads)


def reversible_forward(x1, x2, layers: Sequence[tuple[Branch, Branch]], layer_parameters):
    """Run the coupling keeping only the output; gradients flow to x1, x2 and every branch parameter.

    Args:
        x1, x2: the two input streams ``[B, L, D]``.
        layers: per layer, the callables ``(f, g)``.
        layer_parameters: per layer, ``(f_parameters, g_parameters)``: the parameters f and g read.
    """
    needs_grad = x1.requires_grad or x2.requires_grad or any(
        p.requires_grad for pair in layer_parameters for group in pair for p in group
    )
    if not torch.is_grad_enabled() or not needs_grad:
        return reversible_forward_eager(x1, x2, layers)
    params: list[torch.nn.Parameter] = []
    position: dict[int, int] = {}
    layer_params = []
    for pair in layer_parameters:
        indices = []
        for group in pair:
            module_indices = []
            for p in group:
                if not p.requires_grad:
                    continue
                if id(p) not in position:
                    position[id(p)] = len(params)
                    params.append(p)
                module_indices.append(position[id(p)])
            indices.append(module_indices)
        layer_params.append(tuple(indices))
    return _ReversibleFunction.apply(x1, x2, list(layers), layer_params, *params)

