"""One reader of recipe YAML for tools, and one flag style for the command lines."""

from pathlib import Path

import pytest
import torch
import yaml

from lightning_swarm.cli_flags import KebabCaseArgumentParser
from lightning_swarm.recipe_config import read_recipe_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("config", ["dalle_tiny.yaml", "clip_tiny.yaml"])
def test_shipped_configs_give_model_strategy_and_data(config):
    read = read_recipe_config(REPO / "configs" / config)
    assert read.model_class.startswith("recipes.") and read.data_class.startswith("recipes.")
    assert read.strategy["run_id"] and read.strategy["target_batch_size"] > 0
    assert read.data_init_args["batch_size"] > 0
    with torch.device("meta"):
        model = read.build_model()
    assert type(model).__name__ == read.model_class.rsplit(".", 1)[1]


def test_bad_configs_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_recipe_config(tmp_path / "missing.yaml")
    path = tmp_path / "no_model.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"max_steps": 1}}))
    with pytest.raises(ValueError, match="no 'model' section"):
        read_recipe_config(path)
    path.write_text(yaml.safe_dump({"model": {"dim": 4}}))
    with pytest.raises(ValueError, match="--model-class"):
        read_recipe_config(path).build_model()
    path.write_text(yaml.safe_dump({"model": {"class_path": "no.such.Module"}}))
    with pytest.raises(ValueError, match="cannot import 'no.such.Module'"):
        read_recipe_config(path).build_model()


def make_parser():
    parser = KebabCaseArgumentParser()
    parser.add_argument("--run-id")
    parser.add_argument("--max-steps", type=int, default=1)
    parser.add_argument("--no-checkpoints", action="store_true")
    return parser


def test_kebab_case_flags_and_old_snake_case_spellings_with_a_warning():
    parser = make_parser()
    args = parser.parse_args(["--run-id", "a", "--max-steps=3"])
    assert (args.run_id, args.max_steps, args.no_checkpoints) == ("a", 3, False)
    with pytest.warns(FutureWarning, match="--run_id is deprecated, use --run-id"):
        args = parser.parse_args(["--run_id", "b", "--max_steps=4", "--no_checkpoints"])
    assert (args.run_id, args.max_steps, args.no_checkpoints) == ("b", 4, True)
    with pytest.raises(SystemExit):  # an unknown flag stays an error
        parser.parse_args(["--max_stepz", "1"])


def test_monitor_takes_kebab_case_and_old_flags():
    from lightning_swarm.monitor.__main__ import make_parser as monitor_parser

    args = monitor_parser().parse_args(["--config", "c.yaml", "--run-id", "r", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"])
    assert (args.run_id, args.host_maddrs) == ("r", ["/ip4/127.0.0.1/tcp/0"])
    with pytest.warns(FutureWarning, match="--save_every_epochs is deprecated"):
        assert monitor_parser().parse_args(["--config", "c.yaml", "--save_every_epochs", "3"]).save_every_epochs == 3
