"""What a peer's log says about its gradient rounds (hivemind logs the outcome of each at INFO with the strategy's
``verbose``): which global steps a peer averaged with every part of the result back.

A round can come back partial on any loaded machine: hivemind leaves a sender out of a round when its next part is
``next_chunk_timeout`` late, and a reducer when its next result is twice that late; each peer then keeps values of its
own for what it lost ("Averaging: received 89.7% results"). Tests that compare the peers' parameters compare them
after the steps both peers completed."""

from __future__ import annotations

import re
from typing import Set

STEP_BEGINS = re.compile(r"Beginning optimizer step #(\d+)")
# a round that left a peer with values of its own for some part: hivemind's partial result ("Averaging: received
# 89.7% results"), a failed or skipped gradient round, a refused reducer result or sender part (ours)
ROUND_INCOMPLETE = re.compile(r"received [\d.]+% results|Averaging gradients failed|local gradients|Skipped averaging|"
                              r"\[lightning_swarm\] averaging:")
ROUND_LINES = re.compile(r"optimizer step|Averag|local gradients|results|out of sync|Skipped|refus|Transitioning")


def complete_steps(log: str, group_size: int = 2) -> Set[int]:
    """Global steps (k: from epoch k to k + 1) whose gradient round this log's peer averaged with ``group_size``
    peers and got every part of back."""
    complete, step = set(), None
    for line in log.splitlines():
        begins = STEP_BEGINS.search(line)
        if begins:
            step = int(begins.group(1))
        elif step is not None and f"Averaged gradients with {group_size} peers" in line:
            complete.add(step)
        elif step is not None and ROUND_INCOMPLETE.search(line):
            complete.discard(step)
            step = None  # anything later in this step is not trusted either
    return complete


def round_lines(log: str) -> str:
    """hivemind's lines about a peer's averaging rounds and global steps (for a failure message)."""
    return "\n".join(line[:200] for line in log.splitlines() if ROUND_LINES.search(line))
