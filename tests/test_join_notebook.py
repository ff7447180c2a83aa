"""notebooks/join.ipynb runs top to bottom in a real kernel (nbclient) on this CPU and joins a local swarm: a monitor
on 127.0.0.1 is the run's bootstrap peer, the notebook joins it from the monitor's address in client mode (its
default), trains a few steps of a small configs/dalle_tiny.yaml, shows the swarm's peers and leaves. The notebook's
peer joined the swarm if it saw its own metrics record come back through the DHT and the monitor counted its samples."""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from hivemind.p2p import P2P, PeerID

from processes import Proc, free_port

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "join.ipynb"
STEPS = 4


def small_recipe(tmp_path: Path, run_id: str) -> Path:
    """configs/dalle_tiny.yaml with a small model and data, fast swarm timings, no validation or callbacks."""
    config = yaml.safe_load((REPO / "configs" / "dalle_tiny.yaml").read_text())
    config["model"]["init_args"]["config"].update(dim=32, depth=2, heads=2, dim_head=8,
                                                  attn_types=["axial_row", "axial_col"])
    config["model"]["init_args"]["text_vocabulary"] = "shapes"
    config["data"]["init_args"].update(batch_size=4, num_shapes_train=64, num_shapes_val=16, shuffle_buffer=16,
                                       data_dir=str(tmp_path / "data"))
    trainer = config["trainer"]
    trainer.update(default_root_dir=str(tmp_path / "run"), callbacks=[], logger=False, limit_val_batches=0,
                   num_sanity_val_steps=0, enable_checkpointing=False)
    trainer["strategy"]["init_args"].update(
        run_id=run_id, target_batch_size=8, matchmaking_time=1.0, averaging_timeout=5.0, metrics_interval=0.5,
        compression="none", tracker_opts={"min_refresh_period": 0.1, "max_refresh_period": 0.5,
                                          "default_refresh_period": 0.2})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def stream_text(notebook) -> str:
    """Everything the notebook's code cells printed so far."""
    return "\n".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                     for output in list(cell.get("outputs", [])) if output.get("output_type") == "stream")


def interrupt_when(client, notebook, line: str, timeout: float) -> threading.Thread:
    """A thread that interrupts the kernel (SIGINT, as Jupyter's interrupt button) once the notebook printed ``line``."""

    def watch():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            provisioner = getattr(getattr(client, "km", None), "provisioner", None)
            if provisioner is not None and provisioner.process is not None and line in stream_text(notebook):
                os.kill(provisioner.process.pid, signal.SIGINT)
                return
            time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow  # a monitor and a kernel training a peer, ~1 min each
@pytest.mark.parametrize("stop", ["max_steps", "interrupt"])
def test_join_notebook_runs_top_to_bottom_and_its_peer_joins_the_swarm(tmp_path, monkeypatch, stop):
    """stop: the notebook's peer stops at MAX_STEPS, or trains until its cell is interrupted (Jupyter's button)."""
    run_id = f"join_notebook_{os.getpid()}_{stop}"
    recipe = small_recipe(tmp_path, run_id)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]), OMP_NUM_THREADS="1")
    # the monitor's identity and port are chosen here, so that its address is known before it starts: the kernel
    # starts with it and runs the cells before the join meanwhile (the join cell waits for the monitor)
    P2P.generate_identity(str(tmp_path / "monitor.id"))
    port = free_port()
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/{PeerID.from_identity((tmp_path / 'monitor.id').read_bytes())}"
    monitor = Proc([sys.executable, "-m", "lightning_swarm.monitor", "--config", str(recipe),
                    "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--identity-path", "monitor.id",
                    "--no-checkpoints", "--log-dir", "logs", "--loggers", "csv", "--refresh-period", "0.5",
                    "--max-runtime", "500"], str(tmp_path / "monitor.log"), env, cwd=str(tmp_path))

    def wait_for_the_monitor_before_the_join(cell, cell_index, **kwargs):
        if cell_index == join_cell:  # a volunteer pastes the address once the run's monitor printed it
            assert monitor.wait_line("MONITOR_ADDRESS", 150).split()[1] == address

    try:
        for name, value in {"JOIN_REPO_DIR": str(REPO), "JOIN_CONFIG": str(recipe), "JOIN_INITIAL_PEERS": address,
                            "JOIN_MAX_STEPS": str(STEPS) if stop == "max_steps" else "0", "JOIN_PRINT_EVERY": "1",
                            "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}.items():
            monkeypatch.setenv(name, value)  # the kernel inherits this process's environment
        notebook = nbformat.read(NOTEBOOK, as_version=4)
        join_cell = next(index for index, cell in enumerate(notebook.cells)
                         if cell.cell_type == "code" and "split_peer_list(INITIAL_PEERS)" in cell.source)
        client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                         resources={"metadata": {"path": str(tmp_path)}},
                                         on_cell_start=wait_for_the_monitor_before_the_join)
        if stop == "interrupt":
            interrupt_when(client, notebook, f"step {STEPS}:", timeout=400)
        try:
            client.execute()
        finally:  # what a volunteer would see, kept for a failure (a cell's timeout too: its output so far)
            nbformat.write(notebook, tmp_path / "join.executed.ipynb")
        text = stream_text(notebook)
        print(text)
        summary = json.loads(text.split("SUMMARY ", 1)[1].splitlines()[0])
        assert summary["run_id"] == run_id and summary["client_mode"] is True
        if stop == "max_steps":
            assert summary["local_steps"] == STEPS and "stopped by interrupt" not in text
        else:  # the cell was interrupted after step STEPS (before the recipe's own 1500)
            assert STEPS <= summary["local_steps"] < 1500 and "stopped by interrupt" in text
        assert summary["swarm_epoch"] >= 1  # global steps: 8 samples each, 4 a local step
        assert summary["children_left"] == 0  # the DHT process and the averagers stopped
        # its own signed metrics record came back from the swarm's DHT, with the samples it trained
        (own,) = [row for row in summary["peers_seen"] if row["peer"] == "this notebook"]
        assert own["samples"] > 0
        assert "precision auto -> " in text and "it fits" in text and f"run {run_id!r}: joining" in text
        # the monitor, the swarm's bootstrap peer, counted the notebook peer's samples
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            rows = read_json(tmp_path / "logs" / "contributions.json") or []
            if any(row["samples"] > 0 for row in rows):
                break
            time.sleep(0.5)
        assert len(rows) == 1 and rows[0]["samples"] > 0, (rows, (tmp_path / "monitor.log").read_text()[-3000:])
    finally:
        monitor.stop()
