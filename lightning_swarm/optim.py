"""LAMB with 8-bit blockwise optimizer state, global gradient clipping and a trust-ratio clamp.

This is the inner optimizer of the collaborative run: hivemind's ``offload_optimizer`` keeps a float32 copy of
the parameters in host memory and steps this optimizer on that copy once per global epoch, so an accelerator
never holds optimizer state, and the host holds 2 bytes of state per parameter instead of 8.

The update is LAMB as in the seed run (pytorch-lamb / torch_optimizer flavour, paper v3)::

    g      = grad * min(1, max_grad_norm / ||all grads||)        # global clipping (optional)
    m      = beta1 * m + (1 - beta1) * g
    v      = beta2 * v + (1 - beta2) * g^2
    u      = m / (sqrt(v) + eps) + weight_decay * w
    ratio  = min(||w||, clamp_value) / ||u||   (1 if either norm is 0)
    w     -= lr * c_t * ratio * u,  c_t = sqrt(1 - beta2^t) / (1 - beta1^t) if bias_correction else 1

``m`` and ``v`` are stored between steps as bitsandbytes blockwise 8-bit codes (``uint8`` + one float32 absmax
per block; signed dynamic map for ``m``, unsigned for ``v``) for tensors with at least ``min_8bit_size``
elements, and as float32 for smaller tensors (norm gains, biases) where 8 bits buy nothing.

With hivemind: pass ``optimizer=lambda params: LAMB8bit(params, ...)`` (or re-create an instance as
``type(opt)(params, **opt.defaults)``) with ``offload_optimizer=True``. Do not list ``exp_avg``/``exp_avg_sq`` in
hivemind's ``average_opt_statistics``: averaging 8-bit codes (each block with its own absmax) is meaningless.
Loading state from peers works: the uint8 codes travel as they are (``default_compression`` passes non-float
tensors through) and :meth:`LAMB8bit.load_state_dict` keeps them uint8.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["LAMB8bit"]

# state keys of the two moments; a quantized moment also has f"{key}_absmax"
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


def _dynamic_maps() -> dict[str, torch.Tensor]:
    from bitsandbytes.functional import create_dynamic_map

    # the first moment is signed, the second is not: the unsigned map spends all 256 codes on [0, 1]
    return {"exp_avg": create_dynamic_map(signed=True), "exp_avg_sq": create_dynamic_map(signed=False)}


class LAMB8bit(torch.optim.Optimizer):
    """LAMB with 8-bit blockwise state (bitsandbytes), global grad-norm clipping and a trust-ratio clamp.

    All constructor arguments are kept in ``self.defaults`` so the optimizer can be re-created on other
    parameters as ``type(opt)(params, **opt.defaults)`` (which is what hivemind's offloading does).
    State is allocated when the optimizer is built, so hivemind needs no zero-gradient warm-up step.

    Args:
        params: parameters to optimize, or dicts defining parameter groups.
        lr: learning rate.
        betas: decay rates of the running averages of the gradient and of its square.
        eps: added to the square root of the second moment to avoid division by zero.
        weight_decay: decoupled L2 term added to the update before the trust ratio (0 disables it).
        clamp_value: upper bound of the weight norm in the trust ratio ``min(||w||, clamp_value) / ||u||``;
            set it very high (e.g. 1e9) to disable the clamp.
        max_grad_norm: if set, all gradients are scaled together so their global L2 norm is at most this
            value before the update (taken from the constructor, i.e. one value for all groups).
        bias_correction: multiply the step by ``sqrt(1 - beta2^t) / (1 - beta1^t)``.
        min_8bit_size: tensors with fewer elements keep float32 state.
        block_size: number of values that share one absmax in the 8-bit state (bitsandbytes uses 256).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        clamp_value: float = 10.0,
        max_grad_norm: float | None = None,
        bias_correction: bool = True,
        min_8bit_size: int = 4096,
        block_size: int = 256,
    ):
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if clamp_value <= 0:
            raise ValueError(f"clamp_value must be > 0 (use a large value such as 1e9 to disable), got {clamp_value}")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None to disable clipping, got {max_grad_norm}")
        if block_size < 1 or min_8bit_size < 0:
            raise ValueError(f"block_size must be >= 1 and min_8bit_size >= 0, got {block_size}, {min_8bit_size}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            clamp_value=clamp_value,
            max_grad_norm=max_grad_norm,
            bias_correction=bias_correction,
            min_8bit_size=min_8bit_size,
            block_size=block_size,
        )
        super().__init__(params, defaults)
        self._qmaps = _dynamic_maps()
        for group in self.param_groups:
            for param in group["params"]:
                self._init_state(param, group)

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[param]
        if state:
            return
        state["step"] = 0
        for key in MOMENT_KEYS:
            zeros = torch.zeros_like(param, dtype=torch.float32, memory_format=torch.contiguous_format)
            if param.numel() >= group["min_8bit_size"]:
                self._store(state, key, zeros, group["block_size"])
            else:
                state[key] = zeros

    def _load(self, state: dict[str, Any], key: str, block_size: int) -> torch.Tensor:
        """Return moment ``key`` as a float32 tensor (a fresh one if it is stored quantized)."""
        from bitsandbytes.functional import dequantize_blockwise

        if f"{key}_absmax" not in state:
            return state[key]
        qmap = self._qmaps[key].to(state[key].device)
        return dequantize_blockwise(state[key], absmax=state[f"{key}_absmax"], code=qmap, blocksize=block_size)

    def _store(self, state: dict[str, Any], key: str, value: torch.Tensor, block_size: int) -> None:
        """Quantize float32 ``value`` into moment ``key`` (uint8 codes + float32 absmax per block)."""
        from bitsandbytes.functional import quantize_blockwise

        qmap = self._qmaps[key].to(value.device)
        codes, quant_state = quantize_blockwise(value.contiguous(), code=qmap, blocksize=block_size)
        state[key], state[f"{key}_absmax"] = codes, quant_state.absmax

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one LAMB step on every parameter that has a gradient.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        params_with_grad = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if self.defaults["max_grad_norm"] is not None and params_with_grad:
            torch.nn.utils.clip_grad_norm_(params_with_grad, self.defaults["max_grad_norm"])

        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise ValueError("LAMB8bit does not support sparse gradients; use dense embeddings")
                self._update_param(param, group)
        return loss

    def _update_param(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        self._init_state(param, group)  # parameters added later through add_param_group
        state = self.state[param]
        beta1, beta2 = group["betas"]
        block_size = group["block_size"]
        state["step"] += 1
        step = state["step"]

        grad = param.grad.to(torch.float32)
        exp_avg = self._load(state, "exp_avg", block_size)
        exp_avg_sq = self._load(state, "exp_avg_sq", block_size)
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        del grad
        if "exp_avg_absmax" in state:
            self._store(state, "exp_avg", exp_avg, block_size)
            self._store(state, "exp_avg_sq", exp_avg_sq, block_size)

        # the update uses this step's float32 moments; only what is carried to the next step is quantized
        update = exp_avg.div(exp_avg_sq.sqrt().add_(group["eps"]))
        weights = param.detach().to(torch.float32)
        if group["weight_decay"] != 0:
            update.add_(weights, alpha=group["weight_decay"])

        weight_norm = float(weights.norm().clamp(max=group["clamp_value"]))
        update_norm = float(update.norm())
        trust_ratio = weight_norm / update_norm if weight_norm > 0 and update_norm > 0 else 1.0
        if group["bias_correction"]:
            bias_correction = math.sqrt(1 - beta2**step) / (1 - beta1**step)
        else:
            bias_correction = 1.0
        param.add_(update.to(param.dtype), alpha=-group["lr"] * bias_correction * trust_ratio)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by :meth:`state_dict` (e.g. from ``torch.load(..., weights_only=True)``).

        ``torch.optim.Optimizer.load_state_dict`` casts every state tensor to its parameter's dtype; the 8-bit
        codes are restored to uint8 afterwards (exact, as the codes are integers 0..255).
        """
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in MOMENT_KEYS:
                if f"{key}_absmax" in state:
                    state[key] = state[key].to(torch.uint8)
                    state[f"{key}_absmax"] = state[f"{key}_absmax"].to(torch.float32)
                elif key in state:
                    state[key] = state[key].to(torch.float32)

    def state_bytes(self) -> int:
        """Number of bytes held by tensors in the optimizer state (for memory reports and benchmarks)."""
        return sum(
            value.numel() * value.element_size()
            for state in self.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )
