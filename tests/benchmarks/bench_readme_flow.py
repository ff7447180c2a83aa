"""The README's train -> reranker -> evaluate flow, run as a user runs it, timed, with its quality table.

In a fresh directory (a temporary one unless ``--workdir``), with the configs given by absolute path to this
checkout and this checkout's code on PYTHONPATH, it runs the three commands of the README one after the other:

    python -m recipes.dalle fit --config configs/dalle_tiny.yaml
    python -m recipes.clip fit --config configs/clip_tiny.yaml
    python -m inference.evaluate --checkpoint runs/dalle_tiny/checkpoints --json eval.json

and prints, for the record every quality figure of the README and docs/ must come with: the commit (and whether
the checkout had uncommitted changes), the machine class (CPU model, ATen's CPU capability, oneDNN's bf16 support,
the ISA oneDNN and MKL actually run, what ``precision: auto`` resolves to), each command's wall time and CPU time
(user + system of it and its children) with the load average before and after, and the figures of issue 28's
table: final validation image loss, random / CLIP top-1 accuracy over all captions, top1_gain +- its standard
error, two-shape captions random / top-1, held-out compositions random / top-1.

    python tests/benchmarks/bench_readme_flow.py                          # the README's commands, as shipped
    python tests/benchmarks/bench_readme_flow.py --emulate-avx2 --seed 1  # the AVX2 laptop class, another seed
    python tests/benchmarks/bench_readme_flow.py --dalle-args "--trainer.max_steps 5" --only dalle

``--emulate-avx2`` sets ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2`` for every
command (MKL's too: fp32 ``F.linear`` runs MKL's sgemm, which the first two leave at AVX-512) and checks in a child
process that all three took effect. ``precision: auto`` decides from CPUID flags, which no variable hides: on a CPU
with AVX512-BF16 or AMX it would still pick bf16-mixed, emulated on AVX2 kernels, where a laptop gets 32-true; the
script then adds ``--trainer.precision 32-true`` to both fits and says so.

By default HOME is the user's, so the embedded shapes data comes from (or is written to) ~/.cache/lightning_swarm
as for a user; ``--isolate-home`` gives the commands a fresh HOME inside the work directory (the data is written
anew, as on a first use).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import shlex
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paths import REPO  # noqa: E402

STEPS = ("dalle", "clip", "evaluate")
AVX2_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
DALLE_RUN = "runs/dalle_tiny"  # configs/dalle_tiny.yaml's default_root_dir, relative to the working directory

# Run in a child process with the commands' environment: what the machine looks like to them. oneDNN and MKL
# print the ISA they dispatch to on their verbose channels (stdout), which the parent reads.
PROBE = r"""
import json, torch
import torch.nn.functional as F
from lightning_swarm.precision import choose_precision, probe_hardware
from recipes.dalle.cpu_linear import cpu_facts, kernel_choice
x = torch.randn(8, 8)
F.linear(x, x)
torch.ops.mkldnn._linear_pointwise(x, x, None, "none", [], "")
facts = probe_hardware("auto")
precision, reason = choose_precision(facts)
print("PROBE " + json.dumps({
    "torch": torch.__version__, "threads": torch.get_num_threads(),
    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    "mkldnn_bf16_supported": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    "avx512_bf16": facts.avx512_bf16, "amx": facts.amx,
    "precision_auto": precision, "precision_reason": reason,
    "fp32_linear_kernel": kernel_choice(cpu_facts())}))
"""


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def commit_of(repo: Path) -> str:
    """``git rev-parse --short HEAD`` of ``repo``, with ``+dirty`` if tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def probe_machine(env: dict[str, str], cwd: Path) -> dict:
    """The machine as the commands see it (run in a child with their environment ``env``)."""
    probe_env = dict(env, ONEDNN_VERBOSE="1", MKL_VERBOSE="1")
    done = subprocess.run([sys.executable, "-c", PROBE], env=probe_env, cwd=cwd, capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"the machine probe failed:\n{done.stderr[-3000:]}")
    facts: dict = {"cpu_model": cpu_model(), "onednn_isa": "", "mkl_isa": ""}
    for line in done.stdout.splitlines():
        if line.startswith("PROBE "):
            facts.update(json.loads(line[len("PROBE "):]))
        elif line.startswith("onednn_verbose") and ",isa:" in line:
            facts["onednn_isa"] = line.split(",isa:", 1)[1].strip()
        elif line.startswith("MKL_VERBOSE") and " for Intel(R) 64 architecture " in line:
            facts["mkl_isa"] = line.split(" for Intel(R) 64 architecture ", 1)[1].split(",")[0].strip()
    return facts


