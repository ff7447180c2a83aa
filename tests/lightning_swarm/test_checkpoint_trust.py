"""A checkpoint is a stranger's bytes: loading one imports only allowed model classes, instantiates nothing named in
its init args, refuses an edited meta.json, and (given the run's authority key) loads only signed checkpoints."""

import json
import os
import sys
import textwrap

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from ckpt_tiny_module import TinyRegressor
from fuzz_harnesses import CHECKPOINT_META_CASES, harness_output
from lightning_swarm.checkpoint.checkpoint_io import CheckpointIntegrityError, read_checkpoint, save_checkpoint
from lightning_swarm.checkpoint.model_spec import ModelNotAllowedError, build_model
from lightning_swarm.checkpoint.saver import CheckpointSaver
from lightning_swarm.checkpoint.seal import SEAL_FILE, write_seal

ANY_ARG_MODULE = '''
from typing import Any, Callable, Optional
import lightning.pytorch as pl
import torch

class AnyArgModule(pl.LightningModule):
    def __init__(self, extra: Any = None, untyped=None, activation: Optional[Callable] = None, width: int = 2):
        super().__init__()
        self.extra, self.untyped, self.activation = extra, untyped, activation
        self.layer = torch.nn.Linear(width, width)
'''


def rewrite_meta(directory, edit, reseal=True):
    """Change meta.json as an attacker who controls the whole directory would (resealed unless told not to)."""
    path = os.path.join(directory, "meta.json")
    with open(path) as f:
        meta = json.load(f)
    edit(meta)
    with open(path, "w") as f:
        json.dump(meta, f)
    if reseal:
        write_seal(directory, "meta.json")


@pytest.fixture
def attacker_modules(tmp_path, monkeypatch):
    """A module whose top-level code writes a marker file, and a module with untyped / Any init args, importable."""
    code_dir = tmp_path / "code"
    code_dir.mkdir()
    marker = tmp_path / "marker"
    (code_dir / "evil_ckpt_module.py").write_text(textwrap.dedent(f'''
        open({str(marker)!r}, "w").write("imported")
        import lightning.pytorch as pl

        class Evil(pl.LightningModule):
            pass
    '''))
    (code_dir / "anyarg_models.py").write_text(ANY_ARG_MODULE)
    monkeypatch.syspath_prepend(str(code_dir))
    yield marker
    for name in ("evil_ckpt_module", "anyarg_models"):
        sys.modules.pop(name, None)


def test_a_class_outside_the_allowed_packages_is_never_imported(tmp_path, attacker_modules):
    from inference.checkpoint import load_dalle

    path = save_checkpoint(str(tmp_path / "run"), TinyRegressor(), global_epoch=1)
    rewrite_meta(path, lambda meta: meta["model"].update(class_path="evil_ckpt_module.Evil"))
    checkpoint = read_checkpoint(path)  # the seal matches: this is what a stranger hands over
    with pytest.raises(ModelNotAllowedError, match=r"'evil_ckpt_module\.Evil'.*--allow-model-package evil_ckpt_module"):
        checkpoint.build_model()
    with pytest.raises(ModelNotAllowedError, match=r"evil_ckpt_module\.Evil"):
        load_dalle(path)  # inference.generate's path
    assert not attacker_modules.exists() and "evil_ckpt_module" not in sys.modules
    for class_path in ("recipes_evil.Evil", "recipes.dalle.__main__.X", "os.system", "recipes", "recipes..x",
                       "recipes.x;import os", ["recipes.dalle.module.DALLEModule"]):
        rewrite_meta(path, lambda meta: meta["model"].update(class_path=class_path))
        with pytest.raises(ValueError):
            read_checkpoint(path).build_model()
    # a class of an allowed package that is no LightningModule is refused after the import, before any call
    rewrite_meta(path, lambda meta: meta["model"].update(class_path="recipes.dalle.module.DALLEConfig"))
    with pytest.raises(ModelNotAllowedError, match="not a LightningModule"):
        read_checkpoint(path).build_model()
    # the named opt-in: the user trusts that package, so its code is imported
    rewrite_meta(path, lambda meta: meta["model"].update(class_path="evil_ckpt_module.Evil", init_args={}))
    spec = read_checkpoint(path).meta["model"]
    assert type(build_model(spec, allowed_model_packages=["evil_ckpt_module"])).__name__ == "Evil"
    assert attacker_modules.read_text() == "imported"


