"""CPU per DHT record check: hivemind's validators against lightning_swarm.record_validators', side by side.

The workload is what a peer's DHT process checks in a swarm of ``--peers`` peers: every peer's progress record (the
schema and signature hivemind's progress tracker installs, a real ``LocalTrainingProgress`` value, signed by its
owner's own RSA-2048 key) arrives ``--fetches`` times (fetches by this peer's tracker, answers to other peers' gets)
before its owner stores a new one. Both stacks are built the way a peer builds them (the run's metrics validators
first, then the tracker's, merged by hivemind's ``CompositeValidator``) and check the same records in the same order,
interleaved in rounds so that load on the machine hits both alike.

    python tests/benchmarks/bench_record_validators.py --peers 16 --fetches 4 --rounds 5

prints the microseconds per check of each stack, their ratio, and the share of checks the cached stack recalled.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.optim.progress_tracker import LocalTrainingProgress, TrainingProgressSchema
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from lightning_swarm import metrics
from lightning_swarm.record_validators import RememberAccepted

RUN = "bench"


def stack(cached: bool, key: RSAPrivateKey):
    """A peer's validators (the run's metrics ones first, then the tracker's) and the first ones."""
    first = (metrics.make_validators(RUN) if cached else
             [SchemaValidator(metrics.MetricSchema, prefix=RUN), RSASignatureValidator(key)])
    composite = CompositeValidator(first)
    composite.extend([SchemaValidator(TrainingProgressSchema, prefix=RUN), RSASignatureValidator(key)])  # tracker
    return composite, first


def progress_record(owner: RSASignatureValidator, epoch: int) -> DHTRecord:
    value = LocalTrainingProgress(peer_id=b"peer", epoch=epoch, samples_accumulated=64 * epoch,
                                  samples_per_second=31.5, time=get_dht_time(), client_mode=False)
    record = DHTRecord(key=DHTID.generate(source=f"{RUN}_progress").to_bytes(),
                       subkey=DHTProtocol.serializer.dumps(owner.local_public_key),
                       value=DHTProtocol.serializer.dumps(value.dict()), expiration_time=get_dht_time() + 60)
    return dataclasses.replace(record, value=owner.sign_value(record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=16, help="peers whose records arrive")
    parser.add_argument("--fetches", type=int, default=4, help="times each record arrives before its owner renews it")
    parser.add_argument("--rounds", type=int, default=5, help="renewals of every record (each one a new record)")
    args = parser.parse_args()
    owners = [RSASignatureValidator(RSAPrivateKey()) for _ in range(args.peers)]
    key = RSAPrivateKey()
    stacks, firsts = {}, {}
    for name, cached in (("hivemind", False), ("cached", True)):
        stacks[name], firsts[name] = stack(cached, key)
    seconds = dict.fromkeys(stacks, 0.0)
    checks = 0
    for epoch in range(args.rounds):
        records = [progress_record(owner, epoch) for owner in owners]
        for _ in range(args.fetches):
            for name, composite in stacks.items():
                start = time.process_time()
                for record in records:
                    if not composite.validate(record):
                        raise SystemExit(f"{name} refused an honest record")
                seconds[name] += time.process_time() - start
            checks += len(records)
    for name, total in seconds.items():
        print(f"{name:9s} {1e6 * total / checks:8.1f} us per record check ({checks} checks, CPU time)")
    print(f"ratio hivemind/cached: {seconds['hivemind'] / seconds['cached']:.2f}")
    remembering = [v for v in firsts["cached"] if isinstance(v, RememberAccepted)]
    recalled = sum(v.recalled for v in remembering)
    total = sum(v.recalled + v.checked for v in remembering)
    print(f"cached stack recalled {recalled} of {total} validator calls ({recalled / total:.0%}); expected "
          f"{(args.fetches - 1) / args.fetches:.0%} (all but the first arrival of each record)")


if __name__ == "__main__":
    main()
