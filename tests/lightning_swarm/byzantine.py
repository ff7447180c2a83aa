"""A malicious swarm peer for the Byzantine tests and benchmark: a HivemindStrategy whose gradient averager or
reducer lies.

Named in a peer's YAML as ``trainer.strategy.class_path: byzantine.ByzantineStrategy`` with ``attack``:

- ``scale``: sends its gradients multiplied by 1e3 (with its true weight);
- ``nan``: sends NaN gradients;
- ``weight``: claims weight 1e9 (a billion samples) and sends its gradients negated (gradient ascent), so that an
  average it decided would undo training;
- ``ascent``: sends its gradients multiplied by -1e3 (loud gradient ascent, issue 24's finding 0), with its true
  weight;
- ``liar``: a lying reducer (issue 24, item 9): it sends honest gradients and states, but every result it reduces,
  in gradient and state rounds alike, is the honest one + 100 on every value, with the honest header
  (tests/lightning_swarm/lying_reducer.py's ``large`` lie, installed in its averagers' processes).

The gradient attackers bypass the local guard that keeps an honest peer from sending non-finite gradients (they
corrupt the gradients after the guard ran); everything else (their reducer part, their state) runs the honest code.

:func:`run_swarm` trains a 3-peer swarm of tests/lightning_swarm/peer_worker.py peers whose third peer attacks
(used by test_byzantine_swarm.py and tests/benchmarks/bench_robust_averaging.py).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from lightning_swarm.aggregation import DEFAULT_MIN_ALIGNMENT
from lightning_swarm.strategy import HivemindStrategy

GRADIENT_ATTACKS = ("scale", "nan", "weight", "ascent")
REDUCER_ATTACKS = ("liar",)
ATTACKS = GRADIENT_ATTACKS + REDUCER_ATTACKS


class ByzantineGradientAverager(HivemindStrategy.grad_averager_class):
    """A gradient averager that corrupts what it sends, see the module docstring (``attack``)."""

    def __init__(self, *args, attack: str, **kwargs):
        if attack not in GRADIENT_ATTACKS:
            raise ValueError(f"attack must be one of {GRADIENT_ATTACKS}, got {attack!r}")
        self.attack = attack
        super().__init__(*args, **kwargs)

    @torch.no_grad()
    def load_accumulators_into_averager_(self):
        super().load_accumulators_into_averager_()
        with self.get_tensors() as averaged_grads:
            for grad in averaged_grads:
                if self.attack == "scale":
                    grad.mul_(1e3)
                elif self.attack == "ascent":
                    grad.mul_(-1e3)
                elif self.attack == "nan":
                    grad.fill_(float("nan"))
                else:
                    grad.neg_()

    def step(self, weight=None, **kwargs):
        if self.attack == "weight":
            weight = 1e9
        return super().step(weight=weight, **kwargs)


class ByzantineStrategy(HivemindStrategy):
    """HivemindStrategy of a malicious peer.

    Args:
        attack: one of ``ATTACKS`` (see the module docstring).
        **kwargs: as HivemindStrategy.
    """

    def __init__(self, attack: str, **kwargs):
        if attack not in ATTACKS:
            raise ValueError(f"attack must be one of {ATTACKS}, got {attack!r}")
        super().__init__(**kwargs)
        self.attack = attack
        if attack == "liar":
            from lying_reducer import install_lie

            # before the strategy builds its averagers: their processes (forked) inherit the lying reducer
            install_lie("large")

    @property
    def grad_averager_class(self):
        attack = self.attack
        if attack in REDUCER_ATTACKS:
            return HivemindStrategy.grad_averager_class
        return lambda *args, **kwargs: ByzantineGradientAverager(*args, attack=attack, **kwargs)


# Least squares (a linear model) on data with noise 0.5, so that the clean swarm reaches the noise floor (validation
# loss ~0.24, from 1.62 at initialisation) within STOP_AT_EPOCH global steps, and what is left is what an attacker
# costs. The LR is 0.5 / (1 + epoch): the first step is about Newton's (the loss's Hessian is ~2 I), and each later
# one averages that epoch's fit in, so a step lost to the race (a lone sender's refused part, a round that fell back
# to local gradients) or taken on a few samples moves the final loss by little. (The earlier MLP, 4 epochs at lr 0.05,
# stopped far from convergence: its loss followed how much of each step the race left, 0.87 to 1.05 between clean
# runs, and no 10% bound could hold over one clean run. At a constant lr 0.4 the last epoch's noise stayed whole: one
# NaN-attacked run ended x1.28 after a last step on a few samples.)
STOP_AT_EPOCH = 6
SWARM_MODEL = {"hidden": 0, "lr": 0.5, "lr_harmonic": True, "step_delay": 0.01}
SWARM_DATA_NOISE = 0.5  # the noise floor: validation loss ~0.24 (that of the true weights: noise_floor())
SWARM_TARGET_BATCH_SIZE = 384


def swarm_strategy_args(run_id: str, aggregation: str, worker_momentum: float = 0.0,
                        min_alignment: Optional[float] = DEFAULT_MIN_ALIGNMENT, **overrides) -> dict:
    args = dict(run_id=run_id, target_batch_size=SWARM_TARGET_BATCH_SIZE, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                worker_momentum=worker_momentum, centered_clip_min_alignment=min_alignment,
                matchmaking_time=1.5, averaging_timeout=15.0, load_state_timeout=20.0, metrics_interval=1.0,
                aggregation=aggregation,
                tracker_opts={"max_refresh_period": 1.0, "min_refresh_period": 0.2, "default_refresh_period": 0.5})
    args.update(overrides)
    return args


def run_swarm(root: Path, attack: Optional[str], aggregation: str = "centered_clip", timeout: float = 200.0,
              worker_momentum: float = 0.0, min_alignment: Optional[float] = DEFAULT_MIN_ALIGNMENT,
              log_dir: Optional[Path] = None, **strategy_overrides,
              ) -> Tuple[List[Dict[str, torch.Tensor]], List[str]]:
    """Train 3 peers to STOP_AT_EPOCH, the third attacking with ``attack`` (None: honest); return the two honest
    peers' parameters at that epoch and their logs. Every peer (the attacker too: it then negates, scales or
    replaces its momentum) uses ``worker_momentum`` and CenteredClip's ``min_alignment`` (None: no alignment
    screen). ``log_dir``: copy every peer's log there (the attacker's too) on return; ``strategy_overrides``: more
    HivemindStrategy options for every peer (e.g. ``verbose=True``: hivemind logs each round). Every peer is killed on
    return."""
    from swarm_harness import Peer

    recorder = {"stop_at_epoch": STOP_AT_EPOCH, "max_seconds": 150, "barrier_dir": str(root / "barrier"),
                "barrier_count": 3}
    run_id = f"byz_{attack or 'none'}_{aggregation}_m{worker_momentum * 100:.0f}"  # no '.': hivemind refuses it
    started = []
    try:
        strategy = swarm_strategy_args(run_id, aggregation, worker_momentum, min_alignment, **strategy_overrides)
        first = Peer(root, "first", strategy, model=SWARM_MODEL, data={"batch_size": 16, "noise": SWARM_DATA_NOISE},
                     recorder=recorder)
        started.append(first)
        # the other two start with the first (join_later): their imports overlap its start instead of following it
        second = Peer(root, "second", strategy, model=SWARM_MODEL,
                      data={"batch_size": 16, "offset": 30_000, "noise": SWARM_DATA_NOISE}, recorder=recorder,
                      join_later=True)
        started.append(second)
        trainer = None
        if attack is not None:
            trainer = {"strategy": {"class_path": "byzantine.ByzantineStrategy",
                                    "init_args": dict(strategy, attack=attack)}}
        started.append(Peer(root, "third", strategy, model=SWARM_MODEL,
                            data={"batch_size": 16, "offset": 60_000, "noise": SWARM_DATA_NOISE},
                            recorder=recorder, trainer=trainer, join_later=True))
        join = first.join_peers(timeout=timeout)  # its start shares the cores with the other two's imports
        for peer in started[1:]:
            peer.join(join)
        # the honest peers' parameters at STOP_AT_EPOCH are saved before the event that records the epoch; their
        # exit (hivemind's shutdown) is not waited for
        deadline = time.monotonic() + timeout
        while not all(peer.max_epoch() >= STOP_AT_EPOCH for peer in (first, second)):
            for peer in (first, second):
                peer.check_alive()
                if peer.process.poll() == 0:  # stopped at max_seconds, before STOP_AT_EPOCH
                    assert peer.max_epoch() >= STOP_AT_EPOCH, peer.log()[-3000:]
            if time.monotonic() > deadline:
                raise TimeoutError(f"the honest peers did not reach epoch {STOP_AT_EPOCH} within {timeout} s:\n" +
                                   "\n".join(f"--- {p.name}\n{p.log()[-2000:]}" for p in (first, second)))
            time.sleep(0.2)
        return [peer.params(STOP_AT_EPOCH) for peer in (first, second)], [peer.log() for peer in (first, second)]
    finally:
        for peer in started:
            peer.kill()
            if log_dir is not None:
                Path(log_dir).mkdir(parents=True, exist_ok=True)
                (Path(log_dir) / f"{peer.name}.log").write_text(peer.log())


def attacker_peer_id(root: Path) -> str:
    """The peer id of the third peer of :func:`run_swarm` (``root``: its ``root``), from the join address it
    printed."""
    from swarm_harness import JOIN_OPTION

    log = (Path(root) / "third" / "log.txt").read_text(errors="replace")
    match = JOIN_OPTION.search(log)
    assert match, f"the third peer printed no join address:\n{log[-3000:]}"
    return re.search(r"/p2p/(\w+)", match.group(1)).group(1)


def validation_loss(params: Optional[Dict[str, torch.Tensor]] = None) -> float:
    """MSE of the swarm's model (SWARM_MODEL) with ``params`` (None: its initialisation) on 2000 held-out samples."""
    from peer_worker import TinyRegression, make_regression_data

    model = TinyRegression(hidden=SWARM_MODEL["hidden"])
    if params is not None:
        model.load_state_dict(params)
    x, y = make_regression_data(2000, 8, seed=99, noise=SWARM_DATA_NOISE)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model.net(x), y))


def noise_floor() -> float:
    """The validation loss of the data's true weights and zero bias: the best any training reaches, up to ~d/n."""
    from peer_worker import make_regression_data

    x, y = make_regression_data(2000, 8, seed=99, noise=SWARM_DATA_NOISE)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(1234))  # make_regression_data's weights
    return float(torch.nn.functional.mse_loss(x @ w, y))
