"""How checkpoints sit under a root directory: names ``epoch_N`` (``epoch_N.K`` when an epoch is saved again),
their order by epoch number, and the ``latest`` file, which may only name a checkpoint inside its root."""

from __future__ import annotations

import os
import re
from typing import Iterable, List, Optional

LATEST_FILE = "latest"
# epoch_000012, or epoch_000012.1 when an epoch was saved again (e.g. on train end)
CHECKPOINT_NAME = re.compile(r"epoch_(\d+)(?:\.(\d+))?")


def checkpoint_name(global_epoch: int) -> str:
    """Directory name of the checkpoint taken at ``global_epoch`` (zero-padded to 6 digits for readability;
    order checkpoints with :func:`checkpoint_order`, since epoch 1000000 has more digits)."""
    return f"epoch_{global_epoch:06d}"


def checkpoint_order(name: str) -> Optional[tuple]:
    """(epoch, re-save number) of a checkpoint directory name, to sort by; None for names not of that form."""
    match = CHECKPOINT_NAME.fullmatch(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2) or 0)


def sort_checkpoint_names(names: Iterable[str]) -> List[str]:
    """The checkpoint names among ``names``, oldest first by epoch number (other names are left out)."""
    return sorted((n for n in names if checkpoint_order(n) is not None), key=checkpoint_order)


def check_latest_name(name: str, root: str) -> str:
    """``name`` (read from ``root/latest``) if it names a directory directly inside ``root``; raises
    ValueError otherwise, so a crafted ``latest`` cannot point a reader (or pruning) anywhere else."""
    if checkpoint_order(name) is None:
        raise ValueError(
            f"{root}/{LATEST_FILE} names {name!r}, not a checkpoint directory inside that root "
            f"(expected a name like {checkpoint_name(12)!r}); refusing to follow it"
        )
    return name


def read_latest_name(root: str) -> Optional[str]:
    """The checkpoint name ``root/latest`` holds (None if there is no such file); see :func:`check_latest_name`."""
    path = os.path.join(root, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        name = f.read().strip()
    if not name:
        return None
    check_latest_name(name, root)
    if os.path.islink(os.path.join(root, name)):  # a symlink would lead out of the root just the same
        target = os.path.realpath(os.path.join(root, name))
        if os.path.dirname(target) != os.path.realpath(root):
            raise ValueError(f"{root}/{name} is a symlink to {target}, outside the checkpoint root; refusing it")
    return name
