"""Where the benchmarks find things outside the repository."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the shared/ folder sits beside the checkout (../shared), on every machine and in CI
SHARED = REPO.parent / "shared"
