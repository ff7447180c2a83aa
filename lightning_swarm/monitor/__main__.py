"""``python -m lightning_swarm.monitor --config CONFIG.yaml``: the swarm's auxiliary peer.

Runs on a cheap machine without a GPU and computes no gradients. It is the swarm's stable initial peer (fixed
identity and listen address), logs the swarm's loss, alive peers and throughput from the metrics every
trainer publishes, writes a per-peer contribution table, and every N global epochs downloads the state from
the trainers and saves/uploads it as a checkpoint. With ``--dashboard-port`` it serves a live dashboard (with
``--sample-prompt``, it shows samples drawn from each new checkpoint too).

Examples::

    # start the swarm's bootstrap peer + monitor; trainers pass the printed address as initial_peers
    python -m lightning_swarm.monitor --config configs/dalle_tiny.yaml --host-maddrs /ip4/0.0.0.0/tcp/31337 \\
        --identity-path monitor.id --save-every-epochs 10 --upload-to hf://me/dalle-swarm \\
        --dashboard-port 8080 --sample-prompt "a small blue triangle" --sample-args "--clip-model checkpoints/clip_tiny"

    # moderators: revert the run to a checkpoint (running trainers reload it, later joiners load it);
    # restart the monitor with the same identity/address and, to find the running trainers at once,
    # the address of one of them
    python -m lightning_swarm.monitor --config configs/dalle_tiny.yaml --identity-path monitor.id \\
        --host-maddrs /ip4/0.0.0.0/tcp/31337 --initial-peers /ip4/.../p2p/<a trainer> --revert-to hf://me/dalle-swarm
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, List, Optional

from lightning_swarm.cli_flags import KebabCaseArgumentParser
from lightning_swarm.monitor.config import build_strategy, strategy_section
from lightning_swarm.peers import split_peer_list
from lightning_swarm.recipe_config import build_model, load_yaml

if TYPE_CHECKING:
    from lightning_swarm.auth.peer import SwarmAuth
    from lightning_swarm.checkpoint.saver import CheckpointSaver

logger = logging.getLogger("lightning_swarm.monitor")


def make_parser() -> argparse.ArgumentParser:
    p = KebabCaseArgumentParser(
        prog="python -m lightning_swarm.monitor",
        description="Auxiliary peer: stable bootstrap address, swarm metrics, periodic checkpoints.",
    )
    p.add_argument("--config", required=True, help="the trainers' LightningCLI YAML (model + trainer.strategy)")
    p.add_argument("--model-class", default=None,
                   help="LightningModule class when the YAML's model section has no class_path")
    p.add_argument("--run-id", default=None, help="run id (default: trainer.strategy.init_args.run_id)")
    p.add_argument("--target-batch-size", type=int, default=None, help="default: from the config's strategy")
    p.add_argument("--initial-peers", nargs="*", default=None,
                   help="peers to join (default: none, the monitor starts the swarm)")
    p.add_argument("--host-maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/31337"],
                   help="listen addresses; a fixed port makes the bootstrap address stable")
    p.add_argument("--announce-maddrs", nargs="*", default=None, help="public addresses to announce")
    p.add_argument("--identity-path", default="monitor.id",
                   help="private key file fixing the peer id (created if missing)")
    p.add_argument("--log-dir", default="monitor_logs", help="metrics, contribution table, snapshots")
    p.add_argument("--loggers", default="auto",
                   help="comma-separated: csv, tensorboard, wandb; auto = csv + tensorboard if installed "
                        "+ wandb if --wandb-project is given")
    p.add_argument("--wandb-project", default=None, help="W&B project to log to")
    p.add_argument("--refresh-period", type=float, default=30.0, help="seconds between two metrics reads")
    p.add_argument("--save-every-epochs", type=int, default=10, help="global epochs between checkpoints")
    p.add_argument("--checkpoint-dir", default="monitor_checkpoints", help="local checkpoint directory")
    p.add_argument("--keep-last", type=int, default=3, help="local checkpoints to keep")
    p.add_argument("--upload-to", default=None, help="hf://owner/name or any fsspec URL (s3://, a path...)")
    p.add_argument("--upload-backoff-seconds", type=float, default=30.0, help="first retry delay of an upload")
    p.add_argument("--no-checkpoints", action="store_true", help="only log metrics")
    p.add_argument("--revert-to", default=None, help="checkpoint URL to revert the swarm to at start")
    p.add_argument("--revert-discovery-seconds", type=float, default=30.0,
                   help="before reverting, wait up to this long for the running trainers' metrics to learn the "
                        "swarm's epoch (pass --initial-peers of a live trainer to find them at once)")
    p.add_argument("--revert-epoch-margin", type=int, default=5,
                   help="announce the reverted state this many epochs past the swarm's newest epoch, so that "
                        "running trainers (which reload when 2+ epochs behind) all reload it")
    p.add_argument("--revert-window", type=float, default=300.0,
                   help="seconds to keep announcing the reverted epoch")
    p.add_argument("--authority-key", dest="authority_key", default=None,
                   help="in a run with an authority (auth.authority_key in the config): its private key, held by "
                        "the moderators. The monitor issues its own token with it and signs reverts, which trainers "
                        "verify; without it, it needs a token like any peer and cannot revert")
    p.add_argument("--load-state-timeout", type=float, default=None, help="default: from the config or 600")
    p.add_argument("--max-runtime", type=float, default=None, help="stop after this many seconds")
    dash = p.add_argument_group("dashboard", "a live page with the swarm's figures, served by this process")
    dash.add_argument("--dashboard-port", dest="dashboard_port", type=int, default=None,
                      help="serve the dashboard on this port (0: any free port; default: no dashboard)")
    dash.add_argument("--dashboard-host", dest="dashboard_host", default="127.0.0.1",
                      help="address the dashboard listens on (default: this machine only; 0.0.0.0: every "
                           "interface, anyone who can reach the port sees the page)")
    dash.add_argument("--dashboard-poll-seconds", dest="dashboard_poll_seconds",
                      type=float, default=3.0, help="how often the page fetches new figures")
    dash.add_argument("--sample-prompt", dest="sample_prompts", action="append", default=None,
                      help="a caption to draw from every new checkpoint (repeat for several); shown on the dashboard")
    dash.add_argument("--sample-module", dest="sample_module", default="inference.generate",
                      help="module run as `python -m MODULE --checkpoint DIR --prompt P ... --out DIR [args]`, "
                           "writing DIR/results.json and PNG grids")
    dash.add_argument("--sample-args", dest="sample_args", default="",
                      help="more arguments for the sampling module, e.g. "
                           "\"--clip-model checkpoints/clip_tiny --num-candidates 32 --keep 4\"")
    return p


def without_own_address(initial_peers: List[str], identity_path: Optional[str]) -> List[str]:
    """Drop the monitor's own address: the trainers' config usually lists it as their initial peer."""
    if not identity_path or not os.path.isfile(identity_path):
        return list(initial_peers)
    from hivemind.p2p import PeerID

    with open(identity_path, "rb") as f:
        own_id = PeerID.from_identity(f.read()).to_base58()
    return [address for address in initial_peers if not address.rstrip("/").endswith(f"/p2p/{own_id}")]


def make_saver(args: argparse.Namespace, auth: Optional["SwarmAuth"]) -> "CheckpointSaver":
    """The monitor's checkpoint saver from its options. With the authority's key (``--authority-key``: the
    moderators' monitor, ``auth.issuer``) every checkpoint is signed, so readers given the run's authority public key
    load only those; a monitor of a run with an authority but without that key saves them unsigned (logged)."""
    from lightning_swarm.checkpoint.saver import CheckpointSaver

    signer = auth.issuer if auth is not None else None
    if auth is not None and signer is None:
        logger.warning("checkpoints are saved unsigned: only a monitor started with --authority-key signs them")
    return CheckpointSaver(
        args.checkpoint_dir,
        keep_last=args.keep_last,
        upload_to=args.upload_to,
        upload_max_attempts=None,  # the monitor lives long: keep retrying until a newer checkpoint arrives
        upload_backoff_seconds=args.upload_backoff_seconds,
        signer=signer,
    )


def main(argv: Optional[List[str]] = None) -> None:
    args = make_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_yaml(args.config)
    # the trainers usually list the monitor itself as their initial peer: drop our own address
    initial_peers = split_peer_list(args.initial_peers if args.initial_peers is not None
                                    else strategy_section(config)["init_args"].get("initial_peers"))
    if args.identity_path:
        os.makedirs(os.path.dirname(os.path.abspath(args.identity_path)), exist_ok=True)
    strategy = build_strategy(
        config,
        run_id=args.run_id,
        target_batch_size=args.target_batch_size,
        initial_peers=without_own_address(initial_peers or [], args.identity_path),
        host_maddrs=args.host_maddrs,
        announce_maddrs=args.announce_maddrs,
        identity_path=args.identity_path,
        load_state_timeout=args.load_state_timeout,
        client_mode=False,  # the monitor is the swarm's reachable bootstrap peer
        publish_metrics=True,
        log_progress=False,
    )
    module = build_model(config, args.model_class)
    run_id = strategy.run_id

    if args.authority_key:  # the moderators' peer: it issues its own token and signs reverts
        from lightning_swarm.auth.peer import SwarmAuth

        strategy.swarm_auth = SwarmAuth.for_moderator(run_id, args.authority_key)

    # heavy imports after the arguments are known to be fine
    from lightning_swarm.monitor.peer import MonitorPeer
    from lightning_swarm.monitor.runner import Monitor, build_loggers

    peer = MonitorPeer(module, strategy)  # prints the swarm's join message (lightning_swarm.peers)
    print("".join(f"MONITOR_ADDRESS {address}\n" for address in peer.addresses), end="", flush=True)
    saver = None if args.no_checkpoints else make_saver(args, strategy.swarm_auth)
    loggers = build_loggers([n.strip() for n in args.loggers.split(",") if n.strip()], args.log_dir, run_id,
                            args.wandb_project)
    dashboard = server = sampler = None
    if args.dashboard_port is not None:
        from lightning_swarm.monitor.dashboard import DashboardServer, DashboardState

        dashboard = DashboardState(run_id)
        dashboard.load_history(os.path.join(args.log_dir, "snapshots.jsonl"))  # after a restart: the charts go on
        server = DashboardServer(dashboard, args.dashboard_host, args.dashboard_port,
                                 args.dashboard_poll_seconds).start()
        print(f"DASHBOARD {server.url}", flush=True)
    if args.sample_prompts:
        if saver is None:
            raise ValueError("--sample-prompt draws from the monitor's checkpoints: remove --no-checkpoints")
        from lightning_swarm.monitor.samples import SampleRunner

        sampler = SampleRunner(args.sample_prompts, os.path.join(args.log_dir, "samples"),
                               on_samples=dashboard.set_samples if dashboard else lambda samples: None,
                               module=args.sample_module, extra_args=args.sample_args, in_use=saver.in_use)
    monitor = Monitor(
        peer,
        loggers,
        log_dir=args.log_dir,
        saver=saver,
        save_every_epochs=args.save_every_epochs,
        refresh_period=args.refresh_period,
        revert_window=args.revert_window,
        dashboard=dashboard,
        sampler=sampler,
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
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
