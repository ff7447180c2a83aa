"""Progress reporting that does not cost a DHT store per local step.

hivemind's ``ProgressTracker`` wakes its reporter thread on every ``report_local_progress`` call, and the reporter
then stores a signed record in the DHT, which every other peer's DHT validates and keeps. hivemind.Optimizer
calls it once per local step: at 40 steps/s per peer that is 40 RSA-signed stores per second per peer, and in a
2-peer swarm on one machine the DHT processes and p2p daemons took about 40% of a core.

``ThrottledProgressTracker`` keeps all local bookkeeping exact (samples, global estimate, throughput EMA are
updated on every call, and its own samples are counted from the live value, not from its possibly older DHT
record, so the epoch ends exactly when the swarm reached ``target_batch_size``) but publishes at
most once per reporting interval; a report that arrives too early is published when the interval ends, so the
latest progress always reaches the swarm within the interval. A new epoch, a reset to zero samples, the step that
ends an epoch (the averaging round bounds each sender's weight by its record) and shutdown are published at once.

The interval follows how often peers fetch the swarm's progress: hivemind's fetcher waits ``0.4 x`` the time left
to the next epoch (with 2 peers; up to ``0.8 x`` with many), between ``min_refresh_period`` and
``max_refresh_period``. A record published every half fetch interval is at most half an interval old when a peer
reads it, and peers extrapolate it with the samples/s it carries. So early in a long epoch a peer reports every few
seconds, and in its last seconds every ``min_report_interval``: with 25 s epochs about a dozen stores per epoch
instead of 50 at a fixed 0.5 s (each one is a signed RPC to every other DHT node, on the cores that train).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Dict, Optional, Tuple

from hivemind.optim.progress_tracker import GlobalTrainingProgress, LocalTrainingProgress, ProgressTracker
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.timed_storage import ValueWithExpiration

from lightning_swarm.hivemind_ext.progress_records import note_counts, well_formed_records

log = logging.getLogger(__name__)


class _ThrottledEvent(threading.Event):
    """A threading.Event whose ``set()`` wakes waiters at most once per ``interval`` seconds.

    A ``set()`` that comes too early is deferred to the end of the interval (one timer at a time), so it is never
    lost; ``set_now()`` bypasses the throttle.
    """

    def __init__(self, interval: float):
        super().__init__()
        self.interval = interval
        self._lock = threading.Lock()
        self._last_set = -float("inf")
        self._timer: Optional[threading.Timer] = None

    def set_now(self) -> None:
        with self._lock:
            self._last_set = time.monotonic()
            super().set()

    def set(self) -> None:
        with self._lock:
            wait = self._last_set + self.interval - time.monotonic()
            if wait <= 0:
                self._last_set = time.monotonic()
                super().set()
            elif self._timer is None or not self._timer.is_alive():
                self._timer = threading.Timer(wait, self._deferred_set)
                self._timer.daemon = True
                self._timer.start()

    def _deferred_set(self) -> None:
        with self._lock:
            self._timer = None
        self.set()

    def cancel(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None


class ThrottledProgressTracker(ProgressTracker):
    """A ProgressTracker that publishes local progress to the DHT at most once per half fetch interval.

    Args:
        min_report_interval: minimum seconds between two DHT stores of this peer's progress (a new epoch or a
            reset is published at once). Default: ``min_refresh_period`` (hivemind's 0.5 s), the shortest time
            between two fetches of the swarm's progress: publishing more often than peers fetch is wasted.
            The interval is longer while the fetch interval is (half of it, see the module docstring).
        *args, **kwargs: as ``hivemind.optim.progress_tracker.ProgressTracker``.
    """

    def __init__(self, *args, min_report_interval: Optional[float] = None, start: bool, **kwargs):
        if min_report_interval is None:  # publishing faster than other peers fetch is wasted
            min_report_interval = kwargs.get("min_refresh_period", 0.5)
        if min_report_interval < 0:
            raise ValueError(f"min_report_interval must be >= 0 seconds, got {min_report_interval!r}")
        self.min_report_interval = min_report_interval
        self._counted_itself = False  # whether global_progress.num_peers includes this peer
        # each peer's largest samples_accumulated per epoch, as read: an overlapped gradient round bounds its
        # senders' weights by their counts of the epoch it averages (weight_bounds.py); not under
        # lock_global_progress, which hivemind holds through a global step (pause_updates)
        self._epoch_counts: Dict[Tuple[PeerID, int], float] = {}
        self._epoch_counts_lock = threading.Lock()
        super().__init__(*args, start=False, **kwargs)  # this fetches the progress once
        self.should_report_progress = _ThrottledEvent(self._report_interval(self.global_progress))
        if start:
            self.start()

    def report_local_progress(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True):
        urgent = local_epoch != self.local_progress.epoch or samples_accumulated == 0
        first_samples = self.local_progress.samples_accumulated == 0 and samples_accumulated > 0
        super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)
        if first_samples and not self._counted_itself and self.global_progress.num_peers > 0:
            # the last fetch saw other peers but not this one (no samples yet, so no record): hivemind adds our
            # samples to the global count above, add this peer too (see _parse_swarm_progress_data)
            self.global_progress.num_peers += 1
            self._counted_itself = True
        # the step that ends the epoch: the averaging round about to start bounds each sender's weight by its record
        urgent = urgent or self.ready_to_update_epoch
        if urgent:
            self.should_report_progress.set_now()

    @property
    def ready_to_update_epoch(self) -> bool:
        """Whether this peer ends the epoch now: as hivemind decides (the swarm reached ``target_batch_size``, or
        the estimated time of the epoch's end has passed), except that a peer alone ends it exactly at
        ``target_batch_size``. The time estimate keeps the peers of a swarm in step; a lone peer has nobody to keep
        in step with, and after any pause longer than its estimate (a validation, a stall of a loaded machine) it
        took a global step on a single batch: how many updates a fit made, and where its LR schedule ended,
        depended on the machine's timing (issue 28: the same command gave another fit under load)."""
        progress = self.global_progress
        if progress.num_peers <= 1:
            return self.global_epoch > self.local_progress.epoch or progress.samples_accumulated >= self.target_batch_size
        return super().ready_to_update_epoch

    def _parse_swarm_progress_data(self, metadata) -> GlobalTrainingProgress:
        # strangers write these records: malformed ones (types, ranges, non-finite values) are ignored and logged
        metadata = well_formed_records(metadata, get_dht_time(), keep=self._local_public_key)
        # hivemind counts this peer's samples from its own DHT record, which may now be up to one interval old:
        # use the live local progress instead, or the epoch would end late (more samples than target_batch_size)
        own = metadata.get(self._local_public_key) if isinstance(metadata, dict) else None
        if own is not None and own.value is not None:
            metadata = dict(metadata)
            metadata[self._local_public_key] = ValueWithExpiration(self.local_progress.dict(), own.expiration_time)
        elif metadata and isinstance(metadata, dict) and self.local_progress.samples_accumulated > 0:
            # Other peers' records are in, this peer's first one is not yet (it is stored after its first samples,
            # one DHT round trip later): count it anyway. Without it, num_peers is 1 while another peer trains,
            # hivemind.Optimizer skips the gradient all-reduce ("no other peers") and steps on this peer's
            # gradients alone, dropping the samples the others counted towards the same global step.
            metadata = dict(metadata)
            metadata[self._local_public_key] = ValueWithExpiration(
                self.local_progress.dict(), get_dht_time() + self.metadata_expiration
            )
        self._counted_itself = isinstance(metadata, dict) and self._local_public_key in metadata
        with self._epoch_counts_lock:
            note_counts(self._epoch_counts, metadata)
            oldest = self.local_progress.epoch - 1  # the epoch a round under way may still average
            for key in [key for key in self._epoch_counts if key[1] < oldest]:
                del self._epoch_counts[key]
        progress = super()._parse_swarm_progress_data(metadata)
        # hivemind's __init__ parses a first fetch before it creates should_report_progress (replaced by ours after)
        if isinstance(getattr(self, "should_report_progress", None), _ThrottledEvent):
            self.should_report_progress.interval = self._report_interval(progress)
        return progress

    def fetch_global_progress(self, timeout: float = 10.0) -> GlobalTrainingProgress:
        """Fetch the swarm's progress now (not at the next fetch time) and make it this tracker's; on a DHT that does
        not answer within ``timeout`` seconds, keep the last one. Returns the global progress."""
        try:
            found = self.dht.get(self.training_progress_key, latest=True, return_future=True).result(timeout)
        except Exception as e:  # the background fetcher will try again
            log.info(f"[lightning_swarm] could not fetch the swarm's progress: {e!r}")
            return self.global_progress
        metadata = found.value if isinstance(found, ValueWithExpiration) else None
        with self.lock_global_progress:
            self.global_progress = self._parse_swarm_progress_data(metadata)
            self.fetched_global_progress_this_epoch.set()
        return self.global_progress

    def epoch_counts(self, epoch: int) -> Dict[bytes, float]:
        """The largest ``samples_accumulated`` of ``epoch`` this tracker read in each peer's record (peer id bytes
        -> samples; this peer's own from its live progress, up to its latest report), over all fetches of that
        epoch and the one after it.

        Args:
            epoch: the epoch; counts of epochs before this peer's previous one are not kept.
        """
        with self._epoch_counts_lock:
            counts = {peer.to_bytes(): count for (peer, of), count in self._epoch_counts.items() if of == epoch}
        own = self.local_progress  # its latest step (the one ending the epoch) reported, maybe not yet fetched
        if own.epoch == epoch:
            counts[own.peer_id] = max(counts.get(own.peer_id, 0.0), float(own.samples_accumulated))
        return counts

    def peek_global_epoch(self, timeout: float = 5.0) -> int:
        """The swarm's epoch read from the DHT now, as ``global_epoch`` would be after a fetch, without taking the
        tracker's lock or changing its state: hivemind holds that lock through a global step (``pause_updates``),
        so ``global_epoch`` stays as it was when the step began while its rounds run. On a DHT that does not answer
        within ``timeout`` seconds, ``global_epoch``."""
        epoch = max(self.global_epoch, self.local_progress.epoch)
        try:
            found = self.dht.get(self.training_progress_key, latest=True, return_future=True).result(timeout)
        except Exception:
            return epoch
        metadata = found.value if isinstance(found, ValueWithExpiration) else None
        for entry in self._trusted_records(metadata).values():
            try:
                record = LocalTrainingProgress.parse_obj(entry.value)
            except Exception:  # the "left the run" record (None), or one the checks let through but hivemind refuses
                continue
            if not record.client_mode:  # as hivemind's global epoch
                epoch = max(epoch, record.epoch)
        return epoch

    def _trusted_records(self, metadata) -> dict:
        """The progress records of ``metadata`` (a DHT get's value) that this tracker counts."""
        return well_formed_records(metadata, get_dht_time(), keep=self._local_public_key)

    def _report_interval(self, progress: GlobalTrainingProgress) -> float:
        fetch_interval = progress.next_fetch_time - get_dht_time()  # how long peers wait before their next fetch
        return max(self.min_report_interval, fetch_interval / 2)

    def shutdown(self, timeout: Optional[float] = None):
        """Stop reporting, and store the "left the run" record before returning (hivemind's own shutdown sends
        that store without waiting, so a DHT shut down right after it failed to read the request)."""
        self.shutdown_triggered.set()  # before waking the reporter, so that it exits instead of waiting again
        self.should_report_progress.cancel()
        self.should_report_progress.set_now()
        self.global_state_updated.set()
        self.shutdown_complete.wait(timeout)
        future = self.dht.store(self.training_progress_key, subkey=self._local_public_key, value=None,
                                expiration_time=get_dht_time() + self.metadata_expiration, return_future=True)
        try:
            future.result(timeout=timeout if timeout is not None else 10.0)
        except Exception:  # leaving quietly matters more than the record: it expires anyway
            pass
