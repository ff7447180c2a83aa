"""keep_freed_memory: large freed blocks are reused instead of page-faulting fresh pages (in a subprocess:
the setting is process-wide)."""

import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys
import torch
from recipes.dalle.cpu_malloc import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
for _ in range(10):  # first uses: the heap grows to its working size (these page faults are unavoidable)
    torch.ones(64 << 20, dtype=torch.uint8)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.ones(64 << 20, dtype=torch.uint8)  # allocated, touched and freed again
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_freed_large_blocks_are_reused_without_page_faults():
    def faults(mode):
        out = subprocess.run([sys.executable, "-c", SCRIPT, mode], check=True, capture_output=True, text=True)
        return int(out.stdout.split()[-1])

    default, kept = faults("default"), faults("keep")
    assert default > 10 * 16384 * 0.9  # glibc as is: a fresh mmap (16384 pages of 4 KiB) per 64 MiB block
    assert kept < default / 20
