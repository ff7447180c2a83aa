"""Reversible residual coupling (RevNet / Reformer) with activations recomputed in the backward pass.

The hidden state is two streams (x1, x2); each layer computes

    y1 = x1 + f(x2)        (f = attention branch)
    y2 = x2 + g(y1)        (g = feed-forward branch)

which can be inverted exactly (up to rounding): ``x2 = y2 - g(y1)``, ``x1 = y1 - f(x2)``. The training
forward therefore keeps only the last layer's input and autograd graph; the backward differentiates that
layer, then walks the other layers in reverse, rebuilding each layer's input and differentiating f and g
on the fly, so activation memory does not grow with depth. Weight-shared branches are fine: a parameter used by several layers receives the sum.
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
            x1, x2 = reversible_forward_eager(x1, x2, layers[:-1])
        # the last layer keeps its autograd graph: the backward starts there without recomputing it (one
        # layer's activations, whatever the depth)
        f, g = layers[-1]
        x1, x2 = x1.detach(), x2.detach()
        with torch.enable_grad():
            f_input = x2.requires_grad_(True)
            f_out = f(f_input)
            g_input = (x1 + f_out).detach().requires_grad_(True)
            g_out = g(g_input)
        y1, y2 = g_input.detach(), (x2 + g_out).detach()
        ctx.last_layer = (x1, f_input, f_out, g_input, g_out)
        ctx.layers, ctx.layer_params = layers, layer_params
        # the backward recomputes f and g: under the same autocast state as this forward
        ctx.device_type = x1.device.type
        ctx.autocast = (torch.is_autocast_enabled(ctx.device_type), torch.get_autocast_dtype(ctx.device_type))
        ctx.save_for_backward(*params)
        return y1, y2

    @staticmethod
    def backward(ctx, dy1, dy2):
        enabled, dtype = ctx.autocast
        with torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled):
            return _ReversibleFunction._backward(ctx, dy1, dy2)

    @staticmethod
    def _backward(ctx, dy1, dy2):
        params = ctx.saved_tensors
        if ctx.last_layer is None:
            raise RuntimeError("the reversible stack frees its last layer's graph in backward: run backward once")
        (x1, f_input, f_out, g_input, g_out), ctx.last_layer = ctx.last_layer, None
        param_grads: list[torch.Tensor | None] = [None] * len(params)

        def accumulate(indices, grads):
            for index, grad in zip(indices, grads):
                if grad is not None:
                    param_grads[index] = grad if param_grads[index] is None else param_grads[index] + grad

        def backward_layer(f_indices, g_indices, dy1, dy2):
            grads = torch.autograd.grad(g_out, [g_input] + [params[i] for i in g_indices], dy2, allow_unused=True)
            dy1 = dy1 + grads[0]
            accumulate(g_indices, grads[1:])
            grads = torch.autograd.grad(f_out, [f_input] + [params[i] for i in f_indices], dy1, allow_unused=True)
            accumulate(f_indices, grads[1:])
            return dy1, dy2 + grads[0]

        dy1, dy2 = backward_layer(*ctx.layer_params[-1], dy1, dy2)
        y1, y2 = x1, f_input.detach()  # the last layer's input, kept by the forward
        for (f, g), (f_indices, g_indices) in zip(reversed(ctx.layers[:-1]), reversed(ctx.layer_params[:-1])):
            # rebuild this layer's input from its output while recording f and g for their gradients
            with torch.enable_grad():
                g_input = y1.requires_grad_(True)
                g_out = g(g_input)
            with torch.no_grad():
                x2 = y2 - g_out
            with torch.enable_grad():
                f_input = x2.requires_grad_(True)
                f_out = f(f_input)
            with torch.no_grad():
                x1 = y1 - f_out
            dy1, dy2 = backward_layer(f_indices, g_indices, dy1, dy2)
            y1, y2 = x1.detach(), x2.detach()
            del g_out, f_out
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
    if not torch.is_grad_enabled() or not needs_grad or not layers:
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

