"""The on-disk checkpoint format: safetensors + JSON, written atomically, readable from any fsspec URL.

A checkpoint is a directory::

    model.safetensors        module.state_dict() (tied weights stored once, see safetensors.torch.save_model)
    training_state.safetensors  every tensor of the optimizer and scheduler states, flattened
    training_state.json      the non-tensor structure of those states; tensors appear as {"__tensor__": key}
    meta.json                run id, global epoch, samples seen, loss, time, ..., ``model``: the class path and
                             init args that rebuild the model (see ``model_spec``), and the sha256 and size of
                             each of the files above ("files"), which reading verifies
    seal.json                the sha256 of meta.json, and the run authority's signature when the monitor of a
                             run with an authority saved it (see ``seal``)

Checkpoints of one run live side by side under a root directory, next to a ``latest`` file that names the
newest complete one::

    root/latest              "epoch_000012"
    root/epoch_000010/...
    root/epoch_000012/...

Nothing read back is unpickled: tensors come from safetensors, everything else from JSON. Reading checks
meta.json against seal.json before parsing it and every other file against the sha256 in meta.json, so a flipped
bit, an edit or a truncated download is refused, not loaded. Unsigned, this catches corruption only (whoever can
replace the files can rewrite the hashes too); given the run's authority public key, reading also requires the
authority's signature. Rebuilding the model from meta.json imports only classes of allowed packages
(``model_spec``).
``latest`` must name a checkpoint directly inside its root; pruning orders checkpoints by epoch number.
A save writes into a hidden temporary directory, renames it into place, then replaces ``latest``
(``os.replace``), so a crash at any point leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Union

import fsspec
from fsspec.implementations.local import LocalFileSystem
import torch
from safetensors.torch import load_file, save_file, save_model, load_model

from lightning_swarm.checkpoint.layout import (  # noqa: F401 (part of this module's API)
    LATEST_FILE,
    check_latest_name,
    checkpoint_name,
    checkpoint_order,
    read_latest_name,
    sort_checkpoint_names,
)
from lightning_swarm.checkpoint.integrity import CheckpointIntegrityError, record_files, verify_files  # noqa: F401
from lightning_swarm.checkpoint.model_spec import build_model, check_against_weights, model_spec
from lightning_swarm.checkpoint.seal import (  # noqa: F401 (part of this module's API)
    MAX_META_BYTES,
    SEAL_FILE,
    parse_json,
    read_sealed_meta,
    write_seal,
    written_before_seals,
)
from lightning_swarm.checkpoint.state_json import flatten_state, unflatten_state  # noqa: F401

if TYPE_CHECKING:
    from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

logger = logging.getLogger(__name__)

FORMAT_NAME = "lightning-swarm-checkpoint"
FORMAT_VERSION = 3  # 2: meta.json records each file's sha256 ("files"); 3: seal.json records meta.json's
MODEL_FILE = "model.safetensors"
STATE_TENSORS_FILE = "training_state.safetensors"
STATE_JSON_FILE = "training_state.json"
META_FILE = "meta.json"
CHECKPOINT_FILES = (MODEL_FILE, STATE_TENSORS_FILE, STATE_JSON_FILE, SEAL_FILE, META_FILE)
HASHED_FILES = (MODEL_FILE, STATE_TENSORS_FILE, STATE_JSON_FILE)  # meta.json's own hash is in seal.json
TMP_PREFIX = ".tmp-"

# --------------------------------------------------------------------------- writing


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _save_tensors(tensors: Dict[str, torch.Tensor], path: str) -> None:
    save_file(tensors, path)
    _fsync_file(path)


def write_checkpoint_dir(
    directory: str,
    module: torch.nn.Module,
    optimizer_states: List[dict],
    scheduler_states: List[dict],
    meta: Dict[str, Any],
    signer: Optional["RSAPrivateKey"] = None,
) -> None:
    """Write the files of one checkpoint into an existing, empty ``directory`` (not atomic by itself); ``signer``:
    the run authority's private key that signs its seal (None: unsigned)."""
    save_model(module, os.path.join(directory, MODEL_FILE))
    _fsync_file(os.path.join(directory, MODEL_FILE))
    tensors: Dict[str, torch.Tensor] = {}
    structure = dict(
        optimizers=[flatten_state(s, tensors, f"optimizers.{i}") for i, s in enumerate(optimizer_states)],
        schedulers=[flatten_state(s, tensors, f"schedulers.{i}") for i, s in enumerate(scheduler_states)],
    )
    _save_tensors(tensors, os.path.join(directory, STATE_TENSORS_FILE))
    _write_json(os.path.join(directory, STATE_JSON_FILE), structure)
    files = record_files(directory, HASHED_FILES)
    meta = dict(meta, format=FORMAT_NAME, format_version=FORMAT_VERSION, files=files)
    _write_json(os.path.join(directory, META_FILE), meta)
    write_seal(directory, META_FILE, signer)