def check_emulation(facts: dict) -> None:
    """Raise if the AVX2 emulation did not take effect in ATen, oneDNN and MKL."""
    problems = []
    if facts["cpu_capability"] != "AVX2":
        problems.append(f"ATen's CPU capability is {facts['cpu_capability']}")
    if "AVX-512" in facts["onednn_isa"] or "AVX2" not in facts["onednn_isa"]:
        problems.append(f"oneDNN runs {facts['onednn_isa'] or 'an unknown ISA'}")
    # MKL names the ISA it runs on Intel CPUs only (on AMD: "Intel(R) Architecture processors"): refuse AVX-512
    if "AVX-512" in facts["mkl_isa"] or ("Intel(R) Advanced Vector Extensions" in facts["mkl_isa"]
                                         and "AVX2" not in facts["mkl_isa"]):
        problems.append(f"MKL runs {facts['mkl_isa']}")
    if problems:
        raise RuntimeError("--emulate-avx2 did not take effect: " + "; ".join(problems))


def commands(repo: Path, python: str, seed: int | None, extra: dict[str, list[str]]) -> dict[str, list[str]]:
    """The README's three commands (configs by absolute path), then ``--seed``'s overrides, then ``extra[step]``.

    Args:
        repo: the checkout whose configs the fits read.
        python: the interpreter that runs them.
        seed: if given, the fits' ``seed_everything`` and data shuffle seed, and evaluate's sampling seed.
        extra: CLI overrides per step ("dalle", "clip", "evaluate"), appended last so they win.
    """
    fit_seed = ["--seed_everything", str(seed), "--data.init_args.seed", str(seed)] if seed is not None else []
    return {
        "dalle": [python, "-m", "recipes.dalle", "fit", "--config", str(repo / "configs" / "dalle_tiny.yaml"),
                  *fit_seed, *extra.get("dalle", [])],
        "clip": [python, "-m", "recipes.clip", "fit", "--config", str(repo / "configs" / "clip_tiny.yaml"),
                 *fit_seed, *extra.get("clip", [])],
        "evaluate": [python, "-m", "inference.evaluate", "--checkpoint", f"{DALLE_RUN}/checkpoints", "--json",
                     "eval.json", *(["--seed", str(seed)] if seed is not None else []), *extra.get("evaluate", [])],
    }


