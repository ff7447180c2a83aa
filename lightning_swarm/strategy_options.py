"""HivemindStrategy's options: the checks that make a bad config fail at once with a clear message, and the
hivemind.Optimizer arguments they become."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional

from lightning_swarm.compression import COMPRESSION_CHOICES
from lightning_swarm.hivemind_ext.group_keys import moshpit_group_bits
from lightning_swarm.hivemind_ext.catch_up import DEFAULT_MAX_STALE_EPOCHS, check_max_stale_epochs
from lightning_swarm.hivemind_ext.optimizer import DEFAULT_OVERLAP_MAX_PEERS, check_overlap_max_peers


def check_strategy_options(
    *,
    run_id: Any,
    target_batch_size: Any,
    matchmaking_time: float,
    averaging_timeout: float,
    allreduce_timeout: Optional[float],
    load_state_timeout: float,
    next_chunk_timeout: Optional[float],
    metrics_interval: float,
    delay_optimizer_step: Optional[bool],
    delay_grad_averaging: bool,
    offload_optimizer: Optional[bool],
    reuse_grad_buffers: bool,
    client_mode: bool,
    announce_maddrs: Optional[List[str]],
    use_relay: bool,
    use_auto_relay: bool,
    average_state_every: Any,
    averager_opts: Optional[Dict[str, Any]],
    tracker_opts: Optional[Dict[str, Any]],
    compression: Any,
    load_state_compression: Any,
) -> None:
    """Raise ValueError naming the first bad option (the arguments are HivemindStrategy's, same meaning)."""
    # no '.': hivemind builds its averagers' DHT prefixes from the run id and refuses a '.' in them
    if not isinstance(run_id, str) or not re.fullmatch(r"[A-Za-z0-9_\-]+", run_id):
        raise ValueError(f"run_id must be a non-empty name of letters, digits, '_' and '-', got {run_id!r}")
    if isinstance(target_batch_size, bool) or not isinstance(target_batch_size, int) or target_batch_size <= 0:
        raise ValueError(f"target_batch_size must be a positive integer, got {target_batch_size!r}")
    for name, value in dict(matchmaking_time=matchmaking_time, averaging_timeout=averaging_timeout,
                            load_state_timeout=load_state_timeout, metrics_interval=metrics_interval).items():
        if value is None or value <= 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    if next_chunk_timeout is not None and next_chunk_timeout <= 0:
        raise ValueError(f"next_chunk_timeout must be a positive number of seconds, got {next_chunk_timeout!r}")
    if allreduce_timeout is not None and allreduce_timeout <= 0:
        raise ValueError(f"allreduce_timeout must be a positive number of seconds, got {allreduce_timeout!r}")
    if averaging_timeout <= matchmaking_time:
        raise ValueError(
            f"averaging_timeout ({averaging_timeout}) must be larger than matchmaking_time ({matchmaking_time}): "
            "an averaging round needs time to find a group and then to exchange tensors"
        )
    if delay_grad_averaging and delay_optimizer_step is False:
        raise ValueError("delay_grad_averaging=True requires delay_optimizer_step=True (or leave it unset)")
    if (delay_optimizer_step or delay_grad_averaging) and offload_optimizer is False:
        raise ValueError("delay_optimizer_step/delay_grad_averaging need offload_optimizer=True (or leave it unset)")
    if reuse_grad_buffers and delay_grad_averaging:
        raise ValueError(
            "reuse_grad_buffers=True can't be combined with delay_grad_averaging=True: the next backward pass "
            "would write into the gradient buffers while they are being averaged"
        )
    if client_mode and announce_maddrs:
        raise ValueError("client_mode=True peers accept no incoming connections, so announce_maddrs makes no sense")
    if use_auto_relay and not use_relay:
        raise ValueError("use_auto_relay=True requires use_relay=True")
    if isinstance(average_state_every, bool) or not isinstance(average_state_every, int) or average_state_every < 1:
        raise ValueError(f"average_state_every must be an integer >= 1, got {average_state_every!r}")
    for name, value in [("averager_opts.leader_poll_interval", (averager_opts or {}).get("leader_poll_interval")),
                        ("tracker_opts.min_report_interval", (tracker_opts or {}).get("min_report_interval"))]:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    for name, value in dict(compression=compression, load_state_compression=load_state_compression).items():
        if isinstance(value, str) and value not in COMPRESSION_CHOICES:
            raise ValueError(f"{name} must be one of {COMPRESSION_CHOICES}, got {value!r}")


def hivemind_optimizer_options(
    *,
    matchmaking_time: float,
    averaging_timeout: float,
    allreduce_timeout: Optional[float],
    load_state_timeout: float,
    next_chunk_timeout: Optional[float],
    delay_optimizer_step: Optional[bool],
    delay_grad_averaging: bool,
    delay_state_averaging: bool,
    offload_optimizer: Optional[bool],
    reuse_grad_buffers: bool,
    average_state_every: int,
    averager_opts: Optional[Dict[str, Any]],
    tracker_opts: Optional[Dict[str, Any]],
    verbose: bool,
    overlap_max_peers: Optional[int] = DEFAULT_OVERLAP_MAX_PEERS,
    max_stale_epochs: int = DEFAULT_MAX_STALE_EPOCHS,
) -> Dict[str, Any]:
    """The SwarmOptimizer arguments of HivemindStrategy's options (same names and meaning), defaults filled in."""
    check_overlap_max_peers(overlap_max_peers)
    check_max_stale_epochs(max_stale_epochs)
    # hivemind warns (and may deadlock) if request_timeout >= matchmaking_time
    averager_opts = dict(dict(request_timeout=min(3.0, matchmaking_time / 2)), **(averager_opts or {}))
    # ours, not hivemind's: about how many peers average together, for the groups to change every round
    expected_peers = averager_opts.pop("expected_peers", None)
    group_bits = moshpit_group_bits(expected_peers, averager_opts.get("target_group_size"))
    if group_bits and "initial_group_bits" not in averager_opts:
        averager_opts["initial_group_bits"] = group_bits
    return dict(
        matchmaking_time=matchmaking_time,
        averaging_timeout=averaging_timeout,
        allreduce_timeout=allreduce_timeout,
        load_state_timeout=load_state_timeout,
        next_chunk_timeout=next_chunk_timeout if next_chunk_timeout is not None else max(
            matchmaking_time, min(10.0, averaging_timeout / 3)),
        delay_optimizer_step=delay_optimizer_step,
        delay_grad_averaging=delay_grad_averaging,
        delay_state_averaging=delay_state_averaging,
        offload_optimizer=offload_optimizer,
        reuse_grad_buffers=reuse_grad_buffers,
        average_state_every=average_state_every,
        averager_opts=averager_opts,
        tracker_opts=tracker_opts,
        verbose=verbose,
        overlap_max_peers=overlap_max_peers,
        max_stale_epochs=max_stale_epochs,
    )


def check_trainer_for_swarm(accumulate_grad_batches: int, fp16_loss_scaling: bool, reuse_grad_buffers: bool,
                            num_optimizers: int) -> None:
    """Raise ValueError if the Trainer's setup can't train under HivemindStrategy.

    Args:
        accumulate_grad_batches: the Trainer's (the strategy accumulates up to target_batch_size itself).
        fp16_loss_scaling: whether the precision plugin scales the loss (``precision='16-mixed'``).
        reuse_grad_buffers: the strategy's option.
        num_optimizers: how many optimizers ``configure_optimizers`` gave.
    """
    if accumulate_grad_batches != 1:
        raise ValueError(
            "HivemindStrategy accumulates gradients up to target_batch_size itself: "
            f"remove accumulate_grad_batches={accumulate_grad_batches} from the Trainer"
        )
    if fp16_loss_scaling and reuse_grad_buffers:
        raise ValueError(
            "fp16 loss scaling (precision='16-mixed') can't be combined with reuse_grad_buffers=True: the "
            "gradients would have to stay scaled over the whole accumulation (hivemind's own GradScaler, which "
            "Lightning's step does not drive). Use reuse_grad_buffers=False, or precision='bf16-mixed'/'32-true'"
        )
    if num_optimizers != 1:
        raise ValueError(f"HivemindStrategy needs exactly one optimizer, configure_optimizers gave {num_optimizers}")
