"""Tests of the training memory calculator (lightning_swarm.memory)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_swarm.memory import (
    ModelShape,
    ParameterInventory,
    TrainingSetup,
    count_module,
    estimate,
    from_config,
    main,
    named_model,
)
from lightning_swarm.memory.estimate import layer_activation_bytes_per_token, optimizer_state_bytes
from lightning_swarm.recipe_config import instantiate_model_config

REPO = Path(__file__).resolve().parents[2]

# A small LightningModule with both kinds of sharing: the output head is tied to the embedding and each
# encoder layer object is used at `share_every` consecutive depths.
TINY_MODULE = '''
import lightning as L
import torch
from torch import nn


class TinySharedLM(L.LightningModule):
    def __init__(self, vocab_size: int = 300, dim: int = 64, depth: int = 4, heads: int = 4,
                 seq_len: int = 32, share_every: int = 2):
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, dim)
        distinct = [nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
                    for _ in range(depth // share_every)]
        self.layers = nn.ModuleList(distinct[i // share_every] for i in range(depth))
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.embed.weight

    def memory_profile(self):
        h = self.hparams
        return dict(dim=h.dim, depth=h.depth, heads=h.heads, seq_len=h.seq_len, vocab_size=h.vocab_size,
                    attention="sdpa")
'''


@pytest.fixture
def tiny_config(tmp_path, monkeypatch):
    """A LightningCLI-style YAML whose model is TinySharedLM, importable from tmp_path."""
    (tmp_path / "tiny_memory_module.py").write_text(TINY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "tiny.yaml"
    config.write_text(textwrap.dedent("""
        seed_everything: 0
        trainer: {max_steps: 1}
        model:
          class_path: tiny_memory_module.TinySharedLM
          init_args: {vocab_size: 300, dim: 64, depth: 4, heads: 4, seq_len: 32, share_every: 2}
    """))
    return config


def _real_module(config_path):
    import yaml

    return instantiate_model_config(yaml.safe_load(Path(config_path).read_text())["model"])


def test_config_counts_equal_instantiated_module(tiny_config):
    source = from_config(tiny_config)
    module = _real_module(tiny_config)
    assert source.shared.numel == sum(p.numel() for p in module.parameters())
    assert source.unshared.numel == sum(p.numel() for _, p in module.named_parameters(remove_duplicate=False))
    assert source.shared.num_tensors == len(list(module.parameters()))
    # without sharing: every layer distinct and the head untied
    layer = sum(p.numel() for p in module.layers[0].parameters())
    assert source.unshared.numel - source.shared.numel == 2 * layer + 300 * 64
    assert source.shape == ModelShape(dim=64, depth=4, heads=4, seq_len=32, vocab_size=300, attention="sdpa")


def _names_model_class(config):
    import yaml

    from lightning_swarm.recipe_config import import_class

    model = yaml.safe_load(config.read_text()).get("model")
    return (isinstance(model, dict) and "class_path" in model
            and hasattr(import_class(model["class_path"]), "memory_profile"))


# recipe configs that name a model class with a transformer shape (memory_profile; the CLIP has two towers)
REPO_CONFIGS = [c for c in sorted((REPO / "configs").glob("*.yaml")) if _names_model_class(c)]


@pytest.mark.parametrize("config", REPO_CONFIGS, ids=[c.name for c in REPO_CONFIGS])
def test_repo_config_counts_equal_instantiated_module(config):
    source = from_config(config)
    assert source.shape is not None, f"{config.name}: the model should expose memory_profile()"
    if source.shared.numel > 100_000_000:  # too big to build for real here; the meta count is the answer
        return
    module = _real_module(config)
    assert source.shared.numel == sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert source.unshared.numel == sum(
        p.numel() for _, p in module.named_parameters(remove_duplicate=False) if p.requires_grad
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_adam_32bit_follows_weights_gradients_two_moments(precision):
    source = named_model("gpt2-xl")
    p = source.unshared.numel
    result = estimate(source.unshared, source.shape, TrainingSetup(precision=precision))
    gpu = result.gpu
    assert (gpu.weights, gpu.gradients, gpu.optimizer_state) == (4 * p, 4 * p, 8 * p)
    activations, transient = gpu.activations, result.details["logits_gradient_transient"]
    assert gpu.backward_pass == 16 * p + activations + transient
    assert gpu.optimizer_step == 16 * p + 4 * p  # torch's foreach Adam: one fp32 temporary per element
    assert gpu.peak == max(gpu.backward_pass, gpu.optimizer_step)
    assert vars(result.cpu) == vars(type(result.cpu)())  # nothing on the CPU


def _state_bytes(optimizer, keys=None):
    """Bytes of distinct tensors held in an optimizer's state (shared quantization maps counted once)."""
    seen = {}
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and (keys is None or key in keys):
                seen[value.data_ptr()] = value.numel() * value.element_size()
    return sum(seen.values())


