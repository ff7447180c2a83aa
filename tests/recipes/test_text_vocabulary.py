"""The compact text vocabulary (DALLEConfig.text_token_ids): the shapes captions' ids, the id -> row mapping,
the shared unknown row, and checkpoints that keep it."""

import pytest
import torch

from recipes.dalle.model import DALLE, DALLEConfig
from recipes.dalle.module import DALLEModule
from recipes.dalle.tokenizer import TextTokenizer, shapes_token_ids, text_token_ids
from recipes.shapes import generate_example


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(**overrides) -> DALLEConfig:
    values = dict(dim=32, depth=2, heads=2, dim_head=16, text_seq_len=16, image_vocab_size=8, image_grid_size=4,
                  attn_types=("axial_row", "axial_col"), conv_kernel_size=3)
    values.update(overrides)
    return DALLEConfig(**values)


def shapes_captions(count: int = 150) -> list[str]:
    return [generate_example(i, split)[0] for split in ("train", "val") for i in range(count)]


def test_every_shapes_caption_has_rows_in_the_compact_vocabulary():
    captions = shapes_captions()
    text = TextTokenizer(text_seq_len=16)(captions)
    model = DALLE(tiny_config(text_token_ids=shapes_token_ids()))
    assert model.unknown_text_ids(text) == []
    assert any(" above " in c for c in captions) and any(c.startswith("an ") for c in captions)
    # the rows are distinct per id: no two words of the captions share a row
    rows = model.text_tokens(text)
    used_ids = text[text != 0].unique()
    id_rows = model.text_id_to_row[used_ids]
    assert len(id_rows.unique()) == len(used_ids) and (id_rows > 0).all()
    assert (id_rows < model.config.text_rows - 1).all()  # none is the unknown row
    assert rows.max() < model.config.text_rows + 16


def test_compact_model_computes_what_the_full_model_computes_on_its_rows():
    """A full-vocabulary model whose listed rows are copied into a compact one gives the same image logits."""
    torch.manual_seed(0)
    ids = (5, 17, 99, 400)
    full = DALLE(tiny_config(text_vocab_size=500))
    compact = DALLE(tiny_config(text_vocab_size=500, text_token_ids=ids))
    state = full.state_dict()
    seq = full.config.text_seq_len
    # compact rows: 0 (bos), the listed ids, the unknown row, then the per-position pads
    state["text_emb.weight"] = torch.cat([state["text_emb.weight"][[0, *ids]], torch.zeros(1, 32),
                                          state["text_emb.weight"][500 : 500 + seq]])
    state["text_logits_bias"] = torch.cat([state["text_logits_bias"][[0, *ids]], torch.zeros(1),
                                           state["text_logits_bias"][500 : 500 + seq]])
    compact.load_state_dict(state)
    text = torch.tensor(ids)[torch.randint(0, len(ids), (3, seq))]
    text[:, 10:] = 0
    image = torch.randint(0, 8, (3, 16))
    torch.testing.assert_close(compact(text, image)[1], full(text, image)[1])
    assert compact.config.text_rows == len(ids) + 2
    assert compact.text_emb.weight.shape[0] == len(ids) + 2 + seq


def test_ids_outside_the_compact_vocabulary_share_the_unknown_row_and_are_reported():
    model = DALLE(tiny_config(text_vocab_size=500, text_token_ids=(5, 17)))
    text = torch.tensor([[5, 123, 0] + [0] * 13, [5, 456, 0] + [0] * 13])
    rows = model.text_tokens(text)
    assert rows[0, 1] == rows[1, 1] == model.config.text_rows - 1
    assert rows[0, 0] == 1 and rows[0, 2] == model.config.text_rows + 2  # a listed id; a pad at position 2
    image = torch.randint(0, 8, (1, 16)).expand(2, -1)
    logits = model(text, image)[1]
    torch.testing.assert_close(logits[0], logits[1])
    assert model.unknown_text_ids(text) == [123, 456]


@pytest.mark.parametrize("ids,message", [((0, 5), "distinct ids"), ((5, 5), "distinct ids"), ((), "at least one"),
                                         ((49408,), "out of range")])
def test_bad_compact_vocabularies_raise_value_error(ids, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(text_token_ids=ids)


def test_named_vocabularies_and_checkpoint_hyperparameters_keep_the_ids():
    assert text_token_ids("full") is None
    assert text_token_ids("shapes") == shapes_token_ids()
    with pytest.raises(ValueError, match="unknown text vocabulary"):
        text_token_ids("words")
    module = DALLEModule(tiny_config(), text_vocabulary="shapes")
    assert module.config.text_token_ids == shapes_token_ids()
    # what from_checkpoint rebuilds: the ids come back from the plain-typed hyper-parameters, and the id -> row
    # table is derived from them (not stored), so the state dict loads strictly
    config = DALLEModule.config_from_hparams(dict(module.hparams))
    assert config.text_token_ids == shapes_token_ids()
    restored = DALLEModule(config)
    restored.load_state_dict(module.state_dict())
    assert "model.text_id_to_row" not in module.state_dict()

