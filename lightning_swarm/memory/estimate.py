"""Training memory formulas: weights, gradients, optimizer state, activations, per stage and per device.

Everything here is plain arithmetic on three descriptions (defined in :mod:`lightning_swarm.memory.inputs`):

- :class:`ParameterInventory` — how many parameter elements the optimizer sees and how they are split
  into tensors (8-bit optimizers keep small tensors in 32 bits and add one fp32 scale per block).
- :class:`ModelShape` — the transformer's shape (width, depth, heads, tokens per sample, logits), which
  sets the activation memory.
- :class:`TrainingSetup` — precision, optimizer, offloading, checkpointing, reversible layers, batch.

:func:`estimate` combines them into a :class:`MemoryEstimate`: bytes on the GPU and on the CPU for each
component (weights, gradients, optimizer state, activations) and for each stage of a training step
(the backward pass and the optimizer step), and the peak of each device.

Conventions (why the numbers are what they are):

- Parameters are stored in fp32 in every precision: Lightning's ``16-mixed`` and ``bf16-mixed`` run
  the forward under autocast and keep fp32 weights, fp32 gradients and fp32 optimizer moments. So
  mixed precision only changes activations (16-bit instead of 32-bit), and adds the 16-bit copies of
  the weights that autocast makes and keeps for the backward pass. fp16 and bf16 have equal sizes.
- Gradients are held for the whole step (collaborative training accumulates them over local steps
  until the swarm reaches its target batch size), so the backward-pass high point is
  weights + gradients + optimizer state + activations + the transient gradient of the logits.
- Adam and LAMB both keep two moments per parameter. 32-bit moments take 4 bytes per element; 8-bit
  moments (bitsandbytes, blockwise) take 1 byte per element plus one fp32 absmax per block of 256
  elements, and tensors with fewer than 4096 elements keep 32-bit moments. LAMB also keeps one fp32
  update norm per tensor.
- Offloading (hivemind's ``offload_optimizer=True``) moves the optimizer to the CPU: the CPU then holds
  the optimizer state, an fp32 master copy of the weights and an fp32 gradient buffer, and runs the
  step; the GPU keeps its weights and gradients and loses the optimizer state.
- Framework overheads are left out (CUDA context, the Python process, allocator caching).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from lightning_swarm.memory.inputs import (
    BNB_QUANTIZATION_MAP_BYTES,
    ModelShape,
    ParameterInventory,
    TrainingSetup,
)


@dataclass
class DeviceBytes:
    """Bytes on one device for each component and stage (all ints, bytes)."""

    weights: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    backward_pass: int = 0
    optimizer_step: int = 0
    peak: int = 0


@dataclass
class MemoryEstimate:
    """The result of :func:`estimate`: per-device bytes plus the inputs that produced them."""

    gpu: DeviceBytes
    cpu: DeviceBytes
    setup: TrainingSetup
    parameters: int
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "parameters": self.parameters,
            "setup": asdict(self.setup),
            "gpu": asdict(self.gpu),
            "cpu": asdict(self.cpu),
            "details": dict(self.details),
        }


def optimizer_state_bytes(params: ParameterInventory, optimizer: str, bits: int) -> int:
    """Bytes of optimizer state: two moments per trainable element.

    32-bit: 2 * 4 bytes per element. 8-bit (bitsandbytes blockwise): 2 * (1 byte per element in large
    tensors + 4 bytes per 256-element block) + 2 * 4 bytes per element of small tensors (< 4096 elements)
    + the two shared 256-entry fp32 quantization maps. LAMB adds one fp32 update norm per tensor.
    """
    if bits == 32:
        state = 2 * 4 * params.numel
    else:
        large = params.numel - params.small_numel
        state = 2 * (large + 4 * params.absmax_blocks) + 2 * 4 * params.small_numel + BNB_QUANTIZATION_MAP_BYTES
    if optimizer == "lamb":
        state += 4 * params.num_tensors
    return state


def optimizer_step_temporary_bytes(params: ParameterInventory, setup: TrainingSetup, on_gpu: bool) -> int:
    """Scratch memory while the optimizer steps.

    torch's 32-bit Adam on a GPU uses its multi-tensor ("foreach") path, which materialises one fp32
    temporary (the denominators) for all parameters at once: 4 bytes per element. Every other case
    (torch Adam on CPU, bitsandbytes kernels, LAMB) works tensor by tensor: one fp32 temporary of the
    largest tensor.
    """
    if on_gpu and setup.optimizer == "adam" and setup.optimizer_bits == 32:
        return 4 * params.numel
    return 4 * params.largest_numel


def layer_activation_bytes_per_token(
    shape: ModelShape, seq_len: int, compute_bytes: int, residual_bytes: int, softmax_fp32: bool, attention: str
) -> int:
    """Bytes one transformer layer keeps for the backward pass, per token.

    For width h, attention width A, feed-forward width F, heads a, sequence s, activation element size e
    and residual-stream element size r, a pre-norm layer keeps:

    - the inputs of its two norms, 2 * r * h (the residual stream: fp32 even under autocast);
    - the QKV projection input e*h, queries/keys/values 3*e*A, the output-projection input e*A;
    - "naive" attention: the softmax output, a*s*e per token (plus an fp32 copy, 4*a*s, when autocast
      runs the softmax in fp32); "sdpa": its output e*A and an fp32 log-sum-exp 4*a;
    - the feed-forward: its input e*h, the activation input e*F and the second projection input e*F
      (a gated feed-forward keeps both halves of the first projection and the gate output: 4*e*F);
    - with dropout: two residual dropout masks 2*h bytes, and for naive attention the attention-dropout
      mask a*s bytes plus its output a*s*e.

    With everything in 16 bits (e = r = 2, no fp32 softmax), A = h, F = 4h, naive attention and dropout,
    this is Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
    eq. 1): h * (34 + 5 * a * s / h) bytes per token.
    """
    h, a_dim, f, a, s, e = shape.dim, shape.attn_dim, shape.ff_dim, shape.heads, seq_len, compute_bytes
    total = 2 * residual_bytes * h + e * h + 3 * e * a_dim + e * a_dim
    if attention == "naive":
        total += a * s * e + (4 * a * s if softmax_fp32 else 0)
    else:
        total += e * a_dim + 4 * a
    total += e * h + (4 * e * f if shape.glu else 2 * e * f)
    if shape.dropout:
        total += 2 * h
        if attention == "naive":
            total += a * s * (1 + e)
    return total


def activation_bytes(shape: ModelShape, setup: TrainingSetup, weight_numel: int) -> tuple[int, int, dict]:
    """Activation memory of one forward/backward pass: (kept for backward, transient at backward start, parts).

    - Plain: depth * (one layer's activations, see :func:`layer_activation_bytes_per_token`) per token.
    - Gradient checkpointing: each layer's input (r*h per token per layer) plus one layer's full
      activations, recomputed during the backward pass.
    - Reversible layers: the two residual streams' outputs and reconstructed inputs (4*r*h per token)
      plus one layer's full activations; independent of depth.
    - The final norm's input and the head's input (r*h + e*h per token).
    - Logits: the fp32 log-probabilities the cross-entropy keeps (4 bytes per logit); the logits
      themselves are dropped when ``training_step`` returns the loss. At the start of the backward pass
      the fp32 gradients of the log-probabilities and of the logits exist at once (8 bytes per logit):
      that is the transient.
    - Mixed precision: autocast's 16-bit copies of the weights (2 bytes per weight), cached for the whole
      forward and kept for the backward pass.
    """
    seq_len = setup.seq_len or shape.seq_len
    attention = setup.attention or shape.attention
    tokens = setup.batch_size * seq_len
    e = setup.compute_bytes
    r = 4  # autocast keeps the residual stream (embeddings + fp32 norms) in fp32
    mixed = setup.precision != "fp32"
    layer = tokens * layer_activation_bytes_per_token(shape, seq_len, e, r, softmax_fp32=mixed, attention=attention)
    if setup.reversible:
        layers = tokens * 4 * r * shape.dim + layer
    elif setup.checkpointing:
        layers = shape.depth * tokens * r * shape.dim + layer
    else:
        layers = shape.depth * layer
    head = tokens * (r + e) * shape.dim
    logits_per_batch = setup.batch_size * shape.logits_elements() * seq_len // shape.seq_len
    logits = 4 * logits_per_batch
    weight_copies = 2 * weight_numel if mixed else 0
    parts = {"layers": layers, "head": head, "logits": logits, "weight_copies_16bit": weight_copies}
    return layers + head + logits + weight_copies, 8 * logits_per_batch, parts


def estimate(params: ParameterInventory, shape: ModelShape | None, setup: TrainingSetup) -> MemoryEstimate:
    """Bytes per device for each component and stage of a training step.

    ``shape`` may be None (a bare parameter count): activations are then left out (reported as 0 and
    ``details["activations_known"] = False``).

    Stages:
      backward pass  = weights + gradients + optimizer state (on that device) + activations + the
                       transient gradient of the logits (GPU, or CPU for a CPU-only peer);
      optimizer step = weights + gradients + optimizer state + the step's temporaries, on the device
                       that runs the optimizer;
      peak           = the larger of the two, per device.
    """
    weights = 4 * (params.numel + params.frozen_numel) + params.buffer_bytes
    gradients = 4 * params.numel
    state = optimizer_state_bytes(params, setup.optimizer, setup.optimizer_bits)
    if shape is not None:
        activations, transient, parts = activation_bytes(shape, setup, params.numel + params.frozen_numel)
    else:
        activations, transient, parts = 0, 0, {}

    gpu = DeviceBytes(weights=weights, gradients=gradients, activations=activations)
    cpu = DeviceBytes()
    if setup.offload:
        # hivemind's offloaded optimizer: fp32 master weights, fp32 gradient buffer and the state on CPU
        cpu.weights, cpu.gradients, cpu.optimizer_state = 4 * params.numel, 4 * params.numel, state
        step_device, step_temp = cpu, optimizer_step_temporary_bytes(params, setup, on_gpu=False)
    else:
        gpu.optimizer_state = state
        step_device = gpu
        step_temp = optimizer_step_temporary_bytes(params, setup, on_gpu=setup.device == "cuda")

    for dev in (gpu, cpu):
        dev.backward_pass = dev.weights + dev.gradients + dev.optimizer_state
        dev.optimizer_step = dev.weights + dev.gradients + dev.optimizer_state
    gpu.backward_pass += activations + transient
    step_device.optimizer_step += step_temp

    if setup.device == "cpu":  # a CPU-only peer: the "device" is the CPU
        gpu, cpu = DeviceBytes(), gpu
    for dev in (gpu, cpu):
        dev.peak = max(dev.backward_pass, dev.optimizer_step)

    details = {
        "activations_known": shape is not None,
        "activation_parts": parts,
        "logits_gradient_transient": transient,
        "optimizer_step_temporary": step_temp,
    }
    return MemoryEstimate(gpu=gpu, cpu=cpu, setup=setup, parameters=params.numel, details=details)