def test_nested_class_specs_in_init_args_are_never_instantiated(tmp_path, attacker_modules):
    import anyarg_models

    path = save_checkpoint(str(tmp_path / "run"), anyarg_models.AnyArgModule(), global_epoch=1)
    popen = {"class_path": "subprocess.Popen", "init_args": {"args": ["touch", str(attacker_modules)]}}
    for init_args in ({"extra": popen}, {"untyped": popen}, {"untyped": [1, {"deep": popen}]}):
        rewrite_meta(path, lambda meta: meta["model"].update(init_args=init_args))
        with pytest.raises(ModelNotAllowedError, match="class spec .*'subprocess.Popen'"):
            read_checkpoint(path).build_model(allowed_model_packages=["anyarg_models"])
    assert not attacker_modules.exists()
    # a string where a callable is expected stays a string: nothing it names is imported
    rewrite_meta(path, lambda meta: meta["model"].update(
        init_args={"activation": "evil_ckpt_module.Evil", "extra": {"plain": [1, 2]}, "width": 2}))
    module = read_checkpoint(path).build_model(allowed_model_packages=["anyarg_models"])
    assert module.activation == "evil_ckpt_module.Evil" and module.extra == {"plain": [1, 2]}
    assert not attacker_modules.exists() and "evil_ckpt_module" not in sys.modules
    rewrite_meta(path, lambda meta: meta["model"].update(init_args={"no_such_argument": 1}))
    with pytest.raises(ValueError, match=r"\['no_such_argument'\] are not arguments of AnyArgModule"):
        read_checkpoint(path).build_model(allowed_model_packages=["anyarg_models"])


def test_an_edited_meta_json_is_refused_by_the_integrity_check(tmp_path):
    path = save_checkpoint(str(tmp_path / "run"), TinyRegressor(), global_epoch=1)
    rewrite_meta(path, lambda meta: meta["model"].update(class_path="recipes.dalle.module.DALLEModule"),
                 reseal=False)
    with pytest.raises(CheckpointIntegrityError, match="meta.json has .* seal.json records"):
        read_checkpoint(path)
    os.remove(os.path.join(path, SEAL_FILE))  # and without the seal, a checkpoint of this format is refused too
    with pytest.raises(CheckpointIntegrityError, match="seal.json .* is missing"):
        read_checkpoint(path)


def test_signed_checkpoints_verify_and_others_are_refused_when_a_key_is_required(tmp_path):
    authority, stranger = RSAPrivateKey(), RSAPrivateKey()
    authority_text = authority.get_public_key().to_bytes().decode()
    key_file = tmp_path / "authority.pub"
    key_file.write_text(authority_text + "\n")
    signed = CheckpointSaver(str(tmp_path / "signed"), signer=authority).save(
        TinyRegressor(), [], [], global_epoch=4, run_id="run")
    for key in (authority_text, str(key_file), authority.get_public_key()):
        assert read_checkpoint(signed, authority_public_key=key, run_id="run").meta["global_epoch"] == 4
    read_checkpoint(signed)  # without a key the signature is not required
    with pytest.raises(CheckpointIntegrityError, match="belongs to run 'run', not 'other'"):
        read_checkpoint(signed, authority_public_key=authority_text, run_id="other")

    unsigned = save_checkpoint(str(tmp_path / "unsigned"), TinyRegressor(), global_epoch=4, run_id="run")
    with pytest.raises(CheckpointIntegrityError, match="is not signed"):
        read_checkpoint(unsigned, authority_public_key=authority_text)
    forged = save_checkpoint(str(tmp_path / "forged"), TinyRegressor(), global_epoch=4, run_id="run", signer=stranger)
    with pytest.raises(CheckpointIntegrityError, match="signature is not the given authority key's"):
        read_checkpoint(forged, authority_public_key=authority_text)
    # the authority's seal moved onto an edited meta.json: the hash no longer matches
    rewrite_meta(signed, lambda meta: meta.update(global_epoch=99), reseal=False)
    with pytest.raises(CheckpointIntegrityError, match="meta.json has"):
        read_checkpoint(signed, authority_public_key=authority_text)
    # a resealed edit carries no signature of the authority
    write_seal(signed, "meta.json")
    with pytest.raises(CheckpointIntegrityError, match="is not signed"):
        read_checkpoint(signed, authority_public_key=authority_text)


