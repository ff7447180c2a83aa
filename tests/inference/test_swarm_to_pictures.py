"""From the swarm to pictures, end to end (slow): two real DALL-E trainers (the recipe's command line) and the
monitor with its dashboard on 127.0.0.1. Headless Chromium (Debian's chromium + chromium-driver) shows 2 peers
and a loss; the monitor uploads checkpoints to a local fsspec directory, draws CLIP-reranked samples from them
for the page, and inference.generate samples a PNG grid from the upload's URL."""

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml
from PIL import Image

from lightning_swarm.checkpoint.checkpoint_io import read_checkpoint
from join_later import write_initial_peers
from processes import Proc, free_port, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
JOIN_LATER = os.path.join(REPO, "tests", "join_later.py")
PROMPTS = ["a big red circle", "a blue cross above a green square"]


def tiny_swarm_config(run_id: str) -> dict:
    """configs/dalle_tiny.yaml with a tiny model, fast swarm timings on 127.0.0.1 and no validation."""
    with open(os.path.join(REPO, "configs", "dalle_tiny.yaml")) as f:
        config = yaml.safe_load(f)
    model = config["model"]["init_args"]
    model["config"].update(dim=32, depth=2, heads=2, dim_head=8, attn_types=["axial_row", "axial_col"])
    model.update(warmup_steps=2, decay_steps=200)
    trainer = config["trainer"]
    trainer.update(max_steps=100000, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                   callbacks=[{"class_path": "slow_steps.SlowSteps", "init_args": {"seconds": 0.1}}])
    trainer["strategy"]["init_args"] = dict(
        run_id=run_id, target_batch_size=8, matchmaking_time=1.0, averaging_timeout=5.0, load_state_timeout=30.0,
        compression="none", metrics_interval=0.5, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        tracker_opts=dict(min_refresh_period=0.1, max_refresh_period=0.5, default_refresh_period=0.2))
    config["data"]["init_args"].update(batch_size=4, max_val_batches=1, num_shapes_train=64, num_shapes_val=16,
                                       shuffle_buffer=16)
    return config


def start_browser(profile_dir):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", f"--user-data-dir={profile_dir}",
                 "--window-size=1280,1500"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_swarm_monitor_dashboard_and_sampling_from_the_uploaded_url(tmp_path, tiny_clip_dir):
    assert os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER), \
        "install Debian's chromium and chromium-driver (.ci/run does)"
    run_id = "pictures_test"
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(tiny_swarm_config(run_id)))
    remote_url = f"file://{tmp_path / 'remote'}"  # a local fsspec directory as the upload target
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")]))
    sample_args = f"--clip-model {tiny_clip_dir} --num-candidates 4 --keep 4 --batch-size 4 --top-k 0"
    monitor = Proc([sys.executable, "-m", "lightning_swarm.monitor", "--config", "cfg.yaml",
                    "--host-maddrs", f"/ip4/127.0.0.1/tcp/{free_port()}", "--identity-path", "monitor.id",
                    "--refresh-period", "0.5", "--save-every-epochs", "10", "--upload-to", remote_url,
                    "--upload-backoff-seconds", "0.5", "--max-runtime", "800",
                    "--dashboard-port", "0", "--dashboard-host", "127.0.0.1", "--dashboard-poll-seconds", "0.5",
                    *[arg for prompt in PROMPTS for arg in ("--sample-prompt", prompt)], "--sample-args", sample_args],
                   str(tmp_path / "monitor.log"), env, str(tmp_path))
    procs, browser = [monitor], None
    try:
        # the trainers' processes start with the monitor and import while it starts (tests/join_later.py); each
        # runs `python -m recipes.dalle fit ... --trainer.strategy.init_args.initial_peers '[<the monitor>]'` once
        # the monitor printed its address
        for name, seed in (("a", 1), ("b", 2)):
            procs.append(Proc([sys.executable, JOIN_LATER, str(tmp_path / "monitor_address.json"),
                               "-m", "recipes.dalle", "fit", "--config", "cfg.yaml",
                               "--trainer.default_root_dir", f"run_{name}", "--data.init_args.seed", str(seed),
                               "--data.init_args.data_dir", f"data_{name}"],
                              str(tmp_path / f"trainer_{name}.log"), env, str(tmp_path)))
        browser = start_browser(str(tmp_path / "chromium-profile"))
        address = monitor.wait_line("MONITOR_ADDRESS", 180).split()[1]
        write_initial_peers(tmp_path / "monitor_address.json", [address])
        url = monitor.wait_line("DASHBOARD", 30).split()[1]
        browser.get(url)
        text = lambda element_id: browser.find_element("id", element_id).text  # noqa: E731

        def two_peers_and_a_loss():
            for proc in procs:
                assert proc.proc.poll() is None, f"a process exited early, see {proc.log.name}"
            try:
                return text("peers-alive") == "2" and np.isfinite(float(text("loss")))
            except ValueError:  # "-" until the first metrics arrive
                return False

        wait_for(two_peers_and_a_loss, 420, "the dashboard to show 2 peers and a loss")
        assert int(text("epoch")) >= 0 and float(text("samples-per-second")) > 0
        assert len(browser.find_elements("css selector", "#leaderboard tr")) == 2
        assert browser.execute_script("return document.querySelectorAll('#loss-chart .scatterlayer .trace').length") == 1

        # the monitor saved and uploaded a checkpoint and drew the prompts from it: the page shows the grids
        def sample_grids_loaded():
            return browser.execute_script(
                "const images = document.querySelectorAll('#samples img');"
                "return images.length == arguments[0] && Array.from(images).every(i => i.complete && i.naturalWidth > 0);",
                len(PROMPTS))

        wait_for(sample_grids_loaded, 300, "the dashboard to show the sample grids")
        assert "CLIP-reranked" in text("samples-info")
        time.sleep(1.0)  # one more poll, so that the charts hold a few points
        browser.save_screenshot(str(tmp_path / "dashboard.png"))
        if os.environ.get("DASHBOARD_SCREENSHOT"):  # docs/dashboard.png is made this way
            shutil.copy(tmp_path / "dashboard.png", os.environ["DASHBOARD_SCREENSHOT"])
        assert Image.open(tmp_path / "dashboard.png").size[0] >= 1000
    finally:
        if browser is not None:
            browser.quit()
        for proc in reversed(procs):  # trainers first (Lightning may take a while to act on SIGTERM)
            proc.stop(timeout=15)

    # the uploaded checkpoint names its model; inference.generate samples a grid from the upload's URL
    uploaded = read_checkpoint(remote_url, training_state=False)
    assert uploaded.meta["run_id"] == run_id and uploaded.meta["saved_by"] == "lightning_swarm.monitor"
    assert uploaded.meta["model"]["class_path"] == "recipes.dalle.module.DALLEModule"
    out = tmp_path / "samples"
    result = subprocess.run([sys.executable, "-m", "inference.generate", "--checkpoint", remote_url,
                             "--prompt", PROMPTS[0], "--out", str(out), *sample_args.split()],
                            env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert [r["prompt"] for r in results] == PROMPTS[:1] and len(results[0]["kept"]) == 4
    grid = np.asarray(Image.open(out / results[0]["grid"]))
    assert grid.shape == (2 * 128 + 3 * 2, 2 * 128 + 3 * 2, 3)  # 4 images of 128 px, 2x2 with 2 px padding
