"""Moving a peer's training state to another epoch by hand (the monitor's revert)."""

from __future__ import annotations

from hivemind.optim.state_averager import TrainingStateAverager


def progress_key(run_id: str) -> str:
    """DHT key under which hivemind's ProgressTracker of run ``run_id`` stores every peer's progress record."""
    return f"{run_id}_progress"  # hivemind 1.1.12: ProgressTracker.training_progress_key = f"{prefix}_progress"


def set_local_epoch(averager: TrainingStateAverager, epoch: int) -> None:
    """Set the averager's epoch and step its LR scheduler up to it, as hivemind does after a state download.

    Args:
        averager: the state averager of a hivemind.Optimizer (``optimizer.state_averager``).
        epoch: the new epoch of its state.
    """
    averager.local_epoch = epoch
    averager._update_scheduler()