def test_the_moderators_monitor_signs_its_checkpoints(tmp_path):
    """The monitor's saver from its command line: with --authority-key (auth.issuer) each checkpoint is signed."""
    from lightning_swarm.auth.peer import SwarmAuth
    from lightning_swarm.auth.tokens import generate_key, save_key
    from lightning_swarm.monitor.__main__ import make_parser, make_saver

    public = save_key(generate_key(), str(tmp_path / "authority"))
    args = make_parser().parse_args(["--config", "c.yaml", "--checkpoint-dir", str(tmp_path / "ckpt"),
                                     "--authority-key", str(tmp_path / "authority")])
    saved = make_saver(args, SwarmAuth.for_moderator("run", args.authority_key)).save(
        TinyRegressor(), [], [], global_epoch=2, run_id="run")
    assert read_checkpoint(saved, authority_public_key=public, run_id="run").meta["global_epoch"] == 2
    # a monitor of that run without the authority's key saves unsigned checkpoints, which such readers refuse
    public_text = open(public).read().strip()
    unsigned = make_saver(args, SwarmAuth("run", public_text)).save(
        TinyRegressor(), [], [], global_epoch=3, run_id="run")
    with pytest.raises(CheckpointIntegrityError, match="is not signed"):
        read_checkpoint(unsigned, authority_public_key=public)


def test_a_trainer_told_the_authority_key_resumes_only_from_a_signed_checkpoint(tmp_path):
    import lightning.pytorch as pl

    from ckpt_tiny_module import RandomRegressionData
    from lightning_swarm.checkpoint.callback import SwarmCheckpoint

    authority = RSAPrivateKey()
    key = authority.get_public_key().to_bytes().decode()
    module = TinyRegressor()
    (optimizer,), (scheduler,) = module.configure_optimizers()
    states = [optimizer.state_dict()], [scheduler["scheduler"].state_dict()]
    signed = save_checkpoint(str(tmp_path / "signed"), module, *states, global_epoch=1, signer=authority)
    unsigned = save_checkpoint(str(tmp_path / "unsigned"), module, *states, global_epoch=1)

    def fit(resume_from):
        callback = SwarmCheckpoint(dirpath=str(tmp_path / "out"), resume_from=resume_from, resume_authority_key=key)
        pl.Trainer(max_steps=1, callbacks=[callback], logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, accelerator="cpu").fit(
            TinyRegressor(), RandomRegressionData())
        return callback

    assert fit(signed).resumed_meta["global_epoch"] == 1
    with pytest.raises(CheckpointIntegrityError, match="is not signed"):
        fit(unsigned)


def test_init_args_that_build_another_model_than_the_weights_are_refused_before_it_is_built(tmp_path):
    """An allowed class with hostile sizes: checked on the meta device against the weights file's header (the
    message is the check's, not the failed load's after a real build)."""
    path = save_checkpoint(str(tmp_path / "run"), TinyRegressor(dim=8), global_epoch=1)
    for init_args, message in (({"dim": 10 ** 6}, r"init_args build embed.weight of shape \(16, 1000000\)"),
                               ({"hidden": 10 ** 6}, "init_args build .* of shape"),
                               ({"dim": 6}, r"the weights file holds \(16, 8\)")):
        rewrite_meta(path, lambda meta: meta["model"].update(init_args=init_args))
        with pytest.raises(ValueError, match=message):
            read_checkpoint(path).build_model(allowed_model_packages=["ckpt_tiny_module"])
    rewrite_meta(path, lambda meta: meta["model"].update(init_args={"dim": 8}))
    assert read_checkpoint(path).build_model(allowed_model_packages=["ckpt_tiny_module"]).embed.weight.shape == (16, 8)


@pytest.mark.timeout(320)
def test_fuzzed_checkpoint_meta_never_runs_code_or_crashes(fuzz_harness_output):
    """600 mutated checkpoints (resealed meta.json edits: class paths, init args with class specs and hostile sizes,
    files records, format fields; bytes damaged in meta.json or seal.json) read and rebuilt in a child process with a
    fixed seed (fuzz_checkpoint_meta.py, in the child the suite's fuzz harnesses share: fuzz_harnesses.py): each
    ends in a model or a ValueError, and the module whose import writes a marker is never imported."""
    output = harness_output(fuzz_harness_output, "checkpoint_meta")  # fails on a signal death or an exception
    counts = json.loads(output.strip().splitlines()[-1])
    assert counts["cases"] == CHECKPOINT_META_CASES and counts["unexpected"] == 0, counts["first_unexpected"]
    assert counts["built"] > 10 and counts["refused"] > 300
