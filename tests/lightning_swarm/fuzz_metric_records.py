"""Fuzzer of the monitor's metrics record decoder: mutated records, as msgpack bytes off the DHT, decoded here.

Run by the suite in a child process with a fixed seed and a bounded count
(test_monitor_records.py::test_fuzzed_metric_records_never_crash_the_decoder); run more by hand::

    python tests/lightning_swarm/fuzz_metric_records.py --seed 1 --count 200000

Each input is decoded as the monitor decodes a DHT value (hivemind's msgpack serializer, then
:func:`lightning_swarm.monitor.records.decode_metrics_record`). A record that is returned must be a plausible
LocalMetrics (exact types, finite, inside the bounds); the records returned are aggregated and served as JSON
(``allow_nan=False``). A signal death, an exception other than the decoder's refusals, or a figure that is not
finite fails the run. Prints one JSON line of counts.
"""

import argparse
import json
import math
import random
import sys
import time

EDGE_VALUES = [0, -1, 1, 2 ** 31, 2 ** 53 + 1, 2 ** 63 - 1, -2 ** 63, 2 ** 64 - 1, 0.0, -0.0, 5e-324, 1e6 + 1,
               1e308, -1e308, float("inf"), float("-inf"), float("nan"), True, False, None, "", "x" * 70000,
               b"\x00" * 16, [], {}, [1.0] * 1000, {"class_path": "subprocess.Popen"}, [[[[[]]]]]]
FIELDS = ("step", "loss", "samples_per_second", "samples_accumulated", "mini_steps", "time", "token")


def valid_record(rng: random.Random) -> dict:
    return dict(step=rng.randrange(0, 1000), loss=rng.uniform(0.0, 10.0), samples_per_second=rng.uniform(0.0, 100.0),
                samples_accumulated=rng.randrange(0, 10 ** 6), mini_steps=rng.randrange(0, 100),
                time=1.7e9 + rng.uniform(0.0, 1e3), token="")


def structured_mutation(rng: random.Random, record: dict):
    choice = rng.randrange(7)
    record = dict(record)
    if choice == 0:
        record[rng.choice(FIELDS)] = rng.choice(EDGE_VALUES)
    elif choice == 1:
        for name in rng.sample(FIELDS, rng.randrange(1, 4)):
            record[name] = rng.choice(EDGE_VALUES)
    elif choice == 2:
        record.pop(rng.choice(FIELDS), None)
    elif choice == 3:
        record[rng.choice(["extra", "class_path", b"loss", 7])] = rng.choice(EDGE_VALUES)
    elif choice == 4:
        return rng.choice(EDGE_VALUES)
    elif choice == 5:
        return [record]
    else:
        name = rng.choice(FIELDS[:-1])
        scale = 10.0 ** rng.randrange(1, 308) if isinstance(record[name], float) else 10 ** rng.randrange(1, 30)
        record[name] = -record[name] if rng.random() < 0.5 else record[name] * scale
    return record


def byte_mutation(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    choice = rng.randrange(5)
    if choice == 0:
        return bytes(data[: rng.randrange(len(data))])
    if choice == 1:
        return bytes(data) + rng.randbytes(rng.randrange(1, 64))
    if choice == 2:
        for _ in range(rng.randrange(1, 9)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if choice == 3:
        at = rng.randrange(len(data))
        return bytes(data[:at] + rng.randbytes(rng.randrange(1, 16)) + data[at:])
    return rng.randbytes(rng.randrange(0, 256))


def check_record(record) -> None:
    from lightning_swarm.monitor.records import BOUNDS, FLOAT_FIELDS, INT_FIELDS

    for name in INT_FIELDS + FLOAT_FIELDS:
        value = getattr(record, name)
        assert type(value) is (int if name in INT_FIELDS else float), (name, value)
        assert math.isfinite(value) and BOUNDS[name][0] <= value <= BOUNDS[name][1], (name, value)


def run(seed: int, count: int) -> dict:
    from hivemind.utils.serializer import MSGPackSerializer

    from lightning_swarm.monitor.aggregate import aggregate
    from lightning_swarm.monitor.dashboard import DashboardState
    from lightning_swarm.monitor.records import MalformedRecord, decode_metrics_record

    rng = random.Random(seed)
    counts = dict(inputs=0, not_msgpack=0, refused=0, accepted=0)
    accepted = {}
    slowest = 0.0
    for index in range(count):
        value = structured_mutation(rng, valid_record(rng)) if index % 2 else valid_record(rng)
        try:
            data = MSGPackSerializer.dumps(value)
        except (OverflowError, TypeError, ValueError):  # msgpack has no such value: no peer can send it
            data = MSGPackSerializer.dumps(valid_record(rng))
        if index % 3 == 0:
            data = byte_mutation(rng, data)
        counts["inputs"] += 1
        start = time.perf_counter()
        try:
            decoded = MSGPackSerializer.loads(data)
        except Exception:  # not msgpack (or not hivemind's): hivemind refuses it before the monitor sees it
            counts["not_msgpack"] += 1
            continue
        try:
            record = decode_metrics_record(decoded)
        except MalformedRecord:
            counts["refused"] += 1
            continue
        finally:
            slowest = max(slowest, time.perf_counter() - start)
        check_record(record)
        counts["accepted"] += 1
        accepted[f"peer{index}".encode()] = record
    snapshot = aggregate(accepted) if accepted else None
    if snapshot is not None:
        assert math.isfinite(snapshot.loss) and math.isfinite(snapshot.samples_per_second), snapshot
        state = DashboardState("fuzz")
        state.record(snapshot, [])
        json.dumps(state.to_json(), allow_nan=False)
    counts["slowest_decode_ms"] = round(slowest * 1000, 3)
    return counts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the mutations' random seed")
    parser.add_argument("--count", type=int, default=3000, help="mutated inputs to decode")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.seed, args.count)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
