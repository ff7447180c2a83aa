"""Command line: ``python -m lightning_swarm.memory MODEL [options]`` (also ``lightning-swarm-memory``).

Examples::

    python -m lightning_swarm.memory gpt2-xl
    python -m lightning_swarm.memory dalle-12b --precision bf16-mixed --optimizer lamb --optimizer-bits 8 --offload
    python -m lightning_swarm.memory configs/dalle_tiny.yaml --batch-size 8 --checkpointing --json
    python -m lightning_swarm.memory 350M --dim 1024 --depth 24 --heads 16 --seq-len 512 --vocab-size 30522
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from lightning_swarm.memory.estimate import MemoryEstimate, estimate
from lightning_swarm.memory.inputs import ATTENTIONS, OPTIMIZERS, PRECISIONS, ModelShape, TrainingSetup
from lightning_swarm.memory.models import PUBLISHED_MODELS, ModelSource, describe_count, resolve, source_with_shape

ROWS = (
    ("weights", "weights"),
    ("gradients", "gradients"),
    ("optimizer state", "optimizer_state"),
    ("activations", "activations"),
    ("backward pass (total)", "backward_pass"),
    ("optimizer step (total)", "optimizer_step"),
    ("peak", "peak"),
)


def human_bytes(num_bytes: int) -> str:
    """Binary units: 512 B, 1.50 KiB, 3.25 GiB."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} PiB"


def format_table(result: MemoryEstimate) -> str:
    """An aligned stage x device table for one precision."""
    known = result.details["activations_known"]
    header = ("stage", "GPU", "CPU")
    lines = []
    for label, attr in ROWS:
        gpu, cpu = getattr(result.gpu, attr), getattr(result.cpu, attr)
        if attr == "activations" and not known:
            lines.append((label, "n/a", "n/a"))
        else:
            lines.append((label, human_bytes(gpu), human_bytes(cpu)))
    widths = [max(len(row[i]) for row in (header, *lines)) for i in range(3)]
    fmt = f"  {{:<{widths[0]}}}  {{:>{widths[1]}}}  {{:>{widths[2]}}}"
    rule = "  " + "-" * (sum(widths) + 4)
    out = [fmt.format(*header), rule]
    for i, row in enumerate(lines):
        if ROWS[i][1] == "backward_pass":
            out.append(rule)
        out.append(fmt.format(*row))
    return "\n".join(out)


def describe_setup(setup: TrainingSetup, source: ModelSource, sharing: bool) -> str:
    shape = source.shape
    seq_len = setup.seq_len or (shape.seq_len if shape else None)
    parts = [
        f"{setup.optimizer.upper() if setup.optimizer == 'lamb' else 'Adam'} {setup.optimizer_bits}-bit",
        "offloaded to CPU" if setup.offload else "on the device",
        f"batch {setup.batch_size}" + (f" x {seq_len} tokens" if seq_len else ""),
        "reversible layers" if setup.reversible else ("gradient checkpointing" if setup.checkpointing else "no checkpointing"),
    ]
    if source.shared != source.unshared:
        parts.append("shared weights counted once" if sharing else "no parameter sharing")
    if shape is not None:
        parts.append(f"{setup.attention or shape.attention} attention")
    if setup.device == "cpu":
        parts.append("CPU-only peer")
    return ", ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-swarm-memory",
        description="Estimate the GPU and CPU memory of training a transformer, stage by stage.",
        epilog=__doc__.split("Examples::", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", help=f"a published model ({', '.join(PUBLISHED_MODELS)}), a parameter count "
                        "(1.5B, 350M, 6e9) or a LightningCLI YAML config (counted exactly on the meta device)")
    parser.add_argument("--precision", choices=(*PRECISIONS, "all"), default="all",
                        help="fp32, or autocast mixed precision with fp32 weights (default: all three)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    parser.add_argument("--optimizer-bits", type=int, choices=(32, 8), default=32,
                        help="8 = bitsandbytes blockwise 8-bit optimizer states")
    parser.add_argument("--offload", action=argparse.BooleanOptionalAction, default=False,
                        help="run the optimizer on the CPU (hivemind offload_optimizer)")
    parser.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=None,
                        help="gradient checkpointing of every layer (default: as the model is configured)")
    parser.add_argument("--reversible", action=argparse.BooleanOptionalAction, default=None,
                        help="reversible layers (default: as the model is configured)")
    parser.add_argument("--sharing", action=argparse.BooleanOptionalAction, default=None,
                        help="count shared weights once (default: on for configs, off for published models)")
    parser.add_argument("--unique-layers", type=int, default=None,
                        help="published models with --sharing: distinct layers kept (default 1, ALBERT-style)")
    parser.add_argument("--batch-size", type=int, default=1, help="samples per local forward/backward pass")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: the model's)")
    parser.add_argument("--attention", choices=ATTENTIONS, default=None,
                        help="naive (keeps the s x s attention matrix) or sdpa (fused kernel); default: the model's")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu = a CPU-only peer: everything is counted as RAM")
    shape = parser.add_argument_group("shape", "override the shape, or give one to a bare parameter count")
    for name in ("dim", "depth", "heads", "vocab-size", "ff-dim"):
        shape.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--model-class", default=None,
                        help="configs without class_path: the LightningModule class, as package.module.Class")
    parser.add_argument("--json", action="store_true", help="print JSON (bytes) instead of tables")
    return parser


