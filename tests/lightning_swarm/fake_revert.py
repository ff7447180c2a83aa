"""An allowlisted peer (valid token) that fakes a moderator's revert, for tests.

It does everything the monitor does to revert a run (serves a checkpoint's weights at an epoch far past the
swarm's, with the highest state-sharing priority, and announces that epoch), and signs its "revert order" with
its own key instead of the authority's. Prints ``FAKE_REVERT <epoch>`` and keeps announcing until killed.

    python fake_revert.py --run R --authority authority.pem.pub --token bob.token --key bob.pem \
        --initial-peer ADDR --checkpoint poison_ckpt/
"""

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--run", "--authority", "--token", "--key", "--initial-peer", "--checkpoint"):
        parser.add_argument(name, required=True)
    parser.add_argument("--epoch-margin", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from ckpt_tiny_module import TinyRegressor
    from lightning_swarm.auth.tokens import load_private_key
    from lightning_swarm.monitor.peer import MonitorPeer
    from lightning_swarm.strategy import HivemindStrategy

    strategy = HivemindStrategy(run_id=args.run, target_batch_size=16, initial_peers=[args.initial_peer],
                                host_maddrs=["/ip4/127.0.0.1/tcp/0"], load_state_timeout=20, log_progress=False,
                                auth=dict(authority_key=args.authority, token=args.token, key=args.key))
    peer = MonitorPeer(TinyRegressor(), strategy)
    peer.auth.issuer = load_private_key(args.key)  # its own key: the order it signs is a forgery
    try:
        epoch = peer.revert_to(args.checkpoint, discovery_seconds=10, epoch_margin=args.epoch_margin)
        print("FAKE_REVERT", epoch, flush=True)
        while True:
            time.sleep(0.5)
            peer.announce_revert()
    finally:
        peer.shutdown()


if __name__ == "__main__":
    main()
