"""DALL-E model: masks, causality, reversible gradients, weight sharing, KV cache, parameter counts, configs."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from recipes.dalle.attention import ATTENTION_TYPES, GroupedImageAttentionLayout, dense_mask, grouped_attention
from recipes.dalle.model import DALLE, DALLEConfig
from recipes.dalle.reversible import reversible_forward, reversible_forward_eager


pytestmark = pytest.mark.usefixtures("one_thread")


def small_config(**overrides) -> DALLEConfig:
    values = dict(dim=32, depth=5, heads=2, dim_head=16, text_vocab_size=50, text_seq_len=5, image_vocab_size=12,
                  image_grid_size=5, attn_types=("axial_row", "axial_col", "axial_row", "axial_row"),
                  shared_layer_ids=(0, 1, 2, 3), conv_kernel_size=3)
    values.update(overrides)
    return DALLEConfig(**values)


def batch(config: DALLEConfig, batch_size: int = 2):
    text = torch.randint(1, config.text_vocab_size, (batch_size, config.text_seq_len))
    text[0, -2:] = 0  # some padding
    image = torch.randint(0, config.image_vocab_size, (batch_size, config.num_image))
    return text, image


def allowed_by_definition(attn_type: str, num_text: int, grid: int, kernel: int, query: int, key: int) -> bool:
    """The attention rules of the task, written out position by position."""
    if query < num_text:  # text queries: causal over text only
        return key <= query
    if key < num_text:  # image queries see all text
        return True
    qr, qc = divmod(query - num_text, grid)
    kr, kc = divmod(key - num_text, grid)
    if key > query:
        return False
    if attn_type == "full":
        return True
    if attn_type == "axial_row":
        return kr == qr and kc <= qc
    if attn_type == "axial_col":
        return kc == qc and kr <= qr
    half = kernel // 2
    return abs(kr - qr) <= half and abs(kc - qc) <= half  # conv_like: window, earlier-or-same in raster order


@pytest.mark.parametrize("attn_type,kernel", [("full", 3), ("axial_row", 3), ("axial_col", 3), ("conv_like", 3),
                                              ("conv_like", 5)])
def test_dense_mask_follows_the_definitions(attn_type, kernel):
    num_text, grid = 4, 5
    mask = dense_mask(attn_type, num_text, grid, kernel)
    length = num_text + grid * grid
    expected = torch.tensor([[allowed_by_definition(attn_type, num_text, grid, kernel, q, k) for k in range(length)]
                             for q in range(length)])
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("attn_type,kernel", [("full", 3), ("axial_row", 3), ("axial_col", 3), ("conv_like", 3),
                                              ("conv_like", 5), ("conv_like", 1)])
def test_grouped_attention_equals_dense_masked_reference(attn_type, kernel):
    num_text, grid = 4, 6
    q, k, v = torch.randn(3, 2, 3, num_text + grid * grid, 8).unbind(0)
    layout = GroupedImageAttentionLayout(attn_type, num_text, grid, kernel)
    fast = grouped_attention(q, k, v, num_text, layout)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(attn_type, num_text, grid, kernel))
    torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reversible,attention_impl", [(True, "dense"), (False, "grouped")])
def test_changing_a_later_token_never_changes_an_earlier_logit(reversible, attention_impl):
    config = small_config(attn_types=("full", "axial_row", "axial_col", "axial_row"), reversible=reversible,
                          attention_impl=attention_impl)
    model = DALLE(config).eval()
    text, image = batch(config)
    text_logits, image_logits = model(text, image)
    # logits at sequence position p predict token p + 1: text position i predicts text i, image j predicts code j
    changed_cell = 13
    image2 = image.clone()
    image2[:, changed_cell] = (image2[:, changed_cell] + 1) % config.image_vocab_size
    text_logits2, image_logits2 = model(text, image2)
    torch.testing.assert_close(text_logits2, text_logits, atol=0, rtol=0)
    torch.testing.assert_close(image_logits2[:, : changed_cell + 1], image_logits[:, : changed_cell + 1], atol=0, rtol=0)
    assert not torch.allclose(image_logits2[:, changed_cell + 1 :], image_logits[:, changed_cell + 1 :])
    changed_text = 2
    text3 = text.clone()
    text3[:, changed_text] = text3[:, changed_text] % (config.text_vocab_size - 1) + 1
    text_logits3, image_logits3 = model(text3, image)
    torch.testing.assert_close(text_logits3[:, : changed_text + 1], text_logits[:, : changed_text + 1], atol=0, rtol=0)
    assert not torch.allclose(text_logits3[:, changed_text + 1 :], text_logits[:, changed_text + 1 :])
    assert not torch.allclose(image_logits3, image_logits)  # every image position sees all the text


def test_dense_and_grouped_attention_give_the_same_model_outputs_and_gradients():
    config = small_config(attn_types=("full", "axial_row", "axial_col", "axial_row"))  # last layer conv_like
    dense = DALLE(config)
    grouped = DALLE(small_config(attn_types=config.attn_types, attention_impl="grouped"))
    grouped.load_state_dict(dense.state_dict())
    text, image = batch(config)
    dense_loss, grouped_loss = dense.compute_loss(text, image)["loss"], grouped.compute_loss(text, image)["loss"]
    torch.testing.assert_close(dense_loss, grouped_loss)
    dense_loss.backward()
    grouped_loss.backward()
    for (name, p), q in zip(dense.named_parameters(), grouped.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_rotary_positions_matter_for_image_tokens():
    config = small_config(attn_types=("full",), last_layer_conv=False)
    model = DALLE(config)
    text, image = batch(config)
    image[:, :3] = torch.tensor([1, 2, 1])
    swapped = image.clone()
    swapped[:, :3] = torch.tensor([2, 1, 1])  # same multiset of codes before position 3, different order
    _, logits = model(text, image)
    _, logits_swapped = model(text, swapped)
    assert not torch.allclose(logits[:, 3], logits_swapped[:, 3])


def test_reversible_backward_equals_plain_autograd_through_the_same_blocks(monkeypatch):
    config = small_config(reversible=True)
    model = DALLE(config)
    text, image = batch(config)
    loss = model.compute_loss(text, image)["loss"]
    loss.backward()
    recomputed = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    # the same coupling under ordinary autograd, which stores every activation
    monkeypatch.setattr("recipes.dalle.model.reversible_forward", lambda x1, x2, layers, _: reversible_forward_eager(x1, x2, layers))
    plain_loss = model.compute_loss(text, image)["loss"]
    plain_loss.backward()
    torch.testing.assert_close(loss, plain_loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(recomputed[name], p.grad, atol=1e-6, rtol=1e-4, msg=name)
    assert all(p.grad.abs().sum() > 0 for p in model.blocks.parameters())


def test_reversible_function_is_one_node_and_matches_eager_gradients():
    dim, layers_count = 16, 6
    linears = [torch.nn.Linear(dim, dim) for _ in range(2 * layers_count)]
    layers = [(linears[2 * i], linears[2 * i + 1]) for i in range(layers_count)]
    params = [(list(f.parameters()), list(g.parameters())) for f, g in layers]
    x = torch.randn(3, 4, dim, requires_grad=True)
    y1, y2 = reversible_forward(x, x, layers, params)
    # one custom autograd node for the whole stack: no per-layer activations are kept for backward
    assert "ReversibleFunction" in type(y1.grad_fn).__name__
    (y1.sum() + 2 * y2.sum()).backward()
    grads = [p.grad.clone() for p in itertools.chain.from_iterable(lin.parameters() for lin in linears)] + [x.grad.clone()]
    for lin in linears:
        lin.zero_grad()
    x.grad = None
    e1, e2 = reversible_forward_eager(x, x, layers)
    (e1.sum() + 2 * e2.sum()).backward()
    expected = [p.grad for p in itertools.chain.from_iterable(lin.parameters() for lin in linears)] + [x.grad]
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_shared_layers_share_storage_and_keep_their_own_norms():
    config = small_config(depth=9)  # ids cycle 0,1,2,3,0,1,2,3 and the last (conv) layer gets its own block
    model = DALLE(config)
    assert model.layer_types == ["axial_row", "axial_col", "axial_row", "axial_row"] * 2 + ["conv_like"]
    assert model.layer_block_ids == [0, 1, 2, 3, 0, 1, 2, 3, 4]
    assert len(model.blocks) == 5

    def block_ptr(layer):
        return model.blocks[model.layer_block_ids[layer]].attn.to_qkv.weight.data_ptr()

    assert block_ptr(0) == block_ptr(4) and block_ptr(1) == block_ptr(5)
    assert block_ptr(0) != block_ptr(1) and block_ptr(8) not in {block_ptr(i) for i in range(8)}
    assert len({norm.weight.data_ptr() for norm in model.attn_norms}) == config.depth
    shared = sum(p.numel() for p in model.blocks[0].parameters())
    assert model.num_parameters(unique=False) - model.num_parameters(unique=True) == 4 * shared


def test_tied_embeddings_and_separate_logit_blocks():
    config = small_config()
    model = DALLE(config)
    text, image = batch(config)
    text_logits, image_logits = model(text, image)
    assert text_logits.shape == (2, config.text_seq_len, config.text_vocab_size + config.text_seq_len)
    assert image_logits.shape == (2, config.num_image, config.image_vocab_size)
    names = {name for name, _ in model.named_parameters()}
    assert not any("to_logits" in n or "lm_head" in n for n in names)  # output projections are the embeddings
    ids = model.text_tokens(text)
    assert ids[0, -1] == config.text_vocab_size + config.text_seq_len - 1 and ids[0, -2] == config.text_vocab_size + config.text_seq_len - 2
    assert torch.equal(ids[1], text[1])


def test_loss_weights_text_and_image_cross_entropy():
    config = small_config(image_loss_weight=3.0)
    model = DALLE(config)
    text, image = batch(config)
    out = model.compute_loss(text, image)
    text_logits, image_logits = model(text, image)
    text_loss = F.cross_entropy(text_logits.flatten(0, 1), model.text_tokens(text).flatten())
    image_loss = F.cross_entropy(image_logits.flatten(0, 1), image.flatten())
    torch.testing.assert_close(out["text_loss"], text_loss)
    torch.testing.assert_close(out["image_loss"], image_loss)
    torch.testing.assert_close(out["loss"], (text_loss + 3.0 * image_loss) / 4.0)


def test_a_few_steps_fit_a_fixed_batch():
    config = small_config(reversible=True)
    model = DALLE(config)
    text, image = batch(config, batch_size=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(15):
        loss = model.compute_loss(text, image)["loss"]
        first = first if first is not None else loss.item()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert loss.item() < 0.75 * first


@pytest.mark.parametrize("attn_type", ATTENTION_TYPES)
@pytest.mark.parametrize("reversible,rotary,attention_impl", [(True, True, "dense"), (False, False, "grouped")])
def test_kv_cache_decoding_equals_full_forward(attn_type, reversible, rotary, attention_impl):
    config = small_config(attn_types=(attn_type,), depth=3, last_layer_conv=attn_type == "conv_like",
                          reversible=reversible, rotary=rotary, shared_layer_ids=(0, 1), attention_impl=attention_impl)
    assert set(config.layer_attn_types()) == {attn_type}
    model = DALLE(config).eval()
    text, image = batch(config, batch_size=3)
    with torch.no_grad():
        _, full_logits = model(text, image)
    cache = model.new_cache(3)
    step_logits = [model.prefill(text, cache)]
    for cell in range(config.num_image - 1):
        step_logits.append(model.decode_step(image[:, cell], cache))
    torch.testing.assert_close(torch.stack(step_logits, dim=1), full_logits, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="nothing left to predict"):
        model.decode_step(image[:, -1], cache)


def test_seed_1b_config_parameter_counts_on_meta():
    with torch.device("meta"):
        model = DALLE(DALLEConfig.seed_1b())
    with torch.device("meta"):
        unshared_model = DALLE(DALLEConfig.seed_1b(shared_layer_ids=None))
    unshared = unshared_model.num_parameters(unique=True)
    assert model.num_parameters(unique=False) == unshared
    assert 1.05e9 <= unshared <= 1.2e9
    assert model.num_parameters(unique=True) <= 150e6
    assert len(model.blocks) == 5 and model.layer_types[-1] == "conv_like"


@pytest.mark.parametrize("overrides,message", [
    (dict(attn_types=("axial_row", "sparse")), "unknown type 'sparse'"),
    (dict(conv_kernel_size=4), "conv_kernel_size must be odd"),
    (dict(conv_kernel_size=7, image_grid_size=5), "conv_kernel_size must be odd and between 1 and image_grid_size"),
    (dict(attn_types=()), "attn_types is empty"),
    (dict(shared_layer_ids=()), "shared_layer_ids is empty"),
    (dict(dim_head=4), "dim_head >= 6"),
    (dict(dim_head=15), "even dim_head"),
    (dict(depth=0), "depth must be >= 1"),
    (dict(attention_impl="sparse"), "attention_impl must be one of"),
])
def test_bad_configs_raise_value_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        small_config(**overrides)


def test_wrong_input_shapes_raise_value_error():
    config = small_config()
    model = DALLE(config)
    text, image = batch(config)
    with pytest.raises(ValueError, match="text has 4 tokens"):
        model(text[:, :4], image)
    with pytest.raises(ValueError, match="image has 24 codes"):
        model(text, image[:, :24])


def test_reversible_recomputation_under_bf16_autocast_matches_eager(monkeypatch):
    config = small_config(reversible=True)
    model = DALLE(config)
    text, image = batch(config)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.compute_loss(text, image)["loss"]
    loss.backward()
    recomputed = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    monkeypatch.setattr("recipes.dalle.model.reversible_forward", lambda x1, x2, layers, _: reversible_forward_eager(x1, x2, layers))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager_loss = model.compute_loss(text, image)["loss"]
    eager_loss.backward()
    for name, p in model.named_parameters():  # bf16 matmuls: the backward must recompute in bf16 too
        torch.testing.assert_close(recomputed[name], p.grad, atol=1e-5, rtol=1e-3, msg=name)


@pytest.mark.parametrize("attention_impl", ["grouped", "dense"])
def test_training_works_after_a_first_forward_under_inference_mode(attention_impl):
    """Lightning's sanity-check validation runs under inference mode before the first training step."""
    config = small_config(attention_impl=attention_impl)
    model = DALLE(config)
    text, image = batch(config)
    with torch.inference_mode():
        validation_loss = model.compute_loss(text, image)["loss"]
    loss = model.compute_loss(text, image)["loss"]
    loss.backward()
    torch.testing.assert_close(loss.detach(), validation_loss)
    assert all(p.grad is not None for p in model.blocks.parameters())
