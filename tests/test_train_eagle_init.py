"""EAGLE-3's optional start from a target decoder layer (``eagle.init_layer``): the copy is exact,
the layer then computes what the target's layer computes, and unusable targets are refused."""

import pytest
import torch

from headway.heads import Eagle3Drafter
from headway.heads.layers import causal_mask
from headway.testing import tiny_target
from headway.train.eagle import init_from_target_layer

pytestmark = pytest.mark.usefixtures("one_thread")


def drafter_for(target):
    torch.manual_seed(0)
    return Eagle3Drafter.for_target(target, draft_vocab_size=64)


@pytest.mark.parametrize("layer", [0, -1])
def test_the_layer_computes_what_the_target_layer_computes(layer):
    """With the embedding half silenced, the drafter's layer is the target's layer: same output
    for the same hidden states, positions and causal mask."""
    target, _ = tiny_target("llama")
    heads = drafter_for(target)
    info = init_from_target_layer(heads, target, layer)
    n = len(target.model.layers)
    assert info["layer"] == layer % n
    src = target.model.layers[layer]
    with torch.no_grad():
        heads.midlayer.input_layernorm.weight.zero_()  # norm(embed) = 0: only the hidden half speaks
        B, T, H = 2, 7, heads.config.hidden_size
        h = torch.randn(B, T, H)
        pos = torch.arange(T)[None].expand(B, T)
        cos, sin = heads.rope(h, pos)
        mask = causal_mask(T, 0, h.dtype, h.device)
        ids = torch.randint(0, heads.config.vocab_size, (B, T))
        ours = heads.midlayer(h, cos, sin, mask, None, embeds=heads.embed(ids))
        theirs = src(h, attention_mask=mask.expand(B, 1, T, T), position_ids=pos, position_embeddings=(cos, sin))
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_fc_passes_the_deepest_layer_and_norm_is_the_targets():
    target, _ = tiny_target("llama")
    heads = drafter_for(target)
    init_from_target_layer(heads, target, 1)
    H = heads.config.hidden_size
    a, b, c = (torch.randn(1, 3, H) for _ in range(3))
    with torch.no_grad():
        torch.testing.assert_close(heads.fuse([a, b, c]), c)
    assert torch.equal(heads.norm.weight, target.model.norm.weight)
    q = target.model.layers[1].self_attn.q_proj.weight
    assert torch.equal(heads.midlayer.self_attn.q_proj.weight, torch.cat([q, q], dim=1))
    assert torch.equal(heads.midlayer.hidden_norm.weight, target.model.layers[1].input_layernorm.weight)
    assert torch.equal(heads.midlayer.input_layernorm.weight, target.model.layers[1].input_layernorm.weight)


def test_a_layer_out_of_range_is_refused_with_the_count():
    target, _ = tiny_target("llama")
    n = len(target.model.layers)
    with pytest.raises(ValueError, match=f"init_layer={n}: the target has {n} decoder layers"):
        init_from_target_layer(drafter_for(target), target, n)


def test_a_target_without_llama_style_modules_is_refused_by_name():
    target, _ = tiny_target("gpt_neox")  # fused query_key_value, no q_proj
    heads = drafter_for(target)
    before = {k: v.clone() for k, v in heads.state_dict().items()}
    with pytest.raises(ValueError, match="lacks Llama-style modules"):
        init_from_target_layer(heads, target, 0)
    assert all(torch.equal(v, before[k]) for k, v in heads.state_dict().items())  # nothing half-copied


def test_training_config_records_the_init(tmp_path):
    """``headway train eagle.init_layer=N`` builds the drafter from layer N and says so in its metadata."""
    from headway.config import load_config
    from headway.train.config import TrainConfig
    from headway.train.eagle import Eagle3Task

    target, _ = tiny_target("llama")
    cfg = load_config(TrainConfig, None, {"kind": "eagle3", "target": "tiny", "data": "", "eagle.init_layer": -1,
                                          "output_dir": str(tmp_path)})
    heads = Eagle3Task(cfg).build(target)
    last = target.model.layers[-1]
    assert torch.equal(heads.midlayer.mlp.down_proj.weight, last.mlp.down_proj.weight)
    assert heads.metadata["init_from_target"]["layer"] == len(target.model.layers) - 1


def test_a_layer_of_another_shape_is_refused_before_anything_is_copied():
    target, _ = tiny_target("llama")
    heads = drafter_for(target)
    other, _ = tiny_target("llama", intermediate_size=2 * target.config.intermediate_size)
    before = {k: v.clone() for k, v in heads.state_dict().items()}
    with pytest.raises(ValueError, match=r"mlp.gate_proj is \(\d+, \d+\) in the target and"):
        init_from_target_layer(heads, other, 0)
    assert all(torch.equal(v, before[k]) for k, v in heads.state_dict().items())


@pytest.mark.parametrize("train_lm_head", [True, False])
def test_train_lm_head_false_keeps_the_target_rows_through_a_step(tmp_path, train_lm_head):
    """``eagle.train_lm_head=false`` (speculators' choice): the draft lm_head starts as the target's rows
    for the draft vocabulary and the optimiser never sees it; the default trains it."""
    from headway.config import load_config
    from headway.train.config import TrainConfig
    from headway.train.eagle import Eagle3Task
    from headway.train.optim import make_optimizer
    from headway.train.ttt import eagle3_ttt_loss

    target, _ = tiny_target("llama")
    cfg = load_config(TrainConfig, None, {"kind": "eagle3", "target": "tiny", "data": "", "output_dir": str(tmp_path),
                                          "eagle.train_lm_head": train_lm_head})
    task = Eagle3Task(cfg)
    heads = task.build(target)
    rows = target.get_output_embeddings().weight[heads.draft_token_ids()]
    assert torch.equal(heads.lm_head.weight, rows)
    groups = task.param_groups(heads, target)
    trained = {id(p) for g in groups for p in g.params}
    assert (id(heads.lm_head.weight) in trained) is train_lm_head
    assert id(heads.fc.weight) in trained
    assert heads.metadata["draft_vocab"]["lm_head_init"].endswith("(frozen)") is not train_lm_head
    opt = make_optimizer(groups, cfg.optim)
    ids = torch.randint(3, 300, (2, 12))
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    fused = heads.fuse([out.hidden_states[i] for i in heads.feature_layers])
    loss, _ = eagle3_ttt_loss(heads, ids, fused, out.logits, torch.ones_like(ids), steps=2)
    fc_before = heads.fc.weight.detach().clone()
    loss.backward()
    opt.step()
    assert not torch.equal(heads.fc.weight, fc_before)
    assert torch.equal(heads.lm_head.weight, rows) is not train_lm_head
