"""Fuzzer of a checkpoint's meta.json and seal.json as a stranger hands them over: read and rebuilt in this process.

Run by the suite in a child process with a fixed seed and a bounded count
(test_checkpoint_trust.py::test_fuzzed_checkpoint_meta_never_runs_code_or_crashes); run more by hand::

    python tests/lightning_swarm/fuzz_checkpoint_meta.py --seed 1 --count 20000

Each case starts from one real checkpoint (a small LightningModule of ``ckpt_tiny_module``, allowed by name) and
mutates meta.json: structured edits resealed (the attacker controls every file: class paths of a module whose
import writes a marker file, of the standard library, malformed ones; init args of random JSON with class specs,
huge and negative sizes, wrong types; the files record, format fields), or bytes flipped, cut or added in
meta.json or seal.json without resealing. Then ``read_checkpoint`` and ``build_model``. A case must end in a model
or a ValueError (the refusals: CheckpointIntegrityError, ModelNotAllowedError, ...); anything else is reported,
and the marker file must never appear. Prints one JSON line of counts.
"""

import argparse
import copy
import json
import os
import random
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CLASS_PATHS = ["ckpt_tiny_module.TinyRegressor", "fuzz_evil_module.Evil", "fuzz_evil_module", "subprocess.Popen",
               "os.system", "builtins.eval", "recipes.dalle.__main__.main", "recipes._private.X", "recipes.Evil",
               "recipes.dalle.module.DALLEConfig", "recipes.dalle.module.DALLEModule", "ckpt_tiny_module.",
               ".ckpt_tiny_module.TinyRegressor", "ckpt_tiny_module.TinyRegressor\x00", "a" * 100000, "", 7, None,
               ["ckpt_tiny_module.TinyRegressor"], {"class_path": "os.system"}]
EDGE = [0, -1, 1, 8, 16, 2 ** 31, 10 ** 7, -10 ** 9, 2 ** 63, 0.5, 1e308, float("inf"), float("nan"), True, None,
        "", "x" * 1000, [], {}, [1, 2], {"class_path": "subprocess.Popen", "init_args": {"args": ["true"]}}]
ARGS = ["dim", "hidden", "lr", "extra", "__class__", "self", "class_path"]


def random_json(rng: random.Random, depth: int = 0):
    if depth > 5 or rng.random() < 0.5:
        return rng.choice(EDGE)
    if rng.random() < 0.5:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ARGS + ["class_path", "init_args"]
    return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def mutate_meta(rng: random.Random, meta: dict) -> dict:
    meta = copy.deepcopy(meta)
    for _ in range(rng.randrange(1, 4)):
        choice = rng.randrange(8)
        model, files = meta.get("model"), meta.get("files")
        if (choice in (0, 1, 2) and not isinstance(model, dict) or choice == 4 and not isinstance(files, dict)
                or choice == 1 and not isinstance(model.get("init_args"), dict)):
            continue  # an earlier edit replaced what this one would change
        if choice == 0:
            meta["model"]["class_path"] = rng.choice(CLASS_PATHS)
        elif choice == 1:
            meta["model"]["init_args"][rng.choice(ARGS)] = random_json(rng)
        elif choice == 2:
            meta["model"]["init_args"] = random_json(rng)
        elif choice == 3:
            meta["model"] = random_json(rng)
        elif choice == 4:
            name = rng.choice(list(meta["files"]) or ["model.safetensors"])
            meta["files"][name] = dict(meta["files"][name]) if isinstance(meta["files"].get(name), dict) else {}
            meta["files"][name][rng.choice(["sha256", "bytes"])] = rng.choice(EDGE)
        elif choice == 5:
            meta["files"] = random_json(rng)
        elif choice == 6:
            meta[rng.choice(["format", "format_version", "run_id", "global_epoch"])] = rng.choice(EDGE)
        else:
            meta = random_json(rng) if rng.random() < 0.2 else meta
            if not isinstance(meta, dict):
                return meta
    return meta


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    choice = rng.randrange(4)
    if choice == 0:
        return bytes(data[: rng.randrange(len(data))])
    if choice == 1:
        return bytes(data) + rng.randbytes(rng.randrange(1, 64))
    if choice == 2:
        for _ in range(rng.randrange(1, 5)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    return b"[" * rng.randrange(1, 200000)


def run(seed: int, count: int) -> dict:
    work = tempfile.mkdtemp(prefix="fuzz_ckpt_")
    marker = os.path.join(work, "marker")
    with open(os.path.join(work, "fuzz_evil_module.py"), "w") as f:
        f.write(f"open({marker!r}, 'w').write('imported')\nimport lightning.pytorch as pl\n"
                f"class Evil(pl.LightningModule):\n    pass\n")
    sys.path[:0] = [work, HERE]
    from ckpt_tiny_module import TinyRegressor
    from lightning_swarm.checkpoint.checkpoint_io import read_checkpoint, save_checkpoint
    from lightning_swarm.checkpoint.seal import SEAL_FILE, write_seal

    pristine = save_checkpoint(os.path.join(work, "pristine"), TinyRegressor(), global_epoch=1)
    with open(os.path.join(pristine, "meta.json"), "rb") as f:
        meta_bytes = f.read()
    with open(os.path.join(pristine, SEAL_FILE), "rb") as f:
        seal_bytes = f.read()
    meta = json.loads(meta_bytes)
    case = os.path.join(work, "case")
    shutil.copytree(pristine, case)
    rng = random.Random(seed)
    counts = dict(cases=0, built=0, refused=0, unexpected=0, first_unexpected=[])
    for index in range(count):
        kind = index % 4
        if kind < 3:  # the attacker rewrites meta.json and reseals it
            with open(os.path.join(case, "meta.json"), "w") as f:
                json.dump(mutate_meta(rng, meta), f)
            write_seal(case, "meta.json")
        else:  # bytes damaged in meta.json or seal.json, not resealed
            target = rng.choice(["meta.json", SEAL_FILE])
            with open(os.path.join(case, "meta.json"), "wb") as f:
                f.write(mutate_bytes(rng, meta_bytes) if target == "meta.json" else meta_bytes)
            with open(os.path.join(case, SEAL_FILE), "wb") as f:
                f.write(mutate_bytes(rng, seal_bytes) if target == SEAL_FILE else seal_bytes)
        counts["cases"] += 1
        try:
            read_checkpoint(case, training_state=bool(index % 2)).build_model(
                allowed_model_packages=["ckpt_tiny_module"])
            counts["built"] += 1
        except ValueError:
            counts["refused"] += 1
        except Exception as e:  # noqa: BLE001 (what the fuzzer is looking for)
            counts["unexpected"] += 1
            if len(counts["first_unexpected"]) < 5:
                counts["first_unexpected"].append(f"{type(e).__name__}: {str(e)[:200]}")
        assert not os.path.exists(marker), "a module named by meta.json was imported"
    assert "fuzz_evil_module" not in sys.modules
    shutil.rmtree(work, ignore_errors=True)
    return counts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the mutations' random seed")
    parser.add_argument("--count", type=int, default=600, help="mutated checkpoints to read")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.seed, args.count)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
