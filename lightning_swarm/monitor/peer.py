"""The monitor's presence in the swarm: a DHT node with a fixed identity and a hivemind.Optimizer that never
steps, used only to download the swarm's state (for checkpoints) and to serve a reverted state.

It computes no gradients. It wraps the module's own optimizer (and LR scheduler) with the trainers' own
strategy code under the same ``run_id``, so the state trainers send has the same layout here.

Revert (moderators, after an attack or a divergence): :meth:`MonitorPeer.revert_to` loads a checkpoint and
serves it as the newest state of the run: its epoch is set past the swarm's (so every trainer sees itself
behind and reloads, and every joiner loads it), and it is offered with the highest state-sharing priority,
which hivemind peers use to choose whom to download from. Trainers that reload continue from it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional

import torch
from hivemind.compression import NoCompression
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.utils import get_dht_time

from lightning_swarm.auth.revert import RevertOrder, publish_revert_order
from lightning_swarm.checkpoint.checkpoint_io import read_checkpoint
from lightning_swarm.hivemind_ext.auth_guards import credible_newest_epoch
from lightning_swarm.hivemind_ext.progress_records import check_progress_record
from lightning_swarm.hivemind_ext.state import progress_key, set_local_epoch
from lightning_swarm.metrics import LocalMetrics
from lightning_swarm.monitor.records import MetricsDecoder, fetch_metric_records
from lightning_swarm.strategy import HivemindStrategy
from lightning_swarm.torch_ext import configure_single_optimizer

logger = logging.getLogger(__name__)

# how long a revert's progress record lives in the DHT unless refreshed
REVERT_RECORD_EXPIRATION = 30.0


# the monitor never steps: no gradient averager, no background optimizer step, the state is loaded into the
# module's own parameters, and a reverted state is served exactly
MONITOR_OPTIMIZER_OVERRIDES = dict(
    use_local_updates=True,
    offload_optimizer=False,
    delay_optimizer_step=False,
    delay_grad_averaging=False,
    reuse_grad_buffers=False,
    load_state_compression=NoCompression(),
)


class MonitorPeer:
    """Joins the run's DHT and holds a never-stepping swarm optimizer for state download/serving.

    Both come from the trainers' own :class:`~lightning_swarm.strategy.HivemindStrategy` (built from their
    config, see :func:`lightning_swarm.monitor.config.build_strategy`): the DHT of ``strategy.start_dht()`` and
    the optimizer of ``strategy.make_swarm_optimizer()``, so every strategy option (compression, averager and
    tracker options, timeouts) means for the monitor what it means for a trainer.

    Args:
        module: the model, built from the trainers' config (its parameters receive the downloaded state).
        strategy: the trainers' strategy with the monitor's own addresses/identity (``client_mode=False``; every
            peer's DHT validates the trainers' signed metrics records).
    """

    def __init__(self, module: torch.nn.Module, strategy: HivemindStrategy):
        self.module, self.strategy = module, strategy
        self.run_id, self.target_batch_size = strategy.run_id, strategy.target_batch_size
        self.dht = strategy.start_dht()
        self.auth = strategy.swarm_auth  # None in an open run; a moderator's (auth.issuer) can revert
        optimizer, scheduler = configure_single_optimizer(module)
        self.optimizer = strategy.make_swarm_optimizer(optimizer, scheduler, **MONITOR_OPTIMIZER_OVERRIDES)
        # the monitor's state lags behind the trainers': only offer it when reverting
        self.optimizer.state_averager.allow_state_sharing = False
        self.metrics_decoder = MetricsDecoder()
        self.reverted_epoch: Optional[int] = None
        self.revert_order: Optional[RevertOrder] = None

    # ------------------------------------------------------------------ addresses and metrics

    @property
    def addresses(self) -> List[str]:
        """Full multiaddrs (with ``/p2p/<peer id>``) that trainers pass as ``initial_peers``."""
        return [str(maddr) for maddr in self.dht.get_visible_maddrs()]

    def fetch_metrics(self) -> Dict[bytes, LocalMetrics]:
        """The latest unexpired metrics record of every trainer, by public key; malformed or implausible records
        are ignored for their peer and logged once (:mod:`lightning_swarm.monitor.records`)."""
        return fetch_metric_records(self.dht, self.run_id, self.metrics_decoder)

    @property
    def epoch(self) -> int:
        """The epoch of the state this monitor holds."""
        return int(self.optimizer.local_epoch)

    @property
    def swarm_epoch(self) -> int:
        """The run's global epoch as the progress tracker last saw it."""
        return int(self.optimizer.tracker.global_epoch)

    def lr_schedule(self, epoch: int) -> Optional[Dict[str, Any]]:
        """The LR schedule at the swarm's global ``epoch``: ``lr`` (first param group), ``peak_lr`` and ``length``
        (global epochs of warm-up + decay from the module's ``total_steps`` or ``warmup_steps`` + ``decay_steps``
        hyper-parameters, None if it has neither). None without a LambdaLR-style scheduler (``lr_lambdas``)."""
        scheduler = self.optimizer.state_averager.scheduler
        if scheduler is None or not getattr(scheduler, "lr_lambdas", None):
            return None
        peak = float(scheduler.base_lrs[0])
        hparams = dict(getattr(self.module, "hparams", None) or {})
        length = hparams.get("total_steps")
        if length is None and hparams.get("decay_steps") is not None:
            length = int(hparams.get("warmup_steps") or 0) + int(hparams["decay_steps"])
        return dict(lr=peak * float(scheduler.lr_lambdas[0](epoch)), peak_lr=peak, length=length)

    # ------------------------------------------------------------------ state

    def load_state_from_peers(self) -> bool:
        """Download the newest state from the trainers; True if an epoch newer than ours arrived.

        Calls the state averager directly (not ``hivemind.Optimizer.load_state_from_peers``, which retries
        forever): a failed or timed-out download is reported and tried again at the next refresh.
        """
        before = self.epoch
        averager = self.optimizer.state_averager
        try:
            averager.load_state_from_peers(timeout=self.optimizer.load_state_timeout)
        except Exception as e:
            logger.warning(f"Could not download the state from the peers: {e!r}")
            return False
        if self.epoch > before and averager.allow_state_sharing:
            averager.state_sharing_priority = self.epoch  # after a revert: offer the newer state as itself
        return self.epoch > before

    def optimizer_states(self) -> List[dict]:
        return [self.optimizer.state_dict()]

    def scheduler_states(self) -> List[dict]:
        scheduler = self.optimizer.state_averager.scheduler
        return [scheduler.state_dict()] if scheduler is not None else []

    def newest_swarm_epoch(self, discovery_seconds: float = 0.0) -> int:
        """The highest epoch the trainers report; waits up to ``discovery_seconds`` for a first metrics record
        (a freshly restarted monitor only hears from the trainers once they reach it again)."""
        deadline = time.monotonic() + discovery_seconds
        records = self.fetch_metrics()
        while not records and time.monotonic() < deadline:
            time.sleep(0.5)
            records = self.fetch_metrics()
        if self.auth is None:
            return max([self.swarm_epoch] + [r.step for r in records.values()])
        # with an authority, a peer's claim counts only if another peer confirms it (see credible_newest_epoch)
        claims = {key: record.step for key, record in records.items()}
        progress = self.dht.get(progress_key(self.run_id), latest=True)
        for key, entry in (progress.value.items() if progress is not None and isinstance(progress.value, dict) else ()):
            try:
                epoch = check_progress_record(entry.value, get_dht_time()).epoch
            except Exception:  # malformed: not a claim
                continue
            if key != RSASignatureValidator().local_public_key:
                claims[key] = max(claims.get(key, 0), epoch)
        newest = credible_newest_epoch(claims)
        return self.epoch if newest is None else max(self.epoch, newest)

    def revert_to(self, url: str, discovery_seconds: float = 0.0, epoch_margin: int = 5,
                  order_lifetime: float = 300.0) -> int:
        """Make the checkpoint at ``url`` the state every trainer and every joiner loads; returns its new epoch.

        Running hivemind peers reload the state only when they find themselves more than one epoch behind the
        swarm, so the reverted state is announced ``epoch_margin`` epochs past the newest epoch known here;
        the margin must exceed 1 + the epochs the swarm advances before the trainers notice (about one progress
        refresh, plus the age of the metrics records). The LR schedule moves on with the epoch.
        ``discovery_seconds``: how long to wait for the running trainers' metrics (0 if the swarm was stopped).
        In a run with an authority the revert is also a signed order (valid ``order_lifetime`` seconds) that
        trainers check before they follow it (:mod:`lightning_swarm.auth.revert`).
        """
        if epoch_margin < 2:
            raise ValueError(f"epoch_margin must be >= 2 (peers reload only when 2+ epochs behind), got {epoch_margin}")
        if self.auth is not None and self.auth.issuer is None:
            raise ValueError("in a run with an authority only moderators revert: start the monitor with the "
                             "authority's private key (--authority-key)")
        newest = self.newest_swarm_epoch(discovery_seconds)
        checkpoint = read_checkpoint(url)
        checkpoint.load_into(self.module)
        if checkpoint.optimizer_states:
            state = dict(checkpoint.optimizer_states[0])
            state["state"] = {k: v for k, v in state["state"].items() if k != "local_epoch"}
            self.optimizer.load_state_dict(state)
        epoch = max(int(checkpoint.meta.get("global_epoch") or 0), newest + epoch_margin)
        averager = self.optimizer.state_averager
        set_local_epoch(averager, epoch)  # the schedule follows the epoch, as on every peer
        averager.allow_state_sharing = True
        averager.state_sharing_priority = epoch + 0.5  # above every trainer still at an older epoch
        self.reverted_epoch = epoch
        if self.auth is not None:
            self.revert_order = RevertOrder.create(self.auth.issuer, self.run_id, epoch, self.dht.peer_id.to_base58(),
                                                   checkpoint.url, order_lifetime)
        self.announce_revert()
        logger.warning(f"Reverted run {self.run_id!r} to {checkpoint.url}: serving it as epoch {epoch}")
        return epoch

    def announce_revert(self) -> None:
        """(Re)publish a progress record at the reverted epoch so trainers see they are behind and reload.

        Signed with this process's key under the run's progress key, like hivemind's ProgressTracker does.
        """
        if self.reverted_epoch is None:
            return
        if self.revert_order is not None:
            publish_revert_order(self.dht, self.revert_order)
        record = LocalTrainingProgress(
            peer_id=self.dht.peer_id.to_bytes(),
            epoch=self.reverted_epoch,
            samples_accumulated=0,
            samples_per_second=0.0,
            time=get_dht_time(),
            client_mode=False,
        )
        self.dht.store(
            key=progress_key(self.run_id),
            subkey=RSASignatureValidator().local_public_key,
            value=record.dict(),
            expiration_time=get_dht_time() + REVERT_RECORD_EXPIRATION,
        )

    def end_revert(self) -> None:
        """Stop announcing the reverted epoch (the trainers have moved on from it)."""
        self.reverted_epoch = None
        self.revert_order = None

    def shutdown(self) -> None:
        self.optimizer.shutdown()
        self.dht.shutdown()
