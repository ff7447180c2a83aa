"""Platforms hivemind lacks: the one line ``import lightning_swarm`` prints there (platform faked in a child process),
pyproject's marker installing hivemind exactly where it has wheels, and (slow, needs PyPI) that pip finds a hivemind
wheel for each platform the project claims."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from lightning_swarm.platforms import HIVEMIND_WHEEL_PLATFORMS, WSL_URL

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None

REPO = Path(__file__).resolve().parents[2]
# a wheel platform tag per claimed (sys.platform, machine), as pip download --platform takes it
WHEEL_TAGS = {("linux", "x86_64"): "manylinux2014_x86_64", ("linux", "aarch64"): "manylinux2014_aarch64",
              ("darwin", "x86_64"): "macosx_10_9_x86_64", ("darwin", "arm64"): "macosx_11_0_arm64"}


def import_on(system: str, machine: str, then: str = "") -> subprocess.CompletedProcess:
    """``import lightning_swarm`` in a child process that believes it runs on ``system``/``machine``, then ``then``."""
    code = (f"import sys, platform; sys.platform = {system!r}; platform.machine = lambda: {machine!r}; "
            f"platform.system = lambda: {system.capitalize()!r}; import lightning_swarm; print('imported'); {then}")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("LIGHTNING_SWARM_PLATFORM_NOTICE_SHOWN", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_windows_import_says_in_one_line_to_use_wsl2():
    result = import_on("win32", "AMD64")
    assert result.returncode == 0 and result.stdout.strip() == "imported", result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "WSL2" in lines[0] and WSL_URL in lines[0]


def test_macos_import_warns_in_one_line_partially_supported():
    # a process it starts (macOS spawns: the child imports the package again) adds no second line
    child = ("import subprocess; subprocess.run([sys.executable, '-c', 'import sys; sys.platform = \"darwin\"; "
             "import lightning_swarm'], check=True)")
    for machine in ("arm64", "x86_64"):
        result = import_on("darwin", machine, then=child)
        assert result.returncode == 0, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "partially supported" in lines[0], result.stderr


def test_linux_import_prints_nothing_and_other_linux_machines_are_told():
    for machine in ("x86_64", "aarch64"):
        result = import_on("linux", machine)
        assert result.returncode == 0 and result.stderr == "", result.stderr
    result = import_on("linux", "ppc64le")
    assert len(result.stderr.strip().splitlines()) == 1 and "ppc64le" in result.stderr


def hivemind_requirement() -> Requirement:
    if tomllib is None:
        pytest.skip("tomllib is Python 3.11+")
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (requirement,) = [Requirement(d) for d in dependencies if Requirement(d).name == "hivemind"]
    return requirement


def test_pyproject_installs_hivemind_exactly_where_it_has_wheels():
    marker = hivemind_requirement().marker
    assert marker is not None
    for system, machine in HIVEMIND_WHEEL_PLATFORMS:
        assert marker.evaluate({"sys_platform": system, "platform_machine": machine}), (system, machine)
    for system, machine in (("win32", "AMD64"), ("win32", "ARM64"), ("linux", "ppc64le"), ("linux", "armv7l")):
        assert not marker.evaluate({"sys_platform": system, "platform_machine": machine}), (system, machine)
    assert set(WHEEL_TAGS) == set(HIVEMIND_WHEEL_PLATFORMS)


def pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.slow  # downloads 4 wheels (~60 MB) from PyPI
@pytest.mark.parametrize("platform_key", sorted(WHEEL_TAGS), ids="-".join)
def test_pip_finds_a_hivemind_wheel_for_each_claimed_platform(platform_key, tmp_path):
    if not pypi_reachable():
        pytest.skip("no route to the package index (pypi.org)")
    version = str(hivemind_requirement().specifier).lstrip("=")
    command = [sys.executable, "-m", "pip", "download", f"hivemind=={version}", "--only-binary=:all:", "--no-deps",
               "--platform", WHEEL_TAGS[platform_key], "--python-version", "3.12", "-d", str(tmp_path), "-q"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = [p.name for p in tmp_path.iterdir()]
    assert wheel.startswith(f"hivemind-{version}-") and wheel.endswith(".whl"), wheel
