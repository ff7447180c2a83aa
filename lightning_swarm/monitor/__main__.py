"""``python -m lightning_swarm.monitor --config CONFIG.yaml``: the swarm's auxiliary peer.

Runs on a cheap machine without a GPU and computes no gradients. It is the swarm's stable initial peer (fixed
identity and listen address), logs the swarm's loss, alive peers and throughput from the metrics every
trainer publishes, writes a per-peer contribution table, and every N global epochs downloads the state from
the trainers and saves/uploads it as a checkpoint.

Examples::

    # start the swarm's bootstrap peer + monitor; trainers pass the printed address as initial_peers
    python -m lightning_swarm.monitor --config configs/dalle_tiny.yaml --host_maddrs /ip4/0.0.0.0/tcp/31337 \\
        --identity_path monitor.id --save_every_epochs 10 --upload_to hf://me/dalle-swarm

    # moderators: revert the run to a checkpoint (running trainers reload it, later joiners load it);
    # restart the monitor with the same identity/address and, to find the running trainers at once,
    # the address of one of them
    python -m lightning_swarm.monitor --config configs/dalle_tiny.yaml --identity_path monitor.id \\
        --host_maddrs /ip4/0.0.0.0/tcp/31337 --initial_peers /ip4/.../p2p/<a trainer> --revert_to hf://me/dalle-swarm
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import List, Optional

from lightning_swarm.monitor.config import load_monitor_config

logger = logging.getLogger("lightning_swarm.monitor")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightning_swarm.monitor",
        description="Auxiliary peer: stable bootstrap address, swarm metrics, periodic checkpoints.",
    )
    p.add_argument("--config", required=True, help="the trainers' LightningCLI YAML (model + trainer.strategy)")
    p.add_argument("--model_class", default=None,
                   help="LightningModule class when the YAML's model section has no class_path")
    p.add_argument("--run_id", default=None, help="run id (default: trainer.strategy.init_args.run_id)")
    p.add_argument("--target_batch_size", type=int, default=None, help="default: from the config's strategy")
    p.add_argument("--initial_peers", nargs="*", default=None,
                   help="peers to join (default: none, the monitor starts the swarm)")
    p.add_argument("--host_maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/31337"],
                   help="listen addresses; a fixed port makes the bootstrap address stable")
    p.add_argument("--announce_maddrs", nargs="*", default=None, help="public addresses to announce")
    p.add_argument("--identity_path", default="monitor.id",
                   help="private key file fixing the peer id (created if missing)")
    p.add_argument("--log_dir", default="monitor_logs", help="metrics, contribution table, snapshots")
    p.add_argument("--loggers", default="auto",
                   help="comma-separated: csv, tensorboard, wandb; auto = csv + tensorboard if installed "
                        "+ wandb if --wandb_project is given")
    p.add_argument("--wandb_project", default=None, help="W&B project to log to")
    p.add_argument("--refresh_period", type=float, default=30.0, help="seconds between two metrics reads")
    p.add_argument("--save_every_epochs", type=int, default=10, help="global epochs between checkpoints")
    p.add_argument("--checkpoint_dir", default="monitor_checkpoints", help="local checkpoint directory")
    p.add_argument("--keep_last", type=int, default=3, help="local checkpoints to keep")
    p.add_argument("--upload_to", default=None, help="hf://owner/name or any fsspec URL (s3://, a path...)")
    p.add_argument("--upload_backoff_seconds", type=float, default=30.0, help="first retry delay of an upload")
    p.add_argument("--no_checkpoints", action="store_true", help="only log metrics")
    p.add_argument("--revert_to", default=None, help="checkpoint URL to revert the swarm to at start")
    p.add_argument("--revert_discovery_seconds", type=float, default=30.0,
                   help="before reverting, wait up to this long for the running trainers' metrics to learn the "
                        "swarm's epoch (pass --initial_peers of a live trainer to find them at once)")
    p.add_argument("--revert_epoch_margin", type=int, default=5,
                   help="announce the reverted state this many epochs past the swarm's newest epoch, so that "
                        "running trainers (which reload when 2+ epochs behind) all reload it")
    p.add_argument("--revert_window", type=float, default=300.0,
                   help="seconds to keep announcing the reverted epoch")
    p.add_argument("--load_state_timeout", type=float, default=None, help="default: from the config or 600")
    p.add_argument("--max_runtime", type=float, default=None, help="stop after this many seconds")
    return p


def without_own_address(initial_peers: List[str], identity_path: Optional[str]) -> List[str]:
    """Drop the monitor's own address: the trainers' config usually lists it as their initial peer."""
    if not identity_path or not os.path.isfile(identity_path):
        return list(initial_peers)
    from hivemind.p2p import PeerID

    with open(identity_path, "rb") as f:
        own_id = PeerID.from_identity(f.read()).to_base58()
    return [address for address in initial_peers if not address.rstrip("/").endswith(f"/p2p/{own_id}")]


def main(argv: Optional[List[str]] = None) -> None:
    args = make_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    module, swarm = load_monitor_config(args.config, args.model_class)
    run_id = args.run_id or swarm.get("run_id")
    target_batch_size = args.target_batch_size or swarm.get("target_batch_size")
    if not run_id or not target_batch_size:
        raise ValueError(
            "The monitor needs the run id and target batch size: put a HivemindStrategy with run_id and "
            "target_batch_size under trainer.strategy in the config, or pass --run_id/--target_batch_size"
        )
    initial_peers = args.initial_peers if args.initial_peers is not None else swarm.get("initial_peers") or []
    if isinstance(initial_peers, str):
        initial_peers = [p for p in initial_peers.replace(",", " ").split() if p]
    initial_peers = without_own_address(initial_peers, args.identity_path)

    # heavy imports after the arguments are known to be fine
    from lightning_swarm.checkpoint.saver import CheckpointSaver
    from lightning_swarm.monitor.peer import MonitorPeer
    from lightning_swarm.monitor.runner import Monitor, build_loggers

    if args.identity_path:
        os.makedirs(os.path.dirname(os.path.abspath(args.identity_path)), exist_ok=True)
    peer = MonitorPeer(
        module,
        run_id=run_id,
        target_batch_size=int(target_batch_size),
        initial_peers=initial_peers,
        host_maddrs=args.host_maddrs,
        announce_maddrs=args.announce_maddrs,
        identity_path=args.identity_path,
        load_state_timeout=args.load_state_timeout or swarm.get("load_state_timeout", 600.0),
        averager_opts=swarm.get("averager_opts"),
        tracker_opts=swarm.get("tracker_opts"),
    )
    addresses = peer.addresses
    print(
        f"[lightning_swarm.monitor] run {run_id!r}: monitor peer is up. Trainers join with\n"
        f"    --trainer.strategy.init_args.initial_peers='{json.dumps(addresses)}'\n"
        + "".join(f"MONITOR_ADDRESS {address}\n" for address in addresses),
        flush=True,
    )
    saver = None
    if not args.no_checkpoints:
        saver = CheckpointSaver(
            args.checkpoint_dir,
            keep_last=args.keep_last,
            upload_to=args.upload_to,
            upload_max_attempts=None,  # the monitor lives long: keep retrying until a newer checkpoint arrives
            upload_backoff_seconds=args.upload_backoff_seconds,
        )
    loggers = build_loggers([n.strip() for n in args.loggers.split(",") if n.strip()], args.log_dir, run_id,
                            args.wandb_project)
    monitor = Monitor(
        peer,
        loggers,
        log_dir=args.log_dir,
        saver=saver,
        save_every_epochs=args.save_every_epochs,
        refresh_period=args.refresh_period,
        revert_window=args.revert_window,
    )
    signal.signal(signal.SIGTERM, lambda *_: monitor.stop_event.set())
    try:
        if args.revert_to:
            epoch = monitor.revert_to(args.revert_to, args.revert_discovery_seconds, args.revert_epoch_margin)
            print(f"[lightning_swarm.monitor] REVERTED to {args.revert_to} as epoch {epoch}", flush=True)
        monitor.run(max_runtime=args.max_runtime)
    except KeyboardInterrupt:
        pass
    finally:
        monitor.shutdown()


if __name__ == "__main__":
    sys.exit(main())
