"""``precision: auto``: the fastest training precision this machine runs natively, for any LightningModule.

Volunteers join with whatever they have, and the right precision differs by a factor of up to 40 between them:
bf16 autocast is ~2.5x faster than fp32 on CPUs with AVX512-BF16 or AMX, but *emulated* and ~40x slower on an
AVX2 laptop CPU; GPUs before Ampere (T4, P100, V100) have no bf16 but fast fp16 (which needs loss scaling).

Decision table (:func:`choose_precision`, a pure function of :class:`HardwareFacts`):

==========================================  ==============  =============================================
device                                      ``auto`` gives  why
==========================================  ==============  =============================================
CUDA GPU, compute capability >= 8.0         ``bf16-mixed``  native bf16 tensor cores, no loss scaling
CUDA GPU, compute capability < 8.0          ``16-mixed``    no native bf16; fp16 tensor cores + loss scaling
x86 CPU with AVX512-BF16 or AMX             ``bf16-mixed``  native bf16 matmuls (oneDNN)
any other CPU (AVX2, AVX-512 without BF16)  ``32-true``     bf16 would be emulated (~40x slower on AVX2)
ARM CPU (Apple Silicon, Graviton)           ``32-true``     bf16 autocast not measured to beat fp32 there
Apple MPS                                   ``32-true``     autocast on MPS is partial
==========================================  ==============  =============================================

Usage without LightningCLI::

    Trainer(precision=resolve_precision("auto", accelerator="auto"), ...)

The recipes' LightningCLI (``recipes/cli.py``) accepts ``trainer.precision: auto`` in YAML and on the command line.
"""

from __future__ import annotations

import platform
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_swarm.torch_ext import cpu_probe

AUTO = "auto"
BF16_PRECISIONS = ("bf16-mixed", "bf16-true", "bf16", "transformer-engine")


@dataclass(frozen=True)
class HardwareFacts:
    """What the precision choice depends on.

    Args:
        device: "cuda", "cpu" or "mps": where the model will train.
        cuda_capability: (major, minor) compute capability of the CUDA device (None off CUDA).
        cpu_arch: "x86" or "arm" (or "other").
        cpu_capability: ATen's kernel level, ``torch.backends.cpu.get_cpu_capability()`` ("AVX2", "AVX512", ...).
        avx512_bf16: the CPU has AVX512-BF16 instructions.
        amx: the CPU has AMX tiles (Sapphire Rapids and later; includes bf16 matmuls).
        mkldnn_bf16: oneDNN reports bf16 support (true on any AVX-512 CPU, emulated there without AVX512-BF16).
    """

    device: str
    cuda_capability: Optional[Tuple[int, int]] = None
    cpu_arch: str = "x86"
    cpu_capability: str = "DEFAULT"
    avx512_bf16: bool = False
    amx: bool = False
    mkldnn_bf16: bool = False

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls run in hardware (not emulated through fp32) on this device."""
        if self.device == "cuda":
            return self.cuda_capability is not None and self.cuda_capability >= (8, 0)
        if self.device == "cpu":
            return self.cpu_arch == "x86" and (self.avx512_bf16 or self.amx)
        return False


def choose_precision(facts: HardwareFacts) -> Tuple[str, str]:
    """The precision ``auto`` stands for on this hardware, and why (one sentence for the log)."""
    if facts.device == "cuda":
        if facts.native_bf16:
            return "bf16-mixed", f"CUDA GPU with compute capability {facts.cuda_capability} runs bf16 natively"
        return "16-mixed", (f"CUDA GPU with compute capability {facts.cuda_capability} has no native bf16: "
                            "fp16 with loss scaling")
    if facts.device == "cpu":
        if facts.native_bf16:
            feature = "AMX" if facts.amx else "AVX512-BF16"
            return "bf16-mixed", f"CPU with {feature} runs bf16 natively"
        if facts.cpu_arch == "arm":
            return "32-true", "ARM CPU: bf16 autocast is not measured to be faster than fp32 there"
        return "32-true", (f"CPU ({facts.cpu_capability}) without AVX512-BF16 or AMX would emulate bf16 "
                           "(~40x slower than fp32 on AVX2)")
    return "32-true", f"{facts.device}: mixed precision is not used there"


def cpu_arch() -> str:
    """"x86", "arm" or "other": this machine's CPU architecture."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i386", "i686"):
        return "x86"
    if machine.startswith(("arm", "aarch64")):
        return "arm"
    return "other"


def device_for(accelerator: Any = "auto") -> str:
    """The device a Trainer with this ``accelerator`` flag (a name or an Accelerator) trains on."""
    name = accelerator if isinstance(accelerator, str) else type(accelerator).__name__.replace("Accelerator", "")
    name = name.lower()
    if name in ("cuda", "gpu") or (name == "auto" and torch.cuda.is_available()):
        return "cuda"
    if name == "mps" or (name == "auto" and torch.backends.mps.is_available()):
        return "mps"
    return "cpu"


def probe_hardware(accelerator: Any = "auto") -> HardwareFacts:
    """The facts of this machine for a Trainer with this ``accelerator`` flag."""
    device = device_for(accelerator)
    return HardwareFacts(
        device=device,
        cuda_capability=tuple(torch.cuda.get_device_capability()) if device == "cuda" else None,
        cpu_arch=cpu_arch(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        avx512_bf16=cpu_probe("torch.cpu._is_avx512_bf16_supported"),
        amx=cpu_probe("torch.cpu._is_amx_tile_supported"),
        mkldnn_bf16=cpu_probe("torch.ops.mkldnn._is_mkldnn_bf16_supported"),
    )


_logged: set = set()


def resolve_precision(precision: Union[str, int, None] = AUTO, accelerator: Any = "auto",
                      facts: Optional[HardwareFacts] = None) -> Union[str, int, None]:
    """``precision`` as a Trainer takes it: ``"auto"`` becomes this hardware's choice (logged once with its
    reason); any explicit precision is returned unchanged, with a warning if it asks for emulated bf16.

    Args:
        precision: ``"auto"`` or any Lightning precision (``"32-true"``, ``"bf16-mixed"``, ``16``, ...).
        accelerator: the Trainer's ``accelerator`` flag, to know which device's facts apply.
        facts: the hardware facts to decide on (default: probed from this machine).
    """
    if precision is not None and not isinstance(precision, (str, int)):
        raise ValueError(f"precision must be 'auto' or a Lightning precision, got {precision!r}")
    if precision != AUTO and str(precision) not in BF16_PRECISIONS:
        return precision
    facts = facts or probe_hardware(accelerator)
    if precision == AUTO:
        chosen, reason = choose_precision(facts)
        if (chosen, reason) not in _logged:
            _logged.add((chosen, reason))
            # Lightning's own logger: shown like its "GPU available" lines, whatever the root logging config
            rank_zero_info(f"[lightning_swarm] precision auto -> {chosen}: {reason}")
        return chosen
    if not facts.native_bf16 and facts.device in ("cpu", "cuda"):
        chosen, _ = choose_precision(facts)
        hardware = facts.cpu_capability if facts.device == "cpu" else f"compute capability {facts.cuda_capability}"
        warnings.warn(
            f"precision={precision!r} on a {facts.device} without native bf16 ({hardware}): "
            f"bf16 is emulated and can be many times slower; precision='auto' would use {chosen!r} here",
            stacklevel=2,
        )
    return precision
