"""One averaging peer for the group-mixing test: a real DHT on 127.0.0.1 and a DecentralizedAverager with the
strategy's group-key mixins, averaging rounds on command.

Usage: ``python tests/lightning_swarm/mixing_worker.py INDEX NUM_PEERS GROUP_SIZE BITS [INITIAL_PEER]`` (BITS: the
initial group bits, '-' for none). The peer prints ``MADDR <multiaddr>``; then for each line ``round`` on stdin it
runs one averaging round and prints ``ROUND {json}`` (its value, how many peers' contributions reached it, its group
size, 0 if none, and its group key bits before and after). It ends at EOF.

Peer i averages a vector of 4096 values all equal to i and a one-hot vector of NUM_PEERS entries (entry j above 0:
peer j's contribution has reached this peer), without a codec, so both stay exact.
"""

import json
import sys

import torch


def main() -> None:
    index, num_peers, group_size = (int(arg) for arg in sys.argv[1:4])
    bits = "" if sys.argv[4] == "-" else sys.argv[4]
    initial_peer = sys.argv[5] if len(sys.argv) > 5 else None
    torch.set_num_threads(1)

    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression import NoCompression

    from lightning_swarm.hivemind_ext.group_keys import MovingGroupKeys
    from lightning_swarm.hivemind_ext.lifetime import DiesWithParent, SwarmDHT
    from lightning_swarm.hivemind_ext.matchmaking import ThrottledLeaderSearch
    from lightning_swarm.hivemind_ext.round_groups import PatientGroupRegistration

    class MixingAverager(DiesWithParent, PatientGroupRegistration, MovingGroupKeys, ThrottledLeaderSearch,
                         DecentralizedAverager):
        """The strategy's averagers' matchmaking and group keys on a plain DecentralizedAverager."""

    dht = SwarmDHT(initial_peers=[initial_peer] if initial_peer else None, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                   start=True)
    reach = torch.zeros(num_peers)
    reach[index] = 1.0
    averager = MixingAverager([torch.full((4096,), float(index)), reach], dht=dht, prefix="mixing_test",
                              target_group_size=group_size, min_group_size=2, initial_group_bits=bits,
                              min_matchmaking_time=2.0, request_timeout=1.0, next_chunk_timeout=10.0,
                              compression=NoCompression(), start=True)
    print("MADDR", dht.get_visible_maddrs()[0], flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            continue
        before = averager.get_group_bits()
        try:
            group = averager.step(timeout=30.0)  # retried within 30 s if a round fails (hivemind's allow_retries)
        except Exception as e:  # no group: this peer's tensors stay as they were
            print(f"round failed: {e!r}", file=sys.stderr, flush=True)
            group = None
        with averager.get_tensors() as (values, reached):
            result = dict(value=values.mean().item(), reached=int((reached > 0).sum()),
                          group_size=len(group) if group else 0, key_before=before, key_after=averager.get_group_bits())
        print("ROUND", json.dumps(result), flush=True)
    averager.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
