"""Start a recipe's command line before the address of the peer it joins is known:

    python tests/join_later.py PEERS_FILE -m recipes.dalle fit --config ...

imports torch, Lightning, hivemind, the strategy and what the module's package exports while it waits for PEERS_FILE (a JSON list
of multiaddrs, written whole by :func:`write_initial_peers`), then runs ``python -m recipes.dalle fit --config ...
--trainer.strategy.init_args.initial_peers '<the list>'`` in this process: the command a user types with the address
the first peer printed. A test starts the joining peer's process together with the peer it joins, so that its
imports overlap that peer's start (on a 2-core machine one core is idle while a peer starts) instead of following it.
After 300 s without the file it exits with an error.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import time
from pathlib import Path
from typing import List

WAIT_SECONDS = 300.0


def write_initial_peers(path: Path, initial_peers: List[str]) -> None:
    """Hand the waiting process the peers to join: ``path`` appears at once, whole."""
    temporary = Path(str(path) + ".tmp")
    temporary.write_text(json.dumps(initial_peers))
    os.replace(temporary, path)


def main(argv: List[str]) -> None:
    if len(argv) < 3 or argv[1] != "-m":
        raise SystemExit("usage: join_later.py PEERS_FILE -m MODULE [ARGS...]")
    path, module, args = Path(argv[0]), argv[2], argv[3:]
    sys.path[0] = os.getcwd()  # as `python -m` has it (not this file's folder, tests/)
    import lightning_swarm.strategy  # noqa: F401  (torch, Lightning, hivemind: imported while waiting)

    package = importlib.import_module(module)  # the package (recipes.dalle) or module -m runs, not its __main__
    for name in getattr(package, "__all__", []):  # what the package exports (recipes.dalle's are lazy imports)
        getattr(package, name)
    importlib.import_module("recipes.cli")
    deadline = time.monotonic() + WAIT_SECONDS
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"join_later.py: no initial peers in {path} after {WAIT_SECONDS:.0f} s")
        time.sleep(0.05)
    initial_peers = json.loads(path.read_text())
    sys.argv = [module, *args, "--trainer.strategy.init_args.initial_peers", json.dumps(initial_peers)]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
