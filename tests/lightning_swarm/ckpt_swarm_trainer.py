"""A trainer peer for the monitor test: TinyRegressor under HivemindStrategy on 127.0.0.1.

Writes into --out_dir:
  published.jsonl   every metrics record this peer publishes to the DHT (what the monitor should see)
  start.json        the global epoch before the first step; start.safetensors: the weights then
  progress.json     the latest global epoch, rewritten as training goes
With --ckpt_dir it also checkpoints every global epoch with SwarmCheckpoint.
Starts once --peers_file exists; stops when --stop_file exists or after --max_steps.
"""

import argparse
import json
import os
import time

import lightning.pytorch as pl
import torch
from safetensors.torch import save_model

from ckpt_tiny_module import RandomRegressionData, TinyRegressor
from lightning_swarm import metrics as swarm_metrics
from lightning_swarm.checkpoint.callback import SwarmCheckpoint
from lightning_swarm.strategy import HivemindStrategy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--run_id", required=True)
    parser.add_argument("--peers_file", required=True, help="wait for this file, then join the peers it lists")
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--stop_file", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_steps", type=int, default=100000)
    parser.add_argument("--step_delay", type=float, default=0.05)
    parser.add_argument("--ckpt_dir", default=None, help="also run SwarmCheckpoint (every global epoch) here")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    torch.set_num_threads(1)
    while not os.path.exists(args.peers_file):  # imports are done: wait until the monitor is up
        time.sleep(0.1)
    initial_peers = open(args.peers_file).read().split()

    real_publish = swarm_metrics.publish_metrics

    def publish_and_record(dht, run_id, metrics, **kwargs):
        with open(os.path.join(args.out_dir, "published.jsonl"), "a") as f:
            f.write(json.dumps(metrics.dict()) + "\n")
        return real_publish(dht, run_id, metrics, **kwargs)

    swarm_metrics.publish_metrics = publish_and_record

    def write_json(name, obj):
        tmp = os.path.join(args.out_dir, f".{name}.tmp")
        with open(tmp, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, os.path.join(args.out_dir, name))

    class Recorder(pl.Callback):
        recorded_start = False

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            # the first batch comes after the strategy joined the swarm (and maybe loaded its state)
            if not self.recorded_start:
                self.recorded_start = True
                save_model(pl_module, os.path.join(args.out_dir, "start.safetensors"))
                write_json("start.json", dict(global_epoch=trainer.strategy.global_epoch))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            write_json("progress.json", dict(global_epoch=trainer.strategy.global_epoch, step=trainer.global_step))
            if os.path.exists(args.stop_file):
                trainer.should_stop = True
            time.sleep(args.step_delay)  # leave CPU to the other processes on a 2-core machine

    strategy = HivemindStrategy(
        run_id=args.run_id,
        target_batch_size=16,
        initial_peers=initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        matchmaking_time=1.0,
        averaging_timeout=5.0,
        load_state_timeout=20.0,
        compression="none",
        metrics_interval=0.5,
        log_progress=False,
        tracker_opts=dict(min_refresh_period=0.1, max_refresh_period=0.5, default_refresh_period=0.2),
    )
    torch.manual_seed(args.seed)
    trainer = pl.Trainer(
        strategy=strategy,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Recorder()] + ([SwarmCheckpoint(args.ckpt_dir, every_n_epochs=1, keep_last=2)] if args.ckpt_dir else []),
    )
    trainer.fit(TinyRegressor(), RandomRegressionData(batch_size=4, seed=args.seed))


if __name__ == "__main__":
    main()