def run(args: argparse.Namespace) -> dict:
    """Estimate for the parsed arguments; returns the JSON-ready report and prints nothing."""
    unique_layers = args.unique_layers
    if args.sharing and unique_layers is None and args.model.lower() in PUBLISHED_MODELS:
        unique_layers = 1
    bare_shape = None
    if None not in (args.dim, args.depth, args.heads, args.seq_len):
        bare_shape = ModelShape(dim=args.dim, depth=args.depth, heads=args.heads, seq_len=args.seq_len,
                                vocab_size=args.vocab_size or 0, ff_dim=args.ff_dim)
    source = resolve(args.model, args.model_class, unique_layers, bare_shape)
    if source.shape is None and bare_shape is not None:  # a config whose model has no memory_profile()
        source = replace(source, shape=bare_shape)
    source = source_with_shape(source, dim=args.dim, depth=args.depth, heads=args.heads,
                               vocab_size=args.vocab_size, ff_dim=args.ff_dim)
    if args.sharing is False and args.unique_layers is not None:
        raise ValueError("--unique-layers needs --sharing")
    sharing = args.sharing
    if sharing is None:  # published models are unshared unless --unique-layers says otherwise
        sharing = args.unique_layers is not None or args.model.lower() not in PUBLISHED_MODELS
    params = source.shared if sharing else source.unshared
    shape = source.shape
    precisions = PRECISIONS if args.precision == "all" else (args.precision,)
    reports = []
    for precision in precisions:
        setup = TrainingSetup(
            precision=precision,
            optimizer=args.optimizer,
            optimizer_bits=args.optimizer_bits,
            offload=args.offload,
            checkpointing=args.checkpointing if args.checkpointing is not None else bool(shape and shape.checkpointing),
            reversible=args.reversible if args.reversible is not None else bool(shape and shape.reversible),
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            attention=args.attention,
            device=args.device,
        )
        reports.append(estimate(params, shape, setup))
    return {
        "model": source.name,
        "source": source.note,
        "parameters": params.numel,
        "parameters_shared": source.shared.numel,
        "parameters_unshared": source.unshared.numel,
        "sharing": sharing,
        "shape": None if shape is None else {k: getattr(shape, k) for k in shape.__dataclass_fields__},
        "estimates": reports,
    }


def render(report: dict) -> str:
    """Human-readable tables, one per precision."""
    lines = [f"{report['model']}: {describe_count(report['parameters'])} trainable parameters"
             + (f" ({describe_count(report['parameters_unshared'])} without sharing)"
                if report["parameters_unshared"] != report["parameters"] else "")]
    if report["source"]:
        lines.append(f"  source: {report['source']}")
    for result in report["estimates"]:
        lines.append("")
        lines.append(f"{result.setup.precision}: {describe_setup(result.setup, _SourceView(report), report['sharing'])}")
        lines.append(format_table(result))
    if report["estimates"] and not report["estimates"][0].details["activations_known"]:
        lines.append("")
        lines.append("activations not estimated: give the shape with --dim --depth --heads --seq-len [--vocab-size], "
                     "or give the config's model a memory_profile() method")
    return "\n".join(lines)


class _SourceView:
    """Just enough of a ModelSource for describe_setup when rendering a finished report."""

    def __init__(self, report: dict):
        self.shape = ModelShape(**report["shape"]) if report["shape"] else None
        self.shared, self.unshared = report["parameters_shared"], report["parameters_unshared"]


def to_json(report: dict) -> str:
    payload = dict(report)
    payload["estimates"] = [result.to_dict() for result in report["estimates"]]
    return json.dumps(payload, indent=2)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m lightning_swarm.memory`` and the ``lightning-swarm-memory`` script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        report = run(args)
    except ValueError as err:
        parser.error(str(err))
    try:
        print(to_json(report) if args.json else render(report))
        sys.stdout.flush()
    except BrokenPipeError:  # piped into `head`: stop quietly (Python docs' recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
