"""One averaging peer for tests: joins a DHT on 127.0.0.1, runs one compressed all-reduce round, saves the result.

Usage (the first peer prints ``PEER <multiaddr>`` for the others to join):

    python tests/lightning_swarm/averaging_worker.py --seed 0 --out a.safetensors
    python tests/lightning_swarm/averaging_worker.py --seed 1 --out b.safetensors --initial-peer /ip4/...

After printing ``DONE`` a peer stays online until its stdin is closed.

The peer averages two tensors made from its seed: ``large`` (2**17 values, sent as 8-bit codes by
:func:`lightning_swarm.compression.default_compression`) and ``small`` (1000 values, sent as float16).
"""

import argparse
import sys

import torch
from safetensors.torch import save_file

LARGE_NUMEL, SMALL_NUMEL = 2**17, 1000


def make_tensors(seed: int) -> dict[str, torch.Tensor]:
    """The tensors a peer with this seed contributes to the average."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "large": torch.randn(LARGE_NUMEL, generator=generator),
        "small": torch.randn(SMALL_NUMEL, generator=generator),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, required=True, help="seed of this peer's tensors")
    parser.add_argument("--out", required=True, help="safetensors file for the averaged tensors")
    parser.add_argument("--initial-peer", default=None, help="multiaddr of a peer to join (none: start a DHT; '-': "
                        "the first line of stdin, read after the imports, which then overlap that peer's start)")
    parser.add_argument("--prefix", default="lightning_swarm_test", help="averaging group key prefix")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to find a group")
    args = parser.parse_args()
    torch.set_num_threads(1)  # two peers share a small machine; bitsandbytes' OpenMP kernels wait on busy cores

    from lightning_swarm.hivemind_ext.lifetime import SwarmDHT  # hivemind.DHT whose death is noticed
    from hivemind.averaging import DecentralizedAverager

    from lightning_swarm.compression import default_compression

    if args.initial_peer == "-":
        args.initial_peer = sys.stdin.readline().strip()
    dht = SwarmDHT(
        start=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        initial_peers=[args.initial_peer] if args.initial_peer else [],
    )
    print("PEER", str(dht.get_visible_maddrs()[0]), flush=True)

    names = sorted(make_tensors(args.seed))
    tensors = make_tensors(args.seed)
    averager = DecentralizedAverager(
        [tensors[name] for name in names],
        dht,
        start=True,
        prefix=args.prefix,
        target_group_size=2,
        min_group_size=2,
        min_matchmaking_time=2.0,
        request_timeout=2.0,
        compression=default_compression(),
    )
    try:
        group = averager.step(timeout=args.timeout)
        if group is None or len(group) != 2:
            print(f"FAILED: averaging group {group}", flush=True)
            sys.exit(1)
        with averager.get_tensors() as averaged:
            save_file({name: tensor.clone() for name, tensor in zip(names, averaged)}, args.out)
        print("DONE", flush=True)
        # stay online until told to leave (stdin closed): this peer may still be streaming averaged parts to
        # its groupmate, and shutting down now would reset that stream and leave the groupmate unaveraged
        sys.stdin.read()
    finally:
        averager.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    main()