@pytest.mark.parametrize("name", ["Adam8bit", "LAMB8bit", "Adam"])
def test_optimizer_state_matches_real_optimizers(tiny_config, name):
    import bitsandbytes as bnb

    module = _real_module(tiny_config)
    inventory, _ = count_module(module)
    cls = torch.optim.Adam if name == "Adam" else getattr(bnb.optim, name)
    optimizer = cls(module.parameters(), lr=1e-3)
    tokens = torch.randint(300, (2, 32))
    hidden = module.embed(tokens)
    for layer in module.layers:
        hidden = layer(hidden)
    module.head(hidden).square().mean().backward()
    optimizer.step()
    bits = 8 if "8bit" in name else 32
    kind = "lamb" if name.startswith("LAMB") else "adam"
    keys = {"exp_avg", "exp_avg_sq"} if name == "Adam" else None  # torch's scalar step counters aside
    assert _state_bytes(optimizer, keys) == optimizer_state_bytes(inventory, kind, bits)


def test_8bit_and_offload_move_exactly_the_optimizer_bytes(tiny_config):
    source = from_config(tiny_config)
    params, shape = source.shared, source.shape
    p = params.numel
    base = estimate(params, shape, TrainingSetup(precision="fp16-mixed"))
    for bits in (32, 8):
        on_gpu = estimate(params, shape, TrainingSetup(precision="fp16-mixed", optimizer_bits=bits))
        off = estimate(params, shape, TrainingSetup(precision="fp16-mixed", optimizer_bits=bits, offload=True))
        state = optimizer_state_bytes(params, "adam", bits)
        assert on_gpu.gpu.optimizer_state == state
        # 8-bit changes only the optimizer state
        for attr in ("weights", "gradients", "activations"):
            assert getattr(on_gpu.gpu, attr) == getattr(base.gpu, attr)
        assert base.gpu.backward_pass - on_gpu.gpu.backward_pass == base.gpu.optimizer_state - state
        # offloading moves the state to the CPU, which also gets fp32 master weights and a gradient buffer
        assert off.gpu.optimizer_state == 0 and off.cpu.optimizer_state == state
        assert (off.cpu.weights, off.cpu.gradients) == (4 * p, 4 * p)
        assert off.gpu.backward_pass == on_gpu.gpu.backward_pass - state
        assert off.gpu.optimizer_step == off.gpu.weights + off.gpu.gradients
        assert off.cpu.optimizer_step == 8 * p + state + 4 * params.largest_numel
    small, large = params.small_numel, p - params.small_numel
    saved = 2 * 4 * p - optimizer_state_bytes(params, "adam", 8)
    assert saved == 2 * 3 * large - 2 * 4 * params.absmax_blocks - 2 * 256 * 4
    assert small > 0 and large > 0


def test_activation_formula_reproduces_korthikanti():
    """16-bit activations with dropout: s*b*h*(34 + 5*a*s/h) bytes per layer (Korthikanti et al. 2022)."""
    shape = ModelShape(dim=1024, depth=24, heads=16, seq_len=512, vocab_size=30522, dropout=True)
    s, b, h, a = 512, 3, 1024, 16
    per_token = layer_activation_bytes_per_token(shape, s, 2, 2, softmax_fp32=False, attention="naive")
    assert s * b * per_token == s * b * h * 34 + 5 * a * s * s * b


def test_checkpointing_and_reversible_scale_with_depth_as_documented():
    shallow = ModelShape(dim=1600, depth=24, heads=25, seq_len=1024, vocab_size=50257)
    deep = ModelShape(dim=1600, depth=48, heads=25, seq_len=1024, vocab_size=50257)
    params = ParameterInventory.approximate(10**9)
    tokens = 2 * 1024

    def acts(shape, **flags):
        return estimate(params, shape, TrainingSetup(batch_size=2, **flags)).gpu.activations

    assert acts(deep) - acts(shallow) == 24 * tokens * layer_activation_bytes_per_token(deep, 1024, 4, 4, False, "naive")
    assert acts(deep, checkpointing=True) - acts(shallow, checkpointing=True) == 24 * tokens * 4 * 1600
    assert acts(deep, reversible=True) == acts(shallow, reversible=True)
    assert acts(deep, reversible=True) < acts(deep, checkpointing=True) < acts(deep)


