"""`precision: auto`: the decision table on substituted hardware facts, explicit precisions, the recipes' CLI."""

import logging

import pytest
import torch

from lightning_swarm import precision as swarm_precision
from lightning_swarm.precision import HardwareFacts, choose_precision, resolve_precision
from lightning_swarm.torch_ext import cpu_probe

BF16_GPU = HardwareFacts(device="cuda", cuda_capability=(8, 0))            # A100, RTX 30xx/40xx
FP16_GPU = HardwareFacts(device="cuda", cuda_capability=(7, 5))            # T4 (P100: 6.0, V100: 7.0)
AVX512_BF16_CPU = HardwareFacts(device="cpu", cpu_capability="AVX512", avx512_bf16=True, mkldnn_bf16=True)
AMX_CPU = HardwareFacts(device="cpu", cpu_capability="AVX512", amx=True, mkldnn_bf16=True)
AVX512_CPU = HardwareFacts(device="cpu", cpu_capability="AVX512", mkldnn_bf16=True)  # Skylake-X: oneDNN emulates bf16
AVX2_CPU = HardwareFacts(device="cpu", cpu_capability="AVX2")
ARM_CPU = HardwareFacts(device="cpu", cpu_arch="arm", cpu_capability="DEFAULT", mkldnn_bf16=True)
MPS = HardwareFacts(device="mps", cpu_arch="arm")


@pytest.mark.parametrize("facts, expected", [
    (BF16_GPU, "bf16-mixed"), (FP16_GPU, "16-mixed"), (AVX512_BF16_CPU, "bf16-mixed"), (AMX_CPU, "bf16-mixed"),
    (AVX512_CPU, "32-true"), (AVX2_CPU, "32-true"), (ARM_CPU, "32-true"), (MPS, "32-true"),
], ids=["bf16-gpu", "fp16-only-gpu", "avx512-bf16-cpu", "amx-cpu", "avx512-cpu", "avx2-cpu", "arm-cpu", "mps"])
def test_decision_table(facts, expected):
    chosen, reason = choose_precision(facts)
    assert chosen == expected and reason
    assert resolve_precision("auto", facts=facts) == expected


def test_auto_logs_the_choice_and_reason_once(caplog):
    """On Lightning's logger (which prints at INFO by default and does not propagate to the root logger)."""
    swarm_precision._logged.clear()
    lightning_logger = logging.getLogger("lightning.pytorch")
    lightning_logger.addHandler(caplog.handler)
    try:
        for _ in range(3):
            resolve_precision("auto", facts=FP16_GPU)
    finally:
        lightning_logger.removeHandler(caplog.handler)
    # a record that also reaches the root logger is seen twice by caplog's handler: count records, not calls
    records = {id(r): r for r in caplog.records}.values()
    messages = [r.getMessage() for r in records if "precision auto" in r.getMessage()]
    assert len(messages) == 1 and "16-mixed" in messages[0] and "loss scaling" in messages[0]


@pytest.mark.parametrize("facts", [AVX2_CPU, AVX512_CPU, FP16_GPU], ids=["avx2-cpu", "avx512-cpu", "fp16-only-gpu"])
def test_explicit_bf16_is_honoured_with_a_warning_where_emulated(facts):
    with pytest.warns(UserWarning, match="emulated"):
        assert resolve_precision("bf16-mixed", facts=facts) == "bf16-mixed"


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("precision, facts", [("bf16-mixed", AVX512_BF16_CPU), ("32-true", AVX2_CPU),
                                              (32, AVX2_CPU), ("16-mixed", FP16_GPU), (None, AVX2_CPU)])
def test_explicit_precision_is_passed_through_silently(precision, facts):
    assert resolve_precision(precision, facts=facts) == precision


def test_bad_precision_type_is_a_clear_error():
    with pytest.raises(ValueError, match="precision"):
        resolve_precision(["auto"])


def test_this_machine_is_probed_consistently():
    facts = swarm_precision.probe_hardware("cpu")
    assert facts.device == "cpu" and facts.cpu_capability == torch.backends.cpu.get_cpu_capability()
    assert facts.native_bf16 == (facts.cpu_arch == "x86" and (cpu_probe("torch.cpu._is_avx512_bf16_supported")
                                                               or cpu_probe("torch.cpu._is_amx_tile_supported")))


def test_tiny_config_resolves_to_fp32_on_a_cpu_without_native_bf16(monkeypatch, tmp_path):
    """The shipped config says `precision: auto`; on an AVX2-class CPU (substituted) the Trainer runs 32-true."""
    from recipes.cli import main

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    cli = main(["--config", "configs/dalle_tiny.yaml", "--trainer.accelerator", "cpu",
                "--trainer.default_root_dir", str(tmp_path), "--data.init_args.data_dir", str(tmp_path / "data")],
               run=False)
    assert cli.trainer.precision == "32-true"
    # ... and on a CPU with AVX512-BF16 (substituted) the same config trains in bf16-mixed
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    cli = main(["--config", "configs/dalle_tiny.yaml", "--trainer.accelerator", "cpu",
                "--trainer.default_root_dir", str(tmp_path), "--data.init_args.data_dir", str(tmp_path / "data")],
               run=False)
    assert cli.trainer.precision == "bf16-mixed"


def test_auto_works_from_the_command_line_of_the_clip_recipe(monkeypatch, tmp_path):
    from recipes.cli import main

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    cli = main(["--config", "configs/clip_tiny.yaml", "--trainer.precision", "32-true",
                "--trainer.precision", "auto", "--trainer.default_root_dir", str(tmp_path)], run=False)
    assert cli.trainer.precision == "32-true"
