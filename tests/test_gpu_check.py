"""tests/gpu/check.sh on a machine without CUDA (CUDA hidden where there is one): it says so and exits 0."""

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_without_cuda_says_so_and_exits_0(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", GPU_CHECK_OUT=str(tmp_path / "out"))
    result = subprocess.run(["bash", str(REPO / "tests" / "gpu" / "check.sh")], capture_output=True, text=True,
                            env=env, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("tests/gpu/check.sh: no CUDA device here (torch.cuda.is_available() is False): "
                                     "nothing to check, exiting 0")
    assert not (tmp_path / "out").exists()  # nothing ran