def save_checkpoint(
    root: str,
    module: torch.nn.Module,
    optimizer_states: List[dict] = (),
    scheduler_states: List[dict] = (),
    *,
    global_epoch: int,
    run_id: Optional[str] = None,
    samples_seen: Optional[int] = None,
    loss: Optional[float] = None,
    extra_meta: Optional[Dict[str, Any]] = None,
    keep_last: Optional[int] = None,
    protected: Optional[set] = None,
    signer: Optional["RSAPrivateKey"] = None,
) -> str:
    """Atomically save a checkpoint under the local directory ``root`` and point ``root/latest`` at it.

    Args:
        root: local directory holding this run's checkpoints (created if missing).
        module: the model; its ``state_dict()`` is saved as safetensors.
        optimizer_states: ``optimizer.state_dict()`` of each optimizer.
        scheduler_states: ``scheduler.state_dict()`` of each LR scheduler.
        global_epoch: the collaborative step (or local step without a swarm) the state belongs to.
        run_id: the swarm's run id, recorded in meta.json.
        samples_seen: samples the whole run has trained on so far.
        loss: the latest training loss.
        extra_meta: more JSON-serializable fields for meta.json.
        keep_last: if set, delete all but the newest ``keep_last`` checkpoints afterwards.
        protected: names of checkpoints that pruning must not delete (e.g. still being uploaded).
        signer: the run authority's private key: signs the checkpoint (the monitor of a run with an authority).
    Returns:
        the path of the new checkpoint directory.
    """
    os.makedirs(root, exist_ok=True)
    name = checkpoint_name(global_epoch)
    suffix = 0
    while os.path.exists(os.path.join(root, name)):  # re-saving an epoch (e.g. on train end): never overwrite
        suffix += 1
        name = f"{checkpoint_name(global_epoch)}.{suffix}"
    final_dir = os.path.join(root, name)
    tmp_dir = os.path.join(root, f"{TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp_dir)
    meta = dict(
        run_id=run_id,
        global_epoch=int(global_epoch),
        samples_seen=None if samples_seen is None else int(samples_seen),
        loss=None if loss is None or not math.isfinite(loss) else float(loss),
        time=time.time(),
        time_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        module_class=f"{type(module).__module__}.{type(module).__qualname__}",
        model=model_spec(module),  # what rebuilds the model for sampling (class path + init args)
        **(extra_meta or {}),
    )
    try:
        write_checkpoint_dir(tmp_dir, module, list(optimizer_states), list(scheduler_states), meta, signer)
        os.rename(tmp_dir, final_dir)
        _write_latest(root, name)
    finally:
        if os.path.exists(tmp_dir):
            shutil.rmtree(tmp_dir, ignore_errors=True)
    if keep_last is not None:
        prune_checkpoints(root, keep_last, protected=protected)
    return final_dir


def _write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, f"{TMP_PREFIX}{LATEST_FILE}-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST_FILE))
    dir_fd = os.open(root, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def list_checkpoints(root: str) -> List[str]:
    """Names of the complete checkpoints under a local ``root``, oldest first by epoch number (directories
    not named like a checkpoint are not listed, so pruning never touches them)."""
    if not os.path.isdir(root):
        return []
    return sort_checkpoint_names(
        name for name in os.listdir(root) if os.path.isfile(os.path.join(root, name, META_FILE))
    )


def prune_checkpoints(root: str, keep_last: int, protected: Optional[set] = None) -> List[str]:
    """Delete all but the newest ``keep_last`` checkpoints (never the one ``latest`` names, nor ``protected``
    ones), and leftovers of interrupted saves. Returns the deleted names."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    protected = set(protected or ())
    latest = read_latest_name(root)
    if latest:
        protected.add(latest)
    names = list_checkpoints(root)
    deleted = [n for n in names[:-keep_last] if n not in protected]
    for name in deleted:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    for name in os.listdir(root):  # leftovers of saves that were killed midway
        if name.startswith(TMP_PREFIX):
            path = os.path.join(root, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
    return deleted


# --------------------------------------------------------------------------- reading


@dataclass
class Checkpoint:
    """A checkpoint read back: ``meta`` from meta.json, the model file's local path, and the training state."""

    url: str
    meta: Dict[str, Any]
    model_file: str
    optimizer_states: List[dict] = field(default_factory=list)
    scheduler_states: List[dict] = field(default_factory=list)

    def model_state_dict(self) -> Dict[str, torch.Tensor]:
        """The saved tensors by name (tied weights appear once; use :meth:`load_into` to restore a module)."""
        return load_file(self.model_file)

    def load_into(self, module: torch.nn.Module, strict: bool = True) -> None:
        """Copy the saved weights into ``module`` (in place, on the module's device)."""
        device = next(iter(module.parameters()), torch.empty(0)).device
        load_model(module, self.model_file, strict=strict, device=str(device))

    def build_model(self, device: str | torch.device = "cpu", allowed_model_packages: Iterable[str] = (),
                    base_class: Optional[type] = None) -> torch.nn.Module:
        """The model meta.json describes (class path + init args), with the saved weights, in eval mode.

        Args:
            device: where the model goes.
            allowed_model_packages: packages besides the project's ``recipes`` whose LightningModules the
                checkpoint may name (their code is imported and runs: name only packages you trust).
            base_class: the class the model must be (a subclass of), checked before anything is built.
        """
        options = dict(source=self.url, allowed_model_packages=allowed_model_packages, base_class=base_class)
        with torch.device("meta"):  # first without memory: init args must build the model the weights file holds
            check_against_weights(build_model(self.meta.get("model"), **options), self.model_file, self.url)
        module = build_model(self.meta.get("model"), **options).to(device)
        self.load_into(module)
        return module.eval()


def resolve_checkpoint_url(url: str) -> str:
    """The URL of one checkpoint directory: ``url`` itself if it holds meta.json, else the one ``url/latest``
    names. Raises FileNotFoundError with a clear message when neither exists."""
    fs, path = fsspec.core.url_to_fs(url)
    path = path.rstrip("/")
    if fs.isfile(f"{path}/{META_FILE}"):
        return url.rstrip("/")
    if fs.isfile(f"{path}/{LATEST_FILE}"):
        if isinstance(fs, LocalFileSystem):
            name = read_latest_name(path)
        else:
            name = check_latest_name(fs.cat_file(f"{path}/{LATEST_FILE}").decode().strip(), url)
        return f"{url.rstrip('/')}/{name}"
    raise FileNotFoundError(
        f"No checkpoint at {url!r}: expected {META_FILE} (a checkpoint directory) or {LATEST_FILE} "
        f"(a directory of checkpoints written by SwarmCheckpoint)"
    )


def _download(fs: Any, remote: str, local: str, limit: Optional[int], url: str) -> None:
    """Copy one remote file, refusing it before the download if it is larger than ``limit`` bytes."""
    if limit is not None:
        size = fs.size(remote)
        if not isinstance(size, int) or size > limit:
            raise CheckpointIntegrityError(f"Checkpoint {url}: {os.path.basename(remote)} has {size} bytes, more "
                                           f"than {limit} (meta.json's record or the format's cap); not downloading it")
    fs.get_file(remote, local)


def read_checkpoint(url: str, cache_dir: Optional[str] = None, training_state: bool = True,
                    authority_public_key: Optional[Union[str, "RSAPublicKey"]] = None,
                    run_id: Optional[str] = None) -> Checkpoint:
    """Read a checkpoint from a local path or any fsspec URL (``memory://``, ``s3://``, ``hf://user/repo``).

    Args:
        url: a checkpoint directory, or a root with a ``latest`` file (the newest checkpoint is read).
        cache_dir: where remote files are downloaded (default: a directory under the system's temp dir named
            after the URL, so reading the same URL again overwrites rather than piles up copies).
        training_state: also read the optimizer/scheduler states (False for sampling: only the weights).
        authority_public_key: the run's authority public key (``ssh-rsa ...``, a file holding it, or the key):
            given, only a checkpoint its monitor signed loads (see :mod:`.seal`).
        run_id: given, meta.json's run id must be this one.
    """
    url = resolve_checkpoint_url(url)
    fs, path = fsspec.core.url_to_fs(url)
    needed = HASHED_FILES if training_state else (MODEL_FILE,)
    if isinstance(fs, LocalFileSystem):
        local_dir = path
    else:
        url_hash = hashlib.sha256(url.encode()).hexdigest()[:16]
        local_dir = cache_dir or os.path.join(tempfile.gettempdir(), "lightning_swarm_checkpoints", url_hash)
        os.makedirs(local_dir, exist_ok=True)
        for name in (SEAL_FILE, META_FILE):  # first: they say how large the others may be
            if name == META_FILE or fs.isfile(f"{path}/{name}"):
                _download(fs, f"{path}/{name}", os.path.join(local_dir, name), MAX_META_BYTES, url)
            elif os.path.exists(os.path.join(local_dir, name)):
                os.remove(os.path.join(local_dir, name))  # a stale seal from an earlier download of this URL
    meta_bytes = read_sealed_meta(local_dir, META_FILE, url, authority_public_key, legacy_format=written_before_seals)
    meta = parse_json(meta_bytes, META_FILE, url)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise ValueError(f"{url!r} is not a {FORMAT_NAME} (meta.json format="
                         f"{str(meta.get('format') if isinstance(meta, dict) else None)[:80]!r})")
    if run_id is not None and meta.get("run_id") != run_id:
        raise CheckpointIntegrityError(f"Checkpoint {url} belongs to run {str(meta.get('run_id'))[:80]!r}, not "
                                       f"{run_id!r}; refusing to load it")
    files = meta.get("files")
    if not isinstance(fs, LocalFileSystem):
        for name in needed:
            record = files.get(name) if isinstance(files, dict) else None
            limit = record.get("bytes") if isinstance(record, dict) else None
            _download(fs, f"{path}/{name}", os.path.join(local_dir, name), limit if isinstance(limit, int) else None,
                      url)
    if files is None and isinstance(meta.get("format_version"), int) and meta["format_version"] < 2:
        logger.warning(f"Checkpoint {url}: written before sha256 hashes were recorded; its files are not verified")
    else:
        if not os.path.isfile(os.path.join(local_dir, SEAL_FILE)):
            logger.warning(f"Checkpoint {url}: written before seal.json existed; its meta.json is not verified")
        verify_files(local_dir, files, needed, url)
    if not training_state:
        return Checkpoint(url=url, meta=meta, model_file=os.path.join(local_dir, MODEL_FILE))
    with open(os.path.join(local_dir, STATE_JSON_FILE), "rb") as f:
        structure = parse_json(f.read(), STATE_JSON_FILE, url)
    tensors = load_file(os.path.join(local_dir, STATE_TENSORS_FILE))
    try:
        optimizer_states = [unflatten_state(s, tensors) for s in structure["optimizers"]]
        scheduler_states = [unflatten_state(s, tensors) for s in structure["schedulers"]]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"Checkpoint {url}: {STATE_JSON_FILE} is not a training state ({type(e).__name__})") from None
    return Checkpoint(url=url, meta=meta, model_file=os.path.join(local_dir, MODEL_FILE),
                      optimizer_states=optimizer_states, scheduler_states=scheduler_states)


def load_checkpoint(
    url: str,
    module: torch.nn.Module,
    optimizers: Optional[List[Any]] = None,
    schedulers: Optional[List[Any]] = None,
    strict: bool = True,
    authority_public_key: Optional[Union[str, "RSAPublicKey"]] = None,
) -> Dict[str, Any]:
    """Load the checkpoint at ``url`` into ``module`` (and optionally optimizers/schedulers); return its meta.

    A recipe calls this to start from a checkpoint, e.g. ``load_checkpoint("hf://user/run", model)``.
    ``authority_public_key``: given, only a checkpoint the run's authority signed loads (see :func:`read_checkpoint`).
    """
    checkpoint = read_checkpoint(url, authority_public_key=authority_public_key)
    checkpoint.load_into(module, strict=strict)
    for opt, state in zip(optimizers or [], checkpoint.optimizer_states):
        opt.load_state_dict(state)
    for sched, state in zip(schedulers or [], checkpoint.scheduler_states):
        sched.load_state_dict(state)
    logger.info(f"Loaded checkpoint {checkpoint.url} (global epoch {checkpoint.meta.get('global_epoch')})")
    return checkpoint.meta
