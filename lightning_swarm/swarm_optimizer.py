"""The swarm optimizer HivemindStrategy trains with: the module's optimizer and LR scheduler re-created on
hivemind's side, with the strategy's options.

The monitor peer builds its optimizer the same way (through ``HivemindStrategy.make_swarm_optimizer``), so every
option of a recipe's strategy config means the same for both.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable, Dict, Optional, Union

import hivemind
import torch
from hivemind.compression import CompressionBase
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Timer

from lightning_swarm import compression as swarm_compression
from lightning_swarm.hivemind_ext.credentials import PeerCredentials
from lightning_swarm.hivemind_ext.optimizer import SwarmOptimizer
from lightning_swarm.hivemind_ext.state import progress_key
from lightning_swarm.link_budget import fit_averaging_timeout
from lightning_swarm.scheduler import rebind_scheduler

log = logging.getLogger(__name__)


def optimizer_factory(optimizer: torch.optim.Optimizer) -> Callable[[Any], torch.optim.Optimizer]:
    """Re-create the user's optimizer (same class and hyper-parameters) on the param groups hivemind gives it."""
    optimizer_class = type(optimizer)
    accepted = inspect.signature(optimizer_class.__init__).parameters
    takes_any_kwarg = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    defaults = {k: v for k, v in optimizer.defaults.items() if takes_any_kwarg or k in accepted}
    return lambda param_groups: optimizer_class(param_groups, **defaults)


def scheduler_factory(scheduler: Optional[Any], optimizer: torch.optim.Optimizer) -> Optional[Callable[[Any], Any]]:
    """Re-create ``scheduler`` (built on ``optimizer``; None: no schedule) on hivemind's optimizer. Raises
    ValueError at once for a scheduler that can't be re-created (e.g. ReduceLROnPlateau)."""
    if scheduler is None:
        return None
    if scheduler.optimizer is not optimizer:
        raise ValueError("The LR scheduler must be built on the optimizer returned by configure_optimizers")
    rebind_scheduler(scheduler, optimizer)  # fail early (e.g. ReduceLROnPlateau) with a clear message
    return lambda new_optimizer: rebind_scheduler(scheduler, new_optimizer)


def build_swarm_optimizer(
    *,
    dht: hivemind.DHT,
    run_id: str,
    target_batch_size: int,
    optimizer: torch.optim.Optimizer,
    make_scheduler: Optional[Callable[[Any], Any]],
    swarm_auth: Optional[PeerCredentials],
    compression: Union[str, CompressionBase],
    load_state_compression: Union[str, CompressionBase],
    grad_averager_class: type,
    robust_averaging_opts: Dict[str, Any],
    hivemind_kwargs: Dict[str, Any],
    link_mbit: Optional[float],
    overrides: Dict[str, Any],
    worker_momentum: float = 0.0,
) -> SwarmOptimizer:
    """A SwarmOptimizer around ``optimizer`` and its LR schedule.

    Args:
        dht: this peer's running DHT.
        run_id, target_batch_size, compression, load_state_compression: as HivemindStrategy's options.
        optimizer: the module's optimizer; re-created (same class and hyper-parameters) on its param groups.
        make_scheduler: the LR scheduler re-created on the swarm's optimizer (:func:`scheduler_factory`), or None.
        swarm_auth: this peer's credentials in a run with an authority, or None.
        grad_averager_class: the gradient averager to build (HivemindStrategy.grad_averager_class).
        robust_averaging_opts: ``aggregation``, ``centered_clip_tau``, ``centered_clip_iters`` of both averagers,
            ``centered_clip_min_alignment`` of the gradient averager.
        hivemind_kwargs: hivemind.Optimizer arguments from the strategy's options (``hivemind_optimizer_options``).
        link_mbit: the strategy's option: the averaging timeouts are fitted to it (:mod:`lightning_swarm.link_budget`).
        overrides: hivemind.Optimizer arguments that replace those (the monitor sets ``use_local_updates=True``...).
        worker_momentum: the strategy's option, for the gradient averager (SampleWeightedGradientAverager).
    """
    swarm_compression.register_fixed_codecs()  # before the averagers start: peers may send any 8-bit codec
    codec = swarm_compression.resolve_compression(compression)
    kwargs = dict(
        hivemind_kwargs,
        swarm_auth=swarm_auth,
        use_local_updates=False,
        # explicitly the DHT's: hivemind 1.1.12 turns client_mode=None into None (its condition is inverted), and a
        # client-mode peer then sets a state sharing priority at its first global step, which its averagers refuse
        client_mode=dht.client_mode,
        grad_compression=codec,
        state_averaging_compression=codec,
        load_state_compression=swarm_compression.resolve_compression(load_state_compression),
    )
    kwargs.update(overrides)
    kwargs["averaging_timeout"], kwargs["allreduce_timeout"], message, warn = fit_averaging_timeout(
        [param for group in optimizer.param_groups for param in group["params"]], codec,
        kwargs["averaging_timeout"], kwargs["allreduce_timeout"], kwargs["matchmaking_time"], link_mbit,
        kwargs["averager_opts"].get("target_group_size"))
    (log.warning if warn else log.info)(message)
    # hivemind passes averager_opts to the state averager only; the gradient averager needs them too
    # (with local updates there is no gradient averager, and hivemind refuses a factory for it)
    grad_averager_factory = None if kwargs["use_local_updates"] else functools.partial(
        grad_averager_class, progress_key=progress_key(run_id), worker_momentum=worker_momentum,
        **robust_averaging_opts, **kwargs["averager_opts"])
    return SwarmOptimizer(
        dht=dht,
        run_id=run_id,
        target_batch_size=target_batch_size,
        optimizer=optimizer_factory(optimizer),
        params=optimizer.param_groups,
        scheduler=make_scheduler,
        grad_averager_factory=grad_averager_factory,
        robust_averaging_opts=robust_averaging_opts,
        **kwargs,
    )


def join_swarm(optimizer: SwarmOptimizer, joining: bool) -> None:
    """Start training where the swarm is: a late joiner (or a peer resumed from an old checkpoint) downloads the
    current state; otherwise announce this peer's (possibly restored) epoch.

    Args:
        optimizer: this peer's swarm optimizer.
        joining: this peer joins a running swarm (it was given initial peers); at epoch 0 it then also takes the
            swarm's initial parameters, so all peers start from the same point.
    """
    behind = optimizer.tracker.global_epoch > optimizer.local_epoch
    fresh_joiner = joining and optimizer.local_epoch == 0
    if behind or fresh_joiner:
        log.warning(
            f"[lightning_swarm] swarm is at global epoch {optimizer.tracker.global_epoch}, this peer at "
            f"{optimizer.local_epoch}: loading state from peers"
        )
        optimizer.load_state_from_peers()
    else:
        with optimizer.tracker.pause_updates():
            optimizer.tracker.update_epoch(optimizer.local_epoch)


def trainer_stop_reason(trainer: Optional[Trainer]) -> Optional[str]:
    """Why ``trainer`` should stop now (it got SIGTERM, its ``max_time`` passed, something set ``should_stop``), or None.

    A SwarmOptimizer waiting for a state download asks this (``SwarmOptimizer.stop_waiting``): hivemind would retry a
    failing download forever, past both.
    """
    if trainer is None:
        return None
    if trainer.received_sigterm:
        return "the trainer received SIGTERM"
    if trainer.should_stop:
        return "the trainer was told to stop"
    for callback in trainer.callbacks:
        if isinstance(callback, Timer):
            remaining = callback.time_remaining()
            if remaining is not None and remaining <= 0:
                return "the Trainer's max_time has passed"
    return None