def test_named_model_sharing_removes_layer_weights():
    plain, shared = named_model("dalle-12b"), named_model("dalle-12b", unique_layers=4)
    assert plain.unshared.numel == 12_000_000_000
    assert plain.unshared.numel - shared.shared.numel == 60 * plain.shape.layer_numel()


# Measures one real training step in a fresh process. glibc is told to serve every allocation of 64 KiB
# or more with mmap, so that RSS follows live tensor memory instead of what the heap keeps after frees
# (with the default dynamic threshold the same step measures ~35% more, all of it allocator retention).
PROBE = '''
import gc, json, os, sys
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (h // self.heads) ** -0.5
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        attn = scores.masked_fill(causal, float("-inf")).softmax(-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab, dim, depth, heads, seq_len):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.zeros(seq_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def training_step(model, tokens):
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def train(model, batch, seq_len, vocab, steps):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    tokens = torch.randint(vocab, (batch, seq_len))
    for _ in range(steps):  # gradients are kept between steps, as when accumulating for a swarm
        training_step(model, tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


cfg = json.loads(sys.argv[1])
torch.set_num_threads(1)
train(TinyGPT(cfg["vocab"], 64, 1, cfg["heads"], 16), 2, 16, cfg["vocab"], 2)  # load kernels, thread pools
gc.collect()
# ru_maxrss would include peaks from before this point (imports); reset the high-water mark (Linux)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = rss()
model = TinyGPT(cfg["vocab"], cfg["dim"], cfg["depth"], cfg["heads"], cfg["seq_len"])
train(model, cfg["batch"], cfg["seq_len"], cfg["vocab"], 2)
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
print(json.dumps({"peak_delta": peak - before, "sizes": [p.numel() for p in model.parameters()]}))
'''


def test_peak_estimate_within_25_percent_of_a_real_cpu_step(tmp_path):
    cfg = dict(vocab=512, dim=256, depth=4, heads=4, seq_len=128, batch=8)
    (tmp_path / "probe.py").write_text(PROBE)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    run = subprocess.run([sys.executable, str(tmp_path / "probe.py"), json.dumps(cfg)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    measured = json.loads(run.stdout)
    shape = ModelShape(dim=cfg["dim"], depth=cfg["depth"], heads=cfg["heads"], seq_len=cfg["seq_len"],
                       vocab_size=cfg["vocab"])
    params = ParameterInventory.from_sizes(measured["sizes"])
    result = estimate(params, shape, TrainingSetup(batch_size=cfg["batch"], device="cpu"))
    assert result.gpu.peak == 0
    assert measured["peak_delta"] > 64 * 2**20  # big enough for allocator noise not to matter
    assert abs(result.cpu.peak - measured["peak_delta"]) <= 0.25 * measured["peak_delta"]


def test_cli_json_and_table(capsys):
    assert main(["gpt2-xl", "--precision", "fp32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (only,) = report["estimates"]
    assert report["parameters"] == 1_542_000_000
    assert only["gpu"]["weights"] == 4 * 1_542_000_000 and only["setup"]["precision"] == "fp32"

    assert main(["gpt-j", "--optimizer", "lamb", "--optimizer-bits", "8", "--offload", "--checkpointing"]) == 0
    table = capsys.readouterr().out
    for precision in ("fp32", "fp16-mixed", "bf16-mixed"):
        assert f"\n{precision}: LAMB 8-bit, offloaded to CPU" in table
    for row in ("weights", "gradients", "optimizer state", "activations", "backward pass (total)", "peak"):
        assert f"  {row} " in table
    assert "GiB" in table

    assert main(["dalle-12b", "--unique-layers", "4", "--precision", "fp32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sharing"] and report["parameters"] == named_model("dalle-12b", unique_layers=4).shared.numel

    with pytest.raises(SystemExit) as exit_info:
        main(["not-a-model"])
    assert exit_info.value.code == 2
    assert "is not a published model" in capsys.readouterr().err


def test_module_entry_point_on_a_config(tiny_config):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tiny_config.parent), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run(
        [sys.executable, "-m", "lightning_swarm.memory", str(tiny_config), "--no-sharing", "--batch-size", "4",
         "--precision", "bf16-mixed", "--json"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    source = from_config(tiny_config)
    assert report["parameters"] == source.unshared.numel > source.shared.numel
    assert report["estimates"][0]["gpu"]["weights"] == 4 * source.unshared.numel
    assert report["estimates"][0]["setup"]["batch_size"] == 4
