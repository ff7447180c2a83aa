"""A donor for tests/lightning_swarm/test_state_serving.py: an averager with the auth and serving guards whose host
process holds each state request while the file ``--hold`` exists (a slow donor: downloads stay open).

    python state_serving_worker.py --run R --authority authority.pem.pub --token donor.token --key donor.pem \
        --hold HOLD_FILE --max-state-downloads 2 [--debug-serving]

Prints ``DONOR <multiaddr> <peer id base58>`` once it serves, and runs until killed.
"""

import argparse
import logging
import os
import sys
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--run", "--authority", "--token", "--key", "--hold"):
        parser.add_argument(name, required=True)
    parser.add_argument("--max-state-downloads", type=int, required=True)
    parser.add_argument("--debug-serving", action="store_true", help="log state_serving at DEBUG (how streams end)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
    if args.debug_serving:
        logging.getLogger("lightning_swarm.hivemind_ext.state_serving").setLevel(logging.DEBUG)

    from lightning_swarm.hivemind_ext.lifetime import SwarmDHT  # hivemind.DHT whose death is noticed
    from hivemind.averaging import DecentralizedAverager

    from lightning_swarm.auth.peer import SwarmAuth
    from lightning_swarm.hivemind_ext.auth_guards import AuthenticatedAveraging
    from lightning_swarm.hivemind_ext.optimizer import HivemindRpcNames
    from lightning_swarm.hivemind_ext.state_serving import GuardedStateServing

    class SlowDonor(HivemindRpcNames, AuthenticatedAveraging, GuardedStateServing, DecentralizedAverager):
        def get_current_state(self):  # the host process: hold the request while the test wants it open
            deadline = time.monotonic() + 120
            while os.path.exists(args.hold) and time.monotonic() < deadline:
                time.sleep(0.05)
            return super().get_current_state()

    auth = SwarmAuth(args.run, args.authority, token=args.token, key=args.key)
    dht = SwarmDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = SlowDonor([torch.arange(1000, dtype=torch.float32)], dht, prefix="serving_test", target_group_size=2,
                         swarm_auth=auth, max_state_downloads=args.max_state_downloads, start=True)
    print("DONOR", dht.get_visible_maddrs()[0], dht.peer_id.to_base58(), flush=True)
    try:
        while True:
            time.sleep(1)
    finally:
        averager.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
