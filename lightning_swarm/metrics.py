"""Per-peer training metrics published to the DHT in signed, schema-validated records.

Every training peer stores one record per run under the DHT key ``f"{run_id}_metrics"``; the subkey is the
peer's RSA public key (``[owner:...]``), so hivemind's ``RSASignatureValidator`` lets only the owner overwrite
its own record, and ``SchemaValidator`` rejects records that don't match :class:`LocalMetrics`.
An auxiliary peer (a monitor) reads all of them, checked field by field and within plausible bounds, with
:func:`lightning_swarm.monitor.records.fetch_metric_records` (:func:`fetch_metrics` checks only the schema).

Both the publishing and the reading DHT must carry the validators: create the DHT with
``record_validators=make_validators(run_id)`` or call :func:`add_metrics_validators` on a running one.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Union

import hivemind
import torch
from hivemind.utils import get_dht_time
import pydantic.v1 as pydantic  # hivemind's SchemaValidator works with pydantic v1 models
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils.mpfuture import MPFuture

from lightning_swarm.record_validators import CachedSchemaValidator, CachedSignatureValidator

log = logging.getLogger(__name__)

# how long a published record stays in the DHT if the peer stops refreshing it (e.g. because it died)
DEFAULT_METRICS_EXPIRATION = 60.0


class LocalMetrics(pydantic.BaseModel):
    """What one peer reports about its own training. Strict types: the DHT schema check forbids conversions.

    step: this peer's global epoch (number of collaborative optimizer steps it has taken part in)
    loss: mean training loss over the local steps since the last report
    samples_per_second: this peer's local training throughput
    samples_accumulated: total samples this peer has contributed to the run so far
    mini_steps: local optimizer steps (batches) since the last report
    time: hivemind DHT time (``get_dht_time()``) when the record was made
    token: in a run with an authority, the peer's access token (JSON, see ``lightning_swarm.auth.tokens``), so that
        the monitor can name the user whose key signed the record; empty in an open run
    """

    step: pydantic.conint(ge=0, strict=True)
    loss: pydantic.StrictFloat
    samples_per_second: pydantic.confloat(ge=0.0, strict=True)
    samples_accumulated: pydantic.conint(ge=0, strict=True)
    mini_steps: pydantic.conint(ge=0, strict=True)
    time: pydantic.StrictFloat
    token: pydantic.StrictStr = ""


class MetricSchema(pydantic.BaseModel):
    metrics: Dict[BytesWithPublicKey, LocalMetrics]


def metrics_key(run_id: str) -> str:
    """The DHT key under which all peers of ``run_id`` publish their metrics."""
    return f"{run_id}_metrics"


def make_validators(run_id: str) -> List[RecordValidatorBase]:
    """Validators for the metrics records of ``run_id``: schema check + RSA signature (process-wide key), each record
    checked once (:mod:`lightning_swarm.record_validators`)."""
    return [CachedSchemaValidator(MetricSchema, prefix=run_id), CachedSignatureValidator()]


def add_metrics_validators(dht: hivemind.DHT, run_id: str) -> None:
    """Install the metrics validators on a running DHT (needed both to publish and to read the records)."""
    dht.add_validators(make_validators(run_id))


def local_public_key() -> bytes:
    """This process's public-key subkey (``[owner:...]``), the same key the signature validator signs with."""
    return RSASignatureValidator().local_public_key


def publish_metrics(
    dht: hivemind.DHT,
    run_id: str,
    metrics: LocalMetrics,
    expiration: float = DEFAULT_METRICS_EXPIRATION,
    wait: bool = True,
) -> Union[bool, MPFuture]:
    """Store this peer's ``metrics`` under the run, signed with this process's key.

    Args:
        dht: a running DHT that has the validators of :func:`make_validators` (see module docstring).
        run_id: the training run's id (the strategy's ``run_id``).
        metrics: the record to publish.
        expiration: seconds until the record expires unless it is published again.
        wait: if False, store in the background and return the future (don't block the training loop). Keep a
            reference to it until it is done: a future dropped early breaks its pipe to the DHT process.
    """
    future = dht.store(
        key=metrics_key(run_id),
        subkey=local_public_key(),
        value=metrics.dict(),
        expiration_time=get_dht_time() + expiration,
        return_future=True,
    )
    return future.result() if wait else future


def fetch_metrics(dht: hivemind.DHT, run_id: str, latest: bool = True) -> Dict[bytes, LocalMetrics]:
    """All valid, unexpired metrics records of ``run_id``: a dict from the peer's public key to its metrics."""
    found = dht.get(metrics_key(run_id), latest=latest)
    if found is None or not isinstance(found.value, dict):
        return {}
    records = {}
    for public_key, entry in found.value.items():
        try:
            records[public_key] = LocalMetrics.parse_obj(entry.value)
        except pydantic.ValidationError:
            continue  # the validators already filter these; skip anything malformed defensively
    return records


class MetricsPublisher:
    """Publishes a training peer's records in the background, never stopping training: a failed publication is
    logged, and each store's future is kept until it is done (a future dropped early breaks its pipe to the DHT
    process)."""

    def __init__(self) -> None:
        self._pending: List[MPFuture] = []

    def publish(self, dht: hivemind.DHT, run_id: str, record: LocalMetrics) -> None:
        try:
            self._pending = [future for future in self._pending if not future.done()]
            self._pending.append(publish_metrics(dht, run_id, record, wait=False))
        except Exception as e:  # a failed publication must not stop training
            log.warning(f"[lightning_swarm] could not publish metrics: {e!r}")

    def finish(self, timeout: float = 5.0) -> None:
        """Wait up to ``timeout`` seconds for each publication still under way (before the DHT shuts down)."""
        for future in self._pending:
            try:
                future.result(timeout=timeout)
            except Exception:
                pass
        self._pending = []


class SwarmStats:
    """Counts what this peer contributes and measures the swarm's throughput from global epoch transitions."""

    def __init__(self) -> None:
        self.samples_contributed = 0
        self.swarm_samples_per_second = 0.0
        self._loss_sum, self._mini_steps = 0.0, 0
        self._epoch, self._epoch_start = 0, None
        self._last_publish = -float("inf")

    def start(self, epoch: int) -> None:
        """Begin measuring at `epoch`; the clock starts at the first local step."""
        self._epoch, self._epoch_start = epoch, None

    def record_step(self, batch_size: int, loss: Any, epoch: int, target_batch_size: int) -> None:
        if self._epoch_start is None:
            self._epoch_start = time.perf_counter()
        self.samples_contributed += int(batch_size)
        if loss is not None:
            self._loss_sum += float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
            self._mini_steps += 1
        if epoch > self._epoch:
            # the swarm processed about target_batch_size samples per global epoch since the last transition
            now = time.perf_counter()
            self.swarm_samples_per_second = (epoch - self._epoch) * target_batch_size / max(now - self._epoch_start, 1e-6)
            self._epoch, self._epoch_start = epoch, now

    def due(self, interval: float) -> bool:
        return time.perf_counter() - self._last_publish >= interval

    def make_record(self, epoch: int, samples_per_second: float, token: str = "") -> LocalMetrics:
        record = LocalMetrics(
            step=int(epoch),
            loss=float(self._loss_sum / max(self._mini_steps, 1)),
            samples_per_second=float(max(samples_per_second, 0.0)),
            samples_accumulated=int(self.samples_contributed),
            mini_steps=int(self._mini_steps),
            time=float(get_dht_time()),
            token=token,
        )
        self._loss_sum, self._mini_steps = 0.0, 0
        self._last_publish = time.perf_counter()
        return record
