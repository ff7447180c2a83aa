"""Short import paths: what users name in YAML resolves from the package, and the shipped configs use them."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ["lightning_swarm", "lightning_swarm.callbacks", "lightning_swarm.optim", "recipes.dalle", "recipes.clip"]


@pytest.mark.parametrize("package", PACKAGES)
def test_exported_names_resolve(package):
    module = importlib.import_module(package)
    assert module.__all__
    for name in module.__all__:
        assert getattr(module, name).__name__ == name
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        getattr(module, "NoSuchName")


def _class_paths(node):
    if isinstance(node, dict):
        if isinstance(node.get("class_path"), str):
            yield node["class_path"]
        for value in node.values():
            yield from _class_paths(value)
    elif isinstance(node, list):
        for value in node:
            yield from _class_paths(value)


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_shipped_configs_use_short_class_paths(config):
    paths = list(_class_paths(yaml.safe_load((REPO / "configs" / config).read_text())))
    assert paths
    for path in paths:
        package, _, name = path.rpartition(".")
        importlib.import_module(package)  # the path resolves
        if package.split(".")[0] in ("lightning_swarm", "recipes"):
            assert name in importlib.import_module(package).__all__, f"{path}: use the package's short path"


def test_importing_the_package_stays_light():
    script = ("import sys, lightning_swarm, lightning_swarm.callbacks; "
              "print('hivemind' in sys.modules, 'torch' in sys.modules)")
    output = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True,
                            cwd=REPO)
    assert output.stdout.split() == ["False", "False"]
