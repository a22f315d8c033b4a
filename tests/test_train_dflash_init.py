"""DFlash's optional start from a target decoder layer (``dflash.init_layer``): a one-token block over
the copied layer computes what the target's layer computes at that position, and unusable targets are
refused before anything is copied."""

import pytest
import torch

from headway.heads import DFlashDrafter
from headway.testing import tiny_target
from headway.train.dflash import init_from_target_layer

pytestmark = pytest.mark.usefixtures("one_thread")


def drafter_for(target, **kw):
    torch.manual_seed(0)
    n = len(target.model.layers)
    return DFlashDrafter.for_target(target, mask_token_id=3, block_size=4, aux_layers=[1, 2, n - 1], **kw)


@pytest.mark.parametrize("layer", [0, -1])
def test_a_one_token_block_computes_what_the_target_layer_computes(layer):
    """Context = the layer's input states at positions < P, block = the state at P: the attention
    over (context, block) is the target's causal attention at P, so the outputs agree exactly
    (q/k norms off: Llama has none)."""
    target, _ = tiny_target("llama")
    src = target.model.layers[layer]
    with torch.no_grad():  # norms that are not all ones, so that each copy shows
        for norm in (src.input_layernorm, src.post_attention_layernorm):
            norm.weight.uniform_(0.5, 1.5)
    heads = drafter_for(target, qk_norm=False, num_layers=1)
    info = init_from_target_layer(heads, target, layer)
    assert info["layer"] == layer % len(target.model.layers)
    B, T, H = 2, 6, heads.config.hidden_size
    h = torch.randn(B, T, H)
    pos = torch.arange(T)[None].expand(B, T)
    with torch.no_grad():
        context = heads.fuse([torch.zeros_like(h), torch.zeros_like(h), h])  # fc passes the deepest through
        kv = heads.context_kv(context[:, :-1], pos[:, :-1])
        ours = heads(h[:, -1:], pos[:, -1:], kv)  # (B, 1, H)
        cos, sin = heads.rotary(h, pos)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(B, 1, T, T)
        theirs = src(h, attention_mask=mask, position_ids=pos, position_embeddings=(cos, sin))
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    torch.testing.assert_close(ours, theirs[:, -1:], atol=1e-5, rtol=1e-5)


def test_every_layer_fc_and_norms_are_set():
    target, _ = tiny_target("llama")
    heads = drafter_for(target, num_layers=2)
    init_from_target_layer(heads, target, 1)
    src = target.model.layers[1]
    for layer in heads.layers:
        assert torch.equal(layer.mlp.down_proj.weight, src.mlp.down_proj.weight)
        assert torch.equal(layer.self_attn.k_proj.weight, src.self_attn.k_proj.weight)
    assert torch.equal(heads.hidden_norm.weight, src.input_layernorm.weight)
    assert torch.equal(heads.norm.weight, target.model.norm.weight)
    H = heads.config.hidden_size
    assert torch.equal(heads.fc.weight[:, -H:], torch.eye(H)) and not heads.fc.weight[:, :-H].any()


def test_a_layer_out_of_range_is_refused_with_the_count():
    target, _ = tiny_target("llama")
    n = len(target.model.layers)
    with pytest.raises(ValueError, match=f"init_layer={n}: the target has {n} decoder layers"):
        init_from_target_layer(drafter_for(target), target, n)


@pytest.mark.parametrize("arch, overrides, match", [
    ("gpt_neox", {}, "lacks Llama-style modules"),  # fused query_key_value, no q_proj
    ("llama", {"intermediate_size": 96}, r"mlp.gate_proj is \(96, \d+\) in the target and"),
])
def test_an_unusable_target_is_refused_before_anything_is_copied(arch, overrides, match):
    target, _ = tiny_target("llama")
    heads = drafter_for(target)
    other, _ = tiny_target(arch, **overrides)
    before = {k: v.clone() for k, v in heads.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        init_from_target_layer(heads, other, 0)
    assert all(torch.equal(v, before[k]) for k, v in heads.state_dict().items())


def test_training_config_builds_from_the_layer_and_records_it(tmp_path):
    from headway.config import ConfigError, load_config
    from headway.train.config import TrainConfig
    from headway.train.dflash import DFlashTask

    target, _ = tiny_target("llama")
    over = {"kind": "dflash", "target": "tiny", "data": "", "dflash.init_layer": -1, "output_dir": str(tmp_path),
            "dflash.mask_token_id": 3}
    heads = DFlashTask(load_config(TrainConfig, None, over)).build(target)
    assert torch.equal(heads.layers[0].mlp.up_proj.weight, target.model.layers[-1].mlp.up_proj.weight)
    assert heads.metadata["init_from_target"]["layer"] == len(target.model.layers) - 1
    with pytest.raises(ConfigError, match="dflash.init_layer"):
        load_config(TrainConfig, None, {**over, "init_from": str(tmp_path)})
