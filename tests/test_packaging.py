"""pyproject.toml claims the Pythons CI tests: the classifiers name the main interpreter's version and each version
.ci/run runs the fast suite on, and requires-python starts at the oldest of them."""

import re
import sys
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[1]


def test_python_classifiers_and_requires_python_say_what_ci_runs():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    claimed = {c.rsplit(" :: ", 1)[1] for c in project["classifiers"]
               if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)}
    ci = (REPO / ".ci" / "run").read_text()
    (versions,) = re.findall(r'^extra_pythons="([\d. ]+)"$', ci, flags=re.M)
    running = f"{sys.version_info.major}.{sys.version_info.minor}"  # the main interpreter, or one of .ci/run's
    assert running in claimed
    # one claimed version beside .ci/run's: the main interpreter's, which runs the full suite
    assert set(versions.split()) < claimed and len(claimed - set(versions.split())) == 1
    tested = claimed
    oldest = min(tested, key=lambda v: tuple(map(int, v.split("."))))
    specifier = SpecifierSet(project["requires-python"])
    assert oldest in specifier and f"3.{int(oldest.split('.')[1]) - 1}" not in specifier
