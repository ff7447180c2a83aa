"""HivemindStrategy: train any LightningModule as one peer of a collaborative run over the Internet.

Every peer runs its own Trainer. The module's optimizer is wrapped in a ``hivemind.Optimizer``: each local step
adds this peer's gradients (weighted by its real batch size) to a running sum; once the whole swarm has
accumulated ``target_batch_size`` samples, peers average their gradients, take one optimizer step together
(a "global epoch") and average parameters and optimizer state. LR schedules advance once per global epoch.

Usage::

    trainer = Trainer(strategy=HivemindStrategy(run_id="my_run", target_batch_size=4096))   # first peer
    # it prints the option other peers add to join, e.g. initial_peers=["/ip4/1.2.3.4/tcp/31337/p2p/Qm..."]

The same through LightningCLI YAML::

    trainer:
      strategy:
        class_path: lightning_swarm.HivemindStrategy
        init_args: {run_id: my_run, target_batch_size: 4096}
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Union

import hivemind
import torch
from hivemind.compression import CompressionBase
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size

from lightning_swarm import metrics as swarm_metrics
from lightning_swarm.aggregation import DEFAULT_CENTERED_CLIP_ITERS, check_aggregation_options
from lightning_swarm.auth.peer import SwarmAuth, resolve_auth_settings
from lightning_swarm.callbacks.progress import SwarmProgress
from lightning_swarm.dht import start_peer_dht
from lightning_swarm.hivemind_ext.catch_up import DEFAULT_MAX_STALE_EPOCHS
from lightning_swarm.hivemind_ext.optimizer import DEFAULT_OVERLAP_MAX_PEERS, SwarmGradientAverager, SwarmOptimizer
from lightning_swarm.peers import check_listen_maddrs, resolve_initial_peers
from lightning_swarm.scheduler import GlobalEpochScheduler
from lightning_swarm.strategy_options import check_strategy_options, check_trainer_for_swarm, hivemind_optimizer_options
from lightning_swarm.swarm_optimizer import build_swarm_optimizer, join_swarm, scheduler_factory, trainer_stop_reason
from lightning_swarm.worker_momentum import check_worker_momentum

log = logging.getLogger(__name__)


class HivemindStrategy(SingleDeviceStrategy):
    """A Lightning strategy that makes this process one peer of a hivemind training swarm.

    Args:
        run_id: name of the training run; all peers of a run use the same one (prefix of all DHT keys).
        target_batch_size: samples the whole swarm accumulates before one global optimizer step (a global epoch).
        initial_peers: multiaddrs of running peers to join, each ending in ``/p2p/<peer id>``. A list, a JSON
            list string, or a comma/space separated string. If not given, read from the environment variable
            ``LIGHTNING_SWARM_INITIAL_PEERS``; if that is empty too, this peer starts a new swarm.
        host_maddrs: addresses to listen on (default: all IPv4 interfaces, random TCP port,
            ``["/ip4/0.0.0.0/tcp/0"]``); use ``/ip4/0.0.0.0/tcp/31337`` for a fixed port.
        announce_maddrs: public addresses to tell other peers about (e.g. behind port forwarding).
        identity_path: file with this peer's private key, so its peer id (and thus the join address) stays the
            same across restarts; created if missing. Useful for a bootstrap peer. None: a fresh identity each run
            (its key, RSA as hivemind makes them, signs the verification messages relayed between client-mode
            peers; a given file must hold an RSA key for that too).
        client_mode: this peer can't accept incoming connections (behind NAT/firewall): it only connects out.
            Such peers contribute gradients but don't serve state to others.
        use_relay: allow connecting to peers through libp2p relays.
        use_auto_relay: look for relays automatically and be reachable through them (peers behind NAT).
        matchmaking_time: seconds to wait for peers when forming an averaging group.
        averaging_timeout: seconds after which an averaging round is abandoned (the peer then uses its local
            gradients); dead peers are dropped within this time. Must be larger than matchmaking_time.
        allreduce_timeout: seconds to wait for the all-reduce itself (default: averaging_timeout).
        link_mbit: the slowest link expected in the swarm (Mbit/s, the slower direction). If given, averaging_timeout
            and allreduce_timeout are raised where a round of this model with this codec needs longer at that rate
            (see :mod:`lightning_swarm.link_budget`); if not, the log says which links the timeouts suit.
        load_state_timeout: seconds a joining peer waits for the next part of the state from a peer before it
            tries another one (a stall: the whole download may take much longer over a slow link; failed downloads
            are retried, see :mod:`lightning_swarm.hivemind_ext.state_download`).
        max_stale_epochs: a joining peer whose downloaded state turns out at most this many global epochs behind the
            swarm's (the swarm stepped during the download) trains at the swarm's epoch from its next local step: its
            gradients count (computed on parameters that many steps old) and its next state averaging round, where it
            has weight 0, gives it its group's parameters. Further behind, it downloads again. Default 16; 0:
            hivemind's behaviour (download again when more than one epoch behind, which in a swarm whose global step
            is shorter than the download never ends). See :mod:`lightning_swarm.hivemind_ext.catch_up`.
        next_chunk_timeout: seconds an all-reduce waits for a peer's next part before it leaves that peer out of
            the round. Default: ``matchmaking_time``, at least ``min(10, averaging_timeout / 3)``: hivemind's
            default (``matchmaking_time``) drops parts of slow links or loaded peers ("received 95.7% results").
        delay_optimizer_step: run the optimizer step in the background, applied at a later local step
            (needs offload_optimizer).
        delay_grad_averaging: average gradients in the background (needs delay_optimizer_step).
        delay_state_averaging: average parameters/optimizer state in the background.
        overlap_max_peers: with delay_optimizer_step or delay_grad_averaging, the three options above apply while
            the swarm has at most this many peers; a larger swarm averages synchronously, and each peer logs when it
            switches. Default 8: 8 simulated peers (half in client mode, churn) were 0.91-0.93 of ideal overlapped
            against 0.73-0.87 synchronous, 16 were 0.49 against 0.77 with 15 s epochs and 0.87-0.90 against 0.76
            with 30 s epochs (docs/swarm-at-scale.md). None: always as given.
        offload_optimizer: keep the optimizer (and a copy of the parameters) on the CPU. Default: hivemind's
            default (True).
        reuse_grad_buffers: accumulate gradients in the parameters' ``.grad`` (saves memory; Lightning's
            ``zero_grad`` is disabled while training).
        average_state_every: average parameters/optimizer state every this many global epochs.
        compression: codec for gradients and state on the wire: ``"adaptive"`` (8-bit for big tensors, fp16
            otherwise), ``"fp16"``, ``"none"``, or a hivemind ``CompressionBase``.
        load_state_compression: codec of the state a joining peer downloads (same choices). Default ``"none"``:
            a newcomer starts from exactly the swarm's parameters, not from a rounding of them (it is one
            download per join; use ``"fp16"`` to halve it).
        aggregation: how each averaging round combines the peers' tensors: ``"mean"`` (hivemind's weighted
            mean) or ``"centered_clip"`` (CenteredClip, robust to a minority of malicious peers; needs 3+ peers to
            tell one apart). Either way, a sender's weight must be finite, positive and at most the samples in its
            progress record, and a sender's non-finite part is dropped (see :mod:`lightning_swarm.aggregation`).
        centered_clip_tau: CenteredClip's clipping radius (L2 norm per all-reduce part of 2**19 bytes); default
            None: adaptive, the weighted median of the senders' distances to the current estimate.
        centered_clip_iters: at most this many CenteredClip iterations per part.
        centered_clip_min_alignment: with CenteredClip, in (0, 1], or None (off, the default; 0.5 for an open
            swarm). In each gradient part, a sender whose gradient goes along less than this fraction of the
            senders' (one vote each) robust estimate loses weight in proportion, and each reducer remembers it for
            the next rounds: a peer that sends gradients against the swarm's loses its weight (logged), a lying
            minority can slow each step by at most ``1 - min_alignment`` times its weight share. Off by default: it
            cost honest swarms 1-2% of the loss with AdamW after 12 epochs in a simulation (docs/security.md).
        worker_momentum: beta in [0, 1), default 0 (off). If > 0, before each gradient averaging round this peer
            replaces its accumulated (sample-mean) gradient g by its momentum m = beta * m + (1 - beta) * g
            (bias-corrected; one more gradient-sized buffer) and sends that; the optimizer steps on the average. With
            CenteredClip it shrinks what a Byzantine peer can move (docs/security.md, module worker_momentum).
        averager_opts: extra keyword arguments for hivemind's averagers (e.g. ``{"request_timeout": 1.0}``), plus
            ``leader_poll_interval``: minimum seconds between two DHT reads of the averagers looking for a group
            (default: a tenth of matchmaking_time, at most 0.5 s; hivemind itself polls without pause), and
            ``max_state_downloads``: downloads of this peer's state served at once (default 2; one per requester,
            see :mod:`lightning_swarm.hivemind_ext.state_serving`), and
            ``expected_peers``: with ``target_group_size`` g below it, each peer starts under a random one of
            ``expected_peers / g`` group keys (hivemind's ``initial_group_bits``), so groups change every round
            and every peer's contribution reaches all in about log_g(expected_peers) rounds; a peer that finds no
            group under its key (a client-mode one too) moves to another
            (:mod:`lightning_swarm.hivemind_ext.group_keys`). Unset: one key, hivemind's default.
        tracker_opts: extra keyword arguments for hivemind's ProgressTracker (e.g. ``{"max_refresh_period": 2}``),
            plus ``min_report_interval`` (default: ``min_refresh_period``, 0.5 s): this peer publishes its
            progress to the DHT at most that often (and every half fetch interval, which is longer early in an
            epoch), not once per local step (see :mod:`lightning_swarm.hivemind_ext.tracker`).
        publish_metrics: publish this peer's metrics to the DHT (for a monitoring peer), see
            :mod:`lightning_swarm.metrics`.
        metrics_interval: seconds between two metric publications.
        log_progress: add a :class:`~lightning_swarm.callbacks.progress.SwarmProgress` callback that shows the
            global epoch, number of peers and throughput in the progress bar and loggers.
        device: torch device for the model (default: the accelerator's device, e.g. ``cuda:0`` or ``cpu``).
        verbose: log hivemind's internal events (matchmaking, averaging) at INFO level.
        auth: credentials for a run with an authority (allowlist authentication), e.g.
            ``{"authority_key": "authority.pub", "token": "alice.token", "key": "alice.pem"}`` or
            ``{"authority_key": ..., "server": "https://auth.example.org", "username": "alice", "key": "alice.pem"}``;
            each field falls back to ``$LIGHTNING_SWARM_AUTH_<FIELD>``; ``allow_http: true`` accepts an ``http://``
            authority off this machine (refused otherwise). Default: none, an open run (see
            :mod:`lightning_swarm.auth.peer` and docs/security.md).

    The batch size of every local step is taken from the batch (first dimension, Lightning's
    ``extract_batch_size``); a LightningModule can override it by defining ``swarm_batch_size(batch) -> int``.
    """

    strategy_name = "hivemind"
    # the gradient averager hivemind.Optimizer builds (a subclass may change how this peer sends its gradients)
    grad_averager_class = SwarmGradientAverager

    def __init__(
        self,
        run_id: str,
        target_batch_size: int,
        initial_peers: Union[None, str, List[str]] = None,
        host_maddrs: Optional[List[str]] = None,
        announce_maddrs: Optional[List[str]] = None,
        identity_path: Optional[str] = None,
        client_mode: bool = False,
        use_relay: bool = True,
        use_auto_relay: bool = False,
        matchmaking_time: float = 5.0,
        averaging_timeout: float = 60.0,
        allreduce_timeout: Optional[float] = None,
        link_mbit: Optional[float] = None,
        load_state_timeout: float = 60.0,
        next_chunk_timeout: Optional[float] = None,
        max_stale_epochs: int = DEFAULT_MAX_STALE_EPOCHS,
        delay_optimizer_step: Optional[bool] = None,
        delay_grad_averaging: bool = False,
        delay_state_averaging: bool = True,
        overlap_max_peers: Optional[int] = DEFAULT_OVERLAP_MAX_PEERS,
        offload_optimizer: Optional[bool] = None,
        reuse_grad_buffers: bool = False,
        average_state_every: int = 1,
        compression: Union[str, CompressionBase] = "adaptive",
        load_state_compression: Union[str, CompressionBase] = "none",
        aggregation: str = "mean",
        centered_clip_tau: Optional[float] = None,
        centered_clip_iters: int = DEFAULT_CENTERED_CLIP_ITERS,
        centered_clip_min_alignment: Optional[float] = None,
        worker_momentum: float = 0.0,
        averager_opts: Optional[Dict[str, Any]] = None,
        tracker_opts: Optional[Dict[str, Any]] = None,
        publish_metrics: bool = True,
        metrics_interval: float = 10.0,
        log_progress: bool = True,
        device: Optional[str] = None,
        verbose: bool = False,
        auth: Optional[Dict[str, Union[str, bool]]] = None,
    ):
        super().__init__(device=device or "cpu")
        self._device_given = device is not None
        check_strategy_options(
            run_id=run_id, target_batch_size=target_batch_size, matchmaking_time=matchmaking_time,
            averaging_timeout=averaging_timeout, allreduce_timeout=allreduce_timeout,
            load_state_timeout=load_state_timeout, next_chunk_timeout=next_chunk_timeout,
            metrics_interval=metrics_interval, delay_optimizer_step=delay_optimizer_step,
            delay_grad_averaging=delay_grad_averaging, offload_optimizer=offload_optimizer,
            reuse_grad_buffers=reuse_grad_buffers, client_mode=client_mode, announce_maddrs=announce_maddrs,
            use_relay=use_relay, use_auto_relay=use_auto_relay, average_state_every=average_state_every,
            averager_opts=averager_opts, tracker_opts=tracker_opts, compression=compression,
            load_state_compression=load_state_compression,
        )
        check_aggregation_options(aggregation, centered_clip_tau, centered_clip_iters, centered_clip_min_alignment)
        self.worker_momentum = check_worker_momentum(worker_momentum)

        self.run_id = run_id
        self.robust_averaging_opts = dict(aggregation=aggregation, centered_clip_tau=centered_clip_tau,
                                          centered_clip_iters=centered_clip_iters,
                                          centered_clip_min_alignment=centered_clip_min_alignment)
        self.auth_settings = resolve_auth_settings(auth)  # {} in an open run
        # this peer's credentials, made from auth_settings when the DHT starts (the monitor presets a moderator's)
        self.swarm_auth: Optional[SwarmAuth] = None
        self.target_batch_size = target_batch_size
        self.initial_peers = resolve_initial_peers(initial_peers)
        self.host_maddrs = check_listen_maddrs(host_maddrs, "host_maddrs") or ["/ip4/0.0.0.0/tcp/0"]
        self.announce_maddrs = check_listen_maddrs(announce_maddrs, "announce_maddrs")
        self.identity_path = identity_path
        self.client_mode = client_mode
        self.use_relay, self.use_auto_relay = use_relay, use_auto_relay
        self.compression, self.load_state_compression = compression, load_state_compression
        if link_mbit is not None and not (isinstance(link_mbit, (int, float)) and link_mbit > 0):
            raise ValueError(f"link_mbit must be a positive number of Mbit/s, got {link_mbit!r}")
        self.link_mbit = link_mbit
        self.reuse_grad_buffers = reuse_grad_buffers
        self.publish_metrics, self.metrics_interval = publish_metrics, metrics_interval
        self.log_progress = log_progress
        self._hivemind_kwargs = hivemind_optimizer_options(
            matchmaking_time=matchmaking_time, averaging_timeout=averaging_timeout,
            allreduce_timeout=allreduce_timeout, load_state_timeout=load_state_timeout,
            next_chunk_timeout=next_chunk_timeout, delay_optimizer_step=delay_optimizer_step,
            delay_grad_averaging=delay_grad_averaging, delay_state_averaging=delay_state_averaging,
            offload_optimizer=offload_optimizer, reuse_grad_buffers=reuse_grad_buffers,
            average_state_every=average_state_every, averager_opts=averager_opts, tracker_opts=tracker_opts,
            verbose=verbose, overlap_max_peers=overlap_max_peers, max_stale_epochs=max_stale_epochs,
        )

        self._dht: Optional[hivemind.DHT] = None
        self._optimizer: Optional[hivemind.Optimizer] = None
        self._original_zero_grad: Optional[Callable] = None
        self._current_batch_size: Optional[int] = None
        self._metrics_publisher = swarm_metrics.MetricsPublisher()
        self.stats = swarm_metrics.SwarmStats()

    # ----------------------------------------------------------------------------------------------- public API
    @property
    def dht(self) -> Optional[hivemind.DHT]:
        """This peer's DHT node (None before `fit` starts)."""
        return self._dht

    @property
    def optimizer(self) -> Optional[hivemind.Optimizer]:
        """The hivemind.Optimizer wrapping the module's optimizer (None before `fit` sets up)."""
        return self._optimizer

    @property
    def global_epoch(self) -> int:
        """Number of global optimizer steps this peer has reached (kept in sync with the swarm)."""
        return self._optimizer.local_epoch if self._optimizer is not None else 0

    @property
    def num_peers(self) -> int:
        """Peers currently training in this run, this one included (as last seen in the DHT)."""
        if self._optimizer is None:
            return 1
        return max(1, self._optimizer.tracker.global_progress.num_peers)

    def load_state_from_peers(self) -> None:
        """Download the current parameters, optimizer state, epoch and LR schedule from other peers."""
        if self._optimizer is None:
            raise RuntimeError("load_state_from_peers() needs a running optimizer: call it during fit")
        self._optimizer.load_state_from_peers()

    def start_dht(self) -> hivemind.DHT:
        """Start this peer's DHT (idempotent) and print how other peers can join."""
        if self._dht is None:
            if self.swarm_auth is None and self.auth_settings:  # the monitor may have set the moderators' own
                self.swarm_auth = SwarmAuth(self.run_id, **self.auth_settings)
            self._dht = start_peer_dht(
                self.run_id,
                initial_peers=self.initial_peers,
                host_maddrs=self.host_maddrs,
                announce_maddrs=self.announce_maddrs,
                client_mode=self.client_mode,
                use_relay=self.use_relay,
                use_auto_relay=self.use_auto_relay,
                identity_path=self.identity_path,
                swarm_auth=self.swarm_auth,
            )
        return self._dht

    # ---------------------------------------------------------------------------------------------- Lightning
    @property
    def root_device(self) -> torch.device:
        if not self._device_given and self.accelerator is not None:
            from lightning.pytorch.accelerators import CUDAAccelerator

            if isinstance(self.accelerator, CUDAAccelerator):
                return torch.device("cuda", torch.cuda.current_device())
        return self._root_device

    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        check_trainer_for_swarm(trainer.accumulate_grad_batches, self._grad_scaler is not None,
                                self.reuse_grad_buffers, len(self.optimizers))
        self.start_dht()
        self._wrap_optimizer(self.optimizers[0])
        if self.reuse_grad_buffers:  # hivemind accumulates in .grad: Lightning must not zero it
            module = self.lightning_module
            self._original_zero_grad = module.optimizer_zero_grad
            module.optimizer_zero_grad = lambda *args, **kwargs: None
        if self.log_progress:
            if not any(isinstance(callback, SwarmProgress) for callback in trainer.callbacks):
                trainer.callbacks.append(SwarmProgress())

    def _wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        schedulers = [config.scheduler for config in self.lr_scheduler_configs]
        if len(schedulers) > 1:
            raise ValueError(f"HivemindStrategy supports at most one LR scheduler, got {len(schedulers)}")
        user_scheduler = schedulers[0] if schedulers else None
        self._optimizer = self.make_swarm_optimizer(optimizer, user_scheduler)
        # a state download that keeps failing must not outlive SIGTERM or max_time (hivemind retries forever)
        self._optimizer.stop_waiting = lambda: trainer_stop_reason(self._trainer_or_none())
        self.optimizers = [self._optimizer]
        if user_scheduler is not None:
            self.lr_scheduler_configs[0].scheduler = GlobalEpochScheduler(
                self._optimizer.state_averager.scheduler, self._optimizer
            )

    def make_swarm_optimizer(
        self, optimizer: torch.optim.Optimizer, scheduler: Optional[Any] = None, **overrides: Any
    ) -> SwarmOptimizer:
        """The swarm optimizer this strategy trains with, around ``optimizer`` (and its LR ``scheduler``).

        Used by :meth:`setup` and by the monitor peer, so that every option of a recipe's strategy config means
        the same for both. Starts the DHT if needed.

        Args:
            optimizer: the module's optimizer; it is re-created (same class and hyper-parameters) on its param groups.
            scheduler: an LR scheduler built on ``optimizer`` (rebound to the swarm's optimizer), or None.
            **overrides: hivemind.Optimizer arguments that replace this strategy's (the monitor sets
                ``use_local_updates=True``, ``offload_optimizer=False``, ...).
        """
        make_scheduler = scheduler_factory(scheduler, optimizer)  # a bad scheduler fails before the DHT starts
        dht = self.start_dht()  # also sets swarm_auth in a run with an authority
        return build_swarm_optimizer(
            dht=dht, run_id=self.run_id, target_batch_size=self.target_batch_size, optimizer=optimizer,
            make_scheduler=make_scheduler, swarm_auth=self.swarm_auth, compression=self.compression,
            load_state_compression=self.load_state_compression, grad_averager_class=self.grad_averager_class,
            robust_averaging_opts=self.robust_averaging_opts, hivemind_kwargs=self._hivemind_kwargs,
            link_mbit=self.link_mbit, overrides=overrides, worker_momentum=self.worker_momentum,
        )

    def on_train_start(self) -> None:
        """Join the swarm where it is (:func:`~lightning_swarm.swarm_optimizer.join_swarm`)."""
        super().on_train_start()
        if self._optimizer is None:
            return
        join_swarm(self._optimizer, joining=bool(self.initial_peers))
        self._stop_if_download_abandoned()
        self.stats.start(self.global_epoch)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        module = self.lightning_module
        if callable(getattr(module, "swarm_batch_size", None)):
            self._current_batch_size = int(module.swarm_batch_size(batch))
        else:
            self._current_batch_size = extract_batch_size(batch)

    @property
    def _grad_scaler(self) -> Optional[torch.amp.GradScaler]:
        """The fp16 loss scaler of Lightning's precision plugin (precision='16-mixed'), None otherwise."""
        return getattr(self.precision_plugin, "scaler", None)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """One local step. Under fp16 loss scaling Lightning's precision plugin unscales the gradients before
        ``hivemind.Optimizer.step`` adds them to the accumulators, and skips that call when they overflowed: such a
        batch is never accumulated nor sent, on whichever peer it happens, and the averaged gradients stay finite."""
        if self._optimizer is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._current_batch_size is None:
            raise ValueError("HivemindStrategy could not tell the batch size: define swarm_batch_size(batch)")
        kwargs.setdefault("batch_size", self._current_batch_size)
        losses: List[Any] = []

        def closure_keeping_loss() -> Any:  # the fp16 path calls the closure itself and hivemind returns no loss
            losses.append(closure())
            return losses[-1]

        scaler = self._grad_scaler
        scale_before = scaler.get_scale() if scaler is not None else None
        step_output = super().optimizer_step(optimizer, closure_keeping_loss, model, **kwargs)
        self._stop_if_download_abandoned()
        loss = losses[-1] if losses else step_output
        skipped = scaler is not None and scaler.get_scale() < scale_before  # the scale only drops on an overflow
        if skipped:
            log.info(f"[lightning_swarm] fp16 gradients overflowed: batch skipped, loss scale {scaler.get_scale():g}")
        self.stats.record_step(0 if skipped else kwargs["batch_size"], loss, self.global_epoch, self.target_batch_size)
        if self.publish_metrics and self.stats.due(self.metrics_interval):
            record = self.stats.make_record(self.global_epoch, self.local_samples_per_second,
                                            token=self.swarm_auth.token_for_records() if self.swarm_auth else "")
            self._metrics_publisher.publish(self._dht, self.run_id, record)
        return step_output

    def _trainer_or_none(self) -> Optional[Trainer]:
        try:
            return self.lightning_module.trainer if self.lightning_module is not None else None
        except RuntimeError:  # the module is not attached to a Trainer
            return None

    def _stop_if_download_abandoned(self) -> None:
        """Stop training once the optimizer abandoned a state download (SIGTERM, max_time): its state is stale."""
        trainer = self._trainer_or_none()
        if self._optimizer.download_abandoned and trainer is not None:
            trainer.should_stop = True

    @property
    def local_samples_per_second(self) -> float:
        return self._optimizer.tracker.performance_ema.samples_per_second if self._optimizer is not None else 0.0

    def teardown(self) -> None:
        if self._original_zero_grad is not None and self.lightning_module is not None:
            self.lightning_module.optimizer_zero_grad = self._original_zero_grad
            self._original_zero_grad = None
        self._metrics_publisher.finish(timeout=5)
        if self._optimizer is not None:
            self._optimizer.shutdown()
            self._optimizer = None
        if self._dht is not None:
            self._dht.shutdown()
            self._dht = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        pass  # needs run_id and target_batch_size: not constructible from a bare name like "hivemind"
