"""CenteredClip's alignment screen against the weight-1e9 / negated-gradient attacker and adaptive ones, and what it
costs honest swarms, also with non-identical data: simulated in one process (figures printed, nothing asserted).

The 3-peer swarm of tests/lightning_swarm/byzantine.py as in bench_worker_momentum.py (same model, data, learning
rate, epoch of 24 batches of 16 split among the peers as they race, BENCH_SPLITS=even: 8 each), aggregated as the
swarm does: the flat gradient cut into 3 slices, each reduced by one peer's reducer with the swarm's own
:func:`lightning_swarm.hivemind_ext.robust_allreduce.screen_and_aggregate` (the alignment screen, and the rules for
rounds of 1 and 2 senders) and its own :class:`~lightning_swarm.aggregation.SenderTrust` (weights: each peer's samples
in the epoch, the attacker's lowered to its record). The third peer:

- ``none``: honest (the reference of each line);
- ``neg``: sends its gradient negated (the swarm test's weight-1e9 attacker after screening);
- ``c=0.5``: sends half its gradient: goes along just at the default screen, full weight (an adaptive attacker);
- ``zero``: sends zeros with its full weight (a lazy or adaptive peer);
- ``x1000``: sends its gradient x1e3 (goes along: it keeps its weight, and CenteredClip must bound it);
- ``ascent``: sends its gradient x -1e3 (loud gradient ascent, issue 24's finding 0);
- ``absent``: sends nothing (the best any defence can do: the honest pair alone).

BENCH_BATCHES_PER_EPOCH=2 gives the epoch of the tiny recipe (32 samples: at most 2 peers compute in an epoch, so
no round has 3 senders). BENCH_HETERO=h gives each peer its own target ``y + h * x @ d_k`` (d_k random, one per peer:
non-identical data); the validation target is then the mean of the 3 peers' targets (the honest swarm's objective).
Printed per optimizer, epoch count and screen (``off``: plain CenteredClip): the honest swarm's validation loss and
its ratio to plain CenteredClip's (the screen's cost to honest swarms), and each attack's loss over the honest
swarm's with the same screen (mean and max over BENCH_SEEDS data offsets and splits).

Run: python tests/benchmarks/bench_alignment_screen.py
     BENCH_HETERO=0.3 BENCH_EPOCHS=4,12 BENCH_OPTIMIZERS=sgd,adamw python tests/benchmarks/bench_alignment_screen.py
Takes about a minute of one core per 100 trainings; the figures do not depend on machine load.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_worker_momentum import BATCH_SIZE, OPTIMIZERS, PEER_OFFSETS, split_batches  # noqa: E402
from lightning_swarm.aggregation import SenderTrust  # noqa: E402
from lightning_swarm.hivemind_ext.robust_allreduce import screen_and_aggregate  # noqa: E402
from peer_worker import TinyRegression, make_regression_data  # noqa: E402

NUM_SLICES = 3  # one per peer's reducer


def aggregate(messages: list, weights: list, senders: list, min_alignment, trusts: list) -> torch.Tensor:
    """The swarm's average of ``messages`` (one flat gradient per sender, ``senders``: their peer indices): each
    slice by its own reducer (the swarm's :func:`screen_and_aggregate`), which keeps its own trust in each peer. A
    slice the reducer refuses (with the screen: a lone sender without a record) is zero: the peers that tagged
    along keep their zeros."""
    result = torch.empty_like(messages[0])
    size = messages[0].numel()
    bounds = [round(i * size / NUM_SLICES) for i in range(NUM_SLICES + 1)]
    for trust, first, last in zip(trusts, bounds[:-1], bounds[1:]):
        records = None if min_alignment is None else [trust.record(sender) for sender in senders]
        part, _, judged = screen_and_aggregate([message[first:last] for message in messages], weights, None,
                                               "centered_clip", None, 20, min_alignment, records)
        result[first:last] = 0.0 if part is None else part
        trust.update({senders[i]: record for i, record in judged.items()})
    return result


def train(optimizer_name: str, epochs: int, min_alignment, attack: str, start: int, data, hetero: float) -> float:
    """One simulated swarm; returns the validation loss on the honest swarm's objective."""
    (x, y), (x_val, y_val), directions = data
    model = TinyRegression()
    params = list(model.parameters())
    optimizer = OPTIMIZERS[optimizer_name](params)
    position = [start + offset for offset in PEER_OFFSETS]
    splits = torch.Generator().manual_seed(start)  # the same splits for every variant
    trusts = [SenderTrust() for _ in range(NUM_SLICES)]
    for _ in range(epochs):
        messages, weights = [], []
        for peer, batches in enumerate(split_batches(splits)):
            gradient = torch.zeros(sum(p.numel() for p in params))
            for _ in range(batches):
                i = position[peer]
                position[peer] += BATCH_SIZE
                inputs = x[i:i + BATCH_SIZE]
                target = y[i:i + BATCH_SIZE] + hetero * (inputs @ directions[peer])
                model.zero_grad()
                torch.nn.functional.mse_loss(model.net(inputs), target).backward()
                gradient += torch.cat([p.grad.reshape(-1) for p in params]) / batches
            messages.append(gradient)
            weights.append(batches * BATCH_SIZE)
        if attack == "neg":
            messages[2] = -messages[2]
        elif attack.startswith("c="):
            messages[2] = float(attack[2:]) * messages[2]
        elif attack == "x1000":
            messages[2] = 1e3 * messages[2]
        elif attack == "ascent":
            messages[2] = -1e3 * messages[2]
        elif attack == "zero":
            messages[2] = torch.zeros_like(messages[2])
        senders = [p for p in range(3) if weights[p] > 0 and not (attack == "absent" and p == 2)]
        if not senders:
            continue  # only the absent peer computed this epoch
        average = aggregate([messages[p] for p in senders], [weights[p] for p in senders], senders, min_alignment,
                            trusts)
        offset = 0
        for p in params:
            p.grad = average[offset:offset + p.numel()].reshape(p.shape).clone()
            offset += p.numel()
        optimizer.step()
    with torch.no_grad():  # the honest swarm's objective: the mean of the 3 peers' targets
        target = y_val + hetero * (x_val @ (sum(directions) / len(directions)))
        return float(torch.nn.functional.mse_loss(model.net(x_val), target))


def main() -> None:
    torch.set_num_threads(1)
    seeds = int(os.environ.get("BENCH_SEEDS", "8"))
    epoch_counts = [int(e) for e in os.environ.get("BENCH_EPOCHS", "4").split(",")]
    screens = [None if value == "off" else float(value)
               for value in os.environ.get("BENCH_MIN_ALIGNMENTS", "off,0.25,0.5,1").split(",")]
    attacks = os.environ.get("BENCH_ATTACKS", "neg,c=0.5,zero,x1000,absent").split(",")
    hetero = float(os.environ.get("BENCH_HETERO", "0"))
    optimizers = os.environ.get("BENCH_OPTIMIZERS", "sgd").split(",")
    data = (make_regression_data(max(PEER_OFFSETS) + seeds * 1000 + 30_000, 8, 0), make_regression_data(2000, 8, 99),
            [torch.randn(8, 1, generator=torch.Generator().manual_seed(7 + peer)) for peer in range(3)])
    print(f"simulated 3-peer swarm, CenteredClip per reducer slice, {seeds} data offsets, "
          f"{'even' if os.environ.get('BENCH_SPLITS') == 'even' else 'raced'} splits, non-identical data {hetero}")
    print(f"  {'optimizer':>9} {'epochs':>6} {'screen':>6} | {'honest loss':>11} {'vs off':>6} | "
          + " | ".join(f"{attack + ' mean, max':>18}" for attack in attacks))
    for optimizer_name in optimizers:
        for epochs in epoch_counts:
            plain = [train(optimizer_name, epochs, None, "none", seed * 1000, data, hetero) for seed in range(seeds)]
            for screen in screens:
                honest = plain if screen is None else [
                    train(optimizer_name, epochs, screen, "none", seed * 1000, data, hetero) for seed in range(seeds)]
                cells = []
                for attack in attacks:
                    ratios = [train(optimizer_name, epochs, screen, attack, seed * 1000, data, hetero) / reference
                              for seed, reference in zip(range(seeds), honest)]
                    cells.append(f"{statistics.mean(ratios):.3f}, {max(ratios):.3f}")
                cost = statistics.mean(h / p for h, p in zip(honest, plain))
                print(f"  {optimizer_name:>9} {epochs:>6} {screen or 'off':>6} | {statistics.mean(honest):>11.3f} "
                      f"{cost:>6.3f} | " + " | ".join(f"{cell:>18}" for cell in cells), flush=True)


if __name__ == "__main__":
    main()