def run_command(name: str, argv: list[str], env: dict[str, str], cwd: Path, timeout: float | None) -> dict:
    """Run ``argv`` in ``cwd``, its output to ``cwd/logs/<name>.log``; returns its exit code, wall and CPU time."""
    log_path = cwd / "logs" / f"{name}.log"
    log_path.parent.mkdir(exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    print(f"[{name}] {shlex.join(argv)}", flush=True)
    with open(log_path, "w") as log:
        try:
            returncode = subprocess.run(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                        timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            returncode = "timeout"
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result = {"argv": argv, "returncode": returncode, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
              "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2), "log": str(log_path)}
    print(f"[{name}] exit {returncode}, {wall:.1f} s wall, {cpu:.1f} s CPU (log: {log_path})", flush=True)
    return result


def val_image_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, val/image_loss) of every validation the newest logger version under ``run_dir`` recorded.

    Lightning's default logger writes metrics.csv, or TensorBoard event files where tensorboard or tensorboardX is
    installed (read here with tensorboardX's protobuf classes: records of length, CRC, an Event, CRC).
    """
    versions = sorted((path.parent for path in run_dir.glob("**/version_*/hparams.yaml")),
                      key=lambda path: path.stat().st_mtime)
    if not versions:
        return []
    csv_file = versions[-1] / "metrics.csv"
    if csv_file.exists():
        with open(csv_file, newline="") as f:
            return [(int(row["step"]), float(row["val/image_loss"])) for row in csv.DictReader(f)
                    if row.get("val/image_loss")]
    from tensorboardX.proto.event_pb2 import Event

    losses = []
    for events in sorted(versions[-1].glob("events.out.tfevents.*")):
        data, offset = events.read_bytes(), 0
        while offset + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            losses += [(int(event.step), float(value.simple_value)) for value in event.summary.value
                       if value.tag == "val/image_loss"]
    return losses


def final_checkpoint(run_dir: Path) -> dict:
    """{"name", "global_epoch", "local_step"} of the checkpoint ``checkpoints/latest`` names ({} if none).

    A lone peer takes a global step (an optimizer update, and a step of the LR schedule) when it has
    ``target_batch_size`` samples, or earlier when hivemind's estimated time of the next epoch has passed (after a
    validation or a stall of the machine), so the updates per local step depend on timing and are part of the record.
    """
    root = run_dir / "checkpoints"
    try:
        name = (root / "latest").read_text().strip()
        if not name or "/" in name or name.startswith("."):
            return {}
        meta = json.loads((root / name / "meta.json").read_text())
    except (OSError, ValueError):
        return {}
    return {"name": name, "global_epoch": meta.get("global_epoch"), "local_step": meta.get("local_step")}


def figures(report: dict, val_losses: list[tuple[int, float]]) -> dict[str, float | None]:
    """Issue 28's figures from evaluate's JSON report and the DALL-E fit's validation losses (None: missing)."""
    def get(subset: str, key: str) -> float | None:
        return report.get(subset, {}).get(key)

    return {
        "final_val_image_loss": val_losses[-1][1] if val_losses else None,
        "random": get("all", "random_acc"), "clip_top1": get("all", "clip_top1_acc"),
        "top1_gain": get("all", "top1_gain"), "gain_se": get("all", "gain_se"),
        "two_shape_random": get("pair", "random_acc"), "two_shape_top1": get("pair", "clip_top1_acc"),
        "held_out_random": get("held_out", "random_acc"), "held_out_top1": get("held_out", "clip_top1_acc"),
        "captions": get("all", "captions"),
    }


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_summary(summary: dict) -> str:
    """The record as text: commit, machine, precision, times, and the figures as a markdown table."""
    m, f = summary["machine"], summary["figures"]
    lines = [
        f"commit {summary['commit']}, work directory {summary['workdir']}, HOME {summary['home']}"
        + (f" (HEAD moved to {summary['commit_at_end']} during the flow: a later command may have run newer code)"
           if summary.get("commit_at_end") else ""),
        f"machine: {m['cpu_model']}; ATen capability {m['cpu_capability']}; oneDNN bf16 supported "
        f"{m['mkldnn_bf16_supported']} (AVX512-BF16 {m['avx512_bf16']}, AMX {m['amx']}); oneDNN ISA {m['onednn_isa']}; "
        f"MKL ISA {m['mkl_isa'] or '-'}; fp32 linear {m['fp32_linear_kernel']}; torch {m['torch']}, "
        f"{m['threads']} threads",
        f"precision: auto -> {m['precision_auto']} ({m['precision_reason']})"
        + (f"; the fits ran {summary['precision_override']}" if summary.get("precision_override") else ""),
        f"environment: {' '.join(f'{k}={v}' for k, v in summary['env'].items()) or 'as given'}",
        "",
        "| command | exit | wall s | CPU s | load before/after |",
        "|---|---|---|---|---|",
    ]
    for name, run in summary["runs"].items():
        lines.append(f"| `{shlex.join(run['argv'][1:])}` | {run['returncode']} | {run['wall_s']} | {run['cpu_s']} | "
                     f"{run['load_before']} / {run['load_after']} |")
    gain = "-" if f["top1_gain"] is None else f"{f['top1_gain']:+.3f} +- {fmt(f['gain_se'])}"
    lines += [
        "",
        f"| final val image loss | random | CLIP top-1 | top1_gain +- se | two-shape random | two-shape top-1 | "
        f"held-out random | held-out top-1 | captions |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {fmt(f['final_val_image_loss'], 4)} | {fmt(f['random'])} | {fmt(f['clip_top1'])} | {gain} | "
        f"{fmt(f['two_shape_random'])} | {fmt(f['two_shape_top1'])} | {fmt(f['held_out_random'])} | "
        f"{fmt(f['held_out_top1'])} | {f['captions'] if f['captions'] is not None else '-'} |",
    ]
    checkpoint = summary.get("checkpoint") or {}
    if checkpoint:
        lines.append(f"final checkpoint {checkpoint['name']}: {checkpoint['global_epoch']} global steps (optimizer "
                     f"updates) in {checkpoint['local_step']} local steps")
    if summary.get("evaluate_table"):
        lines += ["", "evaluate's table:", *summary["evaluate_table"]]
    if summary["val_image_losses"]:
        lines.append("val image loss by step: " + ", ".join(f"{s}: {v:.5f}" for s, v in summary["val_image_losses"]))
    return "\n".join(lines)


def run_flow(workdir: Path, *, steps=STEPS, seed: int | None = None, extra: dict[str, list[str]] | None = None,
             emulate_avx2: bool = False, home: Path | None = None, python: str = sys.executable,
             timeout: float | None = None, repo: Path = REPO) -> dict:
    """Run the flow's ``steps`` in ``workdir`` (created if missing) and return the summary ``format_summary`` prints.

    Args:
        workdir: the user's working directory (should be fresh: runs/ and checkpoints/ are written there).
        steps: which of "dalle", "clip", "evaluate" to run, in that order.
        seed: see :func:`commands` (None: the configs' own seeds, exactly the README's commands).
        extra: CLI overrides per step, e.g. {"dalle": ["--trainer.max_steps", "5"]}.
        emulate_avx2: run every command with :data:`AVX2_ENV` (checked to have taken effect).
        home: HOME for the commands (None: the caller's, as for a user).
        python: the interpreter that runs the commands.
        timeout: seconds each command may run (None: no limit).
        repo: the checkout whose code and configs run.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    extra = {name: list(args) for name, args in (extra or {}).items()}
    env_changes = dict(AVX2_ENV) if emulate_avx2 else {}
    if home is not None:
        home.mkdir(parents=True, exist_ok=True)
        env_changes.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"))
    env = dict(os.environ, **env_changes)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
    commit = commit_of(repo)  # the code the commands run; checked again at the end (a long flow outlives commits)
    machine = probe_machine(env, workdir)
    precision_override = None
    if emulate_avx2:
        check_emulation(machine)
        if machine["precision_auto"] != "32-true":  # CPUID still shows bf16 hardware: a laptop would get 32-true
            precision_override = "--trainer.precision 32-true"
            for name in ("dalle", "clip"):
                extra[name] = ["--trainer.precision", "32-true", *extra.get(name, [])]
    argvs = commands(repo, python, seed, extra)
    runs = {}
    for name in steps:
        runs[name] = run_command(name, argvs[name], env, workdir, timeout)
        if runs[name]["returncode"] != 0:
            break
    eval_json = workdir / "eval.json"
    report = json.loads(eval_json.read_text())["report"] if "evaluate" in runs and eval_json.exists() else {}
    val_losses = val_image_losses(workdir / DALLE_RUN)
    table = []
    if "evaluate" in runs:  # evaluate's own table: every subset, every column (the last lines of its output)
        output = Path(runs["evaluate"]["log"]).read_text().splitlines()
        starts = [i for i, line in enumerate(output) if line.startswith("subset ")]
        if starts:
            table = [output[starts[-1]]]
            for line in output[starts[-1] + 1:]:
                if line.split()[:1] not in (["all"], ["held_out"], ["not_held_out"], ["single"], ["pair"]):
                    break
                table.append(line)
    commit_at_end = commit_of(repo)
    return {"commit": commit, "commit_at_end": commit_at_end if commit_at_end != commit else None,
            "workdir": str(workdir), "home": env.get("HOME", ""), "env": env_changes,
            "machine": machine, "precision_override": precision_override, "seed": seed, "runs": runs,
            "val_image_losses": val_losses, "figures": figures(report, val_losses), "report": report,
            "evaluate_table": table, "checkpoint": final_checkpoint(workdir / DALLE_RUN)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=None,
                        help="run here (must not hold an earlier run); default: a fresh temporary directory, kept")
    parser.add_argument("--only", nargs="+", choices=STEPS, default=list(STEPS), help="run only these steps")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed_everything and data seed of both fits, evaluate's sampling seed "
                             "(default: the configs' own, i.e. the README's commands unchanged)")
    for name in STEPS:
        parser.add_argument(f"--{name}-args", default="", help=f"extra CLI overrides for the {name} command "
                                                                 f"(one string, split like a shell)")
    parser.add_argument("--emulate-avx2", action="store_true",
                        help="run as the AVX2 laptop class: " + " ".join(f"{k}={v}" for k, v in AVX2_ENV.items()))
    parser.add_argument("--isolate-home", action="store_true",
                        help="give the commands a fresh HOME in the work directory (data written anew)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds each command may run")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary to this JSON file")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="readme_flow_"))
    if args.workdir and any((workdir / path).exists() for path in ("runs", "checkpoints", "eval.json")):
        parser.error(f"{workdir} holds an earlier run (runs/, checkpoints/ or eval.json): give a fresh --workdir")
    extra = {name: shlex.split(getattr(args, f"{name}_args")) for name in STEPS}
    summary = run_flow(workdir, steps=[s for s in STEPS if s in args.only], seed=args.seed, extra=extra,
                       emulate_avx2=args.emulate_avx2, home=workdir / "home" if args.isolate_home else None,
                       timeout=args.timeout)
    print()
    print(format_summary(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if all(run["returncode"] == 0 for run in summary["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
