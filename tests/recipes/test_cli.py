"""The DALL-E recipe through its command line: a short `fit` end to end, checkpoints, config errors."""

import pytest
import torch

from lightning_swarm.checkpoint.checkpoint_io import read_checkpoint
from recipes.cli import main
from recipes.dalle.model import DALLEConfig
from recipes.dalle.module import DALLEModule, unconditional_text

TINY = [
    "--config", "configs/dalle_tiny.yaml",
    "--model.init_args.config.dim", "32", "--model.init_args.config.depth", "2",
    "--model.init_args.config.heads", "2", "--model.init_args.config.dim_head", "8",
    "--trainer.max_steps", "4", "--trainer.val_check_interval", "2",
    "--trainer.enable_progress_bar", "false",
    "--trainer.callbacks.init_args.every_n_epochs", "1",
    "--trainer.strategy.init_args.target_batch_size", "8",  # a global step every 2 local steps
    "--data.init_args.batch_size", "4", "--data.init_args.max_val_batches", "1",
    "--data.init_args.num_shapes_train", "64", "--data.init_args.num_shapes_val", "16",
    "--data.init_args.shuffle_buffer", "16",
]


def test_fit_runs_end_to_end_and_writes_loadable_checkpoints(tmp_path):
    cli = main(["fit", *TINY, "--trainer.default_root_dir", str(tmp_path / "run"),
                "--trainer.callbacks.init_args.dirpath", str(tmp_path / "run" / "checkpoints"),
                "--data.init_args.data_dir", str(tmp_path / "data")])
    assert cli.trainer.global_step == 4
    assert cli.model.initial_val_image_loss is not None  # measured by the sanity check at step 0
    assert torch.isfinite(cli.trainer.callback_metrics["val/image_loss"])
    # SwarmCheckpoint saved global steps 1 and 2; the newest rebuilds the model from meta.json alone and holds
    # only tensors and JSON (nothing to unpickle)
    saved = read_checkpoint(str(tmp_path / "run" / "checkpoints"))
    assert saved.meta["global_epoch"] == 2 and saved.meta["model"]["class_path"] == "recipes.dalle.module.DALLEModule"
    loaded = saved.build_model()
    for name, tensor in cli.model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    assert loaded.config == cli.model.config
    assert loaded.image_codec().codebook_size == cli.model.config.image_vocab_size


def test_mismatched_text_length_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="text_seq_len"):
        main(["fit", *TINY, "--trainer.default_root_dir", str(tmp_path / "run"),
              "--trainer.callbacks.init_args.dirpath", str(tmp_path / "run" / "checkpoints"),
              "--data.init_args.data_dir", str(tmp_path / "data"), "--data.init_args.text_seq_len", "24"])


def test_model_and_data_that_disagree_are_refused_when_the_config_is_parsed(tmp_path):
    # the CLIP recipe states its text length for the model and for the data: before anything is built
    with pytest.raises(ValueError, match=r"model.init_args.model_cfg.text_cfg.context_length=16 but "
                                         r"data.init_args.context_length=24"):
        main(["--config", "configs/clip_tiny.yaml", "--data.init_args.context_length", "24",
              "--trainer.default_root_dir", str(tmp_path)], run=False)


def test_bad_module_options_are_rejected():
    config = DALLEConfig(dim=32, depth=2, heads=2, dim_head=8, text_seq_len=8, image_vocab_size=8, image_grid_size=4,
                         conv_kernel_size=3)
    with pytest.raises(ValueError, match="image_codec"):
        DALLEModule(config, image_codec="jpeg")
    with pytest.raises(ValueError, match="min_lr_ratio"):
        DALLEModule(config, min_lr_ratio=2.0)
    with pytest.raises(ValueError, match="vqgan_config"):
        DALLEModule(config, image_codec="vqgan").image_codec()
    with pytest.raises(ValueError, match="text_dropout"):
        DALLEModule(config, text_dropout=1.5)


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")  # training_step without a Trainer
def test_text_dropout_trains_on_the_unconditional_captions_of_guidance():
    """Dropped captions are exactly the unconditional text that classifier-free guidance samples with."""
    config = DALLEConfig(dim=32, depth=2, heads=2, dim_head=8, text_seq_len=8, image_vocab_size=8, image_grid_size=4,
                         conv_kernel_size=3)
    torch.manual_seed(0)
    text = torch.randint(1, config.text_vocab_size, (4, config.text_seq_len))
    image = torch.randint(0, config.image_vocab_size, (4, config.num_image))
    batch = {"text": text, "image": image}
    original = text.clone()
    module = DALLEModule(config)
    with torch.no_grad():
        conditional = module.model.compute_loss(text, image)["loss"]
        unconditional = module.model.compute_loss(unconditional_text(text), image)["loss"]
        assert not torch.allclose(conditional, unconditional)
        for text_dropout, expected in ((0.0, conditional), (1.0, unconditional)):
            module.hparams["text_dropout"] = text_dropout
            torch.testing.assert_close(module.training_step(batch, 0), expected)
        # half the captions dropped: per row, either the caption or the unconditional text, and both occur
        module.hparams["text_dropout"] = 0.5
        dropped = module.drop_captions(text.repeat(8, 1))
        is_pad = (dropped == 0).all(-1)
        assert 0 < is_pad.sum() < len(dropped)
        assert torch.equal(dropped[~is_pad], text.repeat(8, 1)[~is_pad])
    assert torch.equal(text, original)  # the batch's captions are never overwritten
