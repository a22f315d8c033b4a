"""P-EAGLE drafter (headway/heads/peagle.py): its layers as vLLM builds them, the mask slots of one
parallel draft (pure, by hand), a draft that never reads a drafted token, the KV cache of a decoder
(the real slots kept, the mask slots dropped), save / load and the config's refusals."""

import pytest
import torch

from headway.heads import HeadsError, PEagleConfig, PEagleDrafter, load_heads
from headway.heads.layers import LayerGeometry
from headway.testing import tiny_target

H, V, L = 64, 384, 4


@pytest.fixture(scope="module")
def target():
    model, _ = tiny_target("llama", num_hidden_layers=L)
    return model


def drafter(target, **kw) -> PEagleDrafter:
    torch.manual_seed(3)
    opts = {"num_depths": 4, "num_layers": 2, "mask_token_id": 7, "draft_vocab_size": 100} | kw
    d = PEagleDrafter.for_target(target, **opts)
    d.set_draft_vocab(torch.arange(50, 150))
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return d.eval()


def test_layers_are_built_as_vllm_builds_them(target):
    """Layer 0 is EAGLE-3's (2H-wide q/k/v, hidden_norm); later layers are plain Llama layers over H."""
    d = drafter(target, num_layers=3, norm_before_fc=True)
    sd = d.state_dict()
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (64, 2 * H) and "layers.0.hidden_norm.weight" in sd
    for i in (1, 2):
        assert sd[f"layers.{i}.self_attn.q_proj.weight"].shape == (64, H)
        assert f"layers.{i}.input_layernorm.weight" in sd and f"layers.{i}.hidden_norm.weight" not in sd
    assert sd["mask_hidden"].shape == (3 * H,) and sd["input_norm.weight"].shape == (3 * H,)
    assert sd["lm_head.weight"].shape == (100, H) and "embed_tokens.weight" not in sd
    ptrs = {p.data_ptr() for p in d.parameters()}
    assert len(ptrs) == len(list(d.parameters()))  # no two layers share a weight


def test_with_mask_slots_by_hand(target):
    d = drafter(target)
    ids, hid, pos = torch.tensor([[11, 12, 13]]), torch.randn(1, 3, H), torch.tensor([[20, 21, 22]])
    ids2, hid2, pos2 = d.with_mask_slots(ids, hid, pos)
    assert ids2.tolist() == [[11, 12, 13, 7, 7, 7]] and pos2.tolist() == [[20, 21, 22, 23, 24, 25]]
    assert torch.equal(hid2[:, :3], hid)
    with torch.no_grad():
        want = d.fc(d.mask_hidden)  # no input norm: fc of the 3H placeholder
        assert torch.equal(hid2[0, 3:], want.expand(3, H))


def test_mask_feature_goes_through_the_input_norm(target):
    d = drafter(target, norm_before_fc=True)
    with torch.no_grad():
        assert torch.allclose(d.mask_feature(), d.fc(d.input_norm(d.mask_hidden)))
        assert torch.allclose(d.fuse([torch.ones(1, 1, H)] * 3), d.fc(d.input_norm(torch.ones(1, 1, 3 * H))))


def test_a_draft_is_K_distributions_that_read_no_drafted_token(target):
    """The K logits of one call: the real slot's, then the mask slots'; changing the last real token
    changes them (they read it), and their keys leave the cache."""
    d = drafter(target)
    ids, hid = torch.tensor([[20, 21, 22, 23, 24]]), torch.randn(1, 5, H)
    pos = torch.arange(5)[None]
    with torch.no_grad():
        cache = d.new_cache()
        logits = d.draft(ids, hid, pos, cache)
        assert logits.shape == (1, 4, 100) and len(cache) == 5  # the mask slots' keys were dropped
        other = d.draft(torch.tensor([[20, 21, 22, 23, 99]]), hid, pos, d.new_cache())
    assert not torch.allclose(logits, other)
    with torch.no_grad():  # the mask slots are the same K-1 columns appended to the same prefix
        full_ids, full_hid, full_pos = d.with_mask_slots(ids, hid, pos)
        from headway.heads.layers import causal_mask

        out = d(full_ids, full_hid, full_pos, causal_mask(8, 0, torch.float32, "cpu"))
        torch.testing.assert_close(d.logits(out[:, -4:]), logits)


def test_a_cached_draft_equals_a_fresh_prefill(target):
    """A decoder keeps the real slots' keys between steps: drafting after 5 cached slots + 3 new ones
    gives what one call over all 8 gives."""
    d = drafter(target, num_layers=3)
    ids, hid = torch.randint(3, V, (2, 8)), torch.randn(2, 8, H)
    pos = torch.arange(8)[None].expand(2, 8)
    with torch.no_grad():
        fresh = d.draft(ids, hid, pos, d.new_cache())
        cache = d.new_cache()
        d.draft(ids[:, :5], hid[:, :5], pos[:, :5], cache)
        stepped = d.draft(ids[:, 5:], hid[:, 5:], pos[:, 5:], cache)
    assert len(cache) == 8 and all(len(c) == 8 for c in cache.layers)
    torch.testing.assert_close(stepped, fresh, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("own", [False, True])
def test_save_load_round_trip(target, tmp_path, own):
    d = drafter(target, own_embeddings=own)
    if own:  # starts as the target's embedding, then is its own
        assert torch.equal(d.embed_tokens.weight, target.get_input_embeddings().weight)
        with torch.no_grad():
            d.embed_tokens.weight[7] += 1.0
    back = load_heads(d.save_pretrained(tmp_path / "h"), target=target)
    assert isinstance(back, PEagleDrafter) and back.config == d.config
    sd, sd2 = d.state_dict(), back.state_dict()
    assert set(sd) == set(sd2) and all(torch.equal(sd[k], sd2[k]) for k in sd)
    ids, hid, pos = torch.tensor([[7, 8, 9]]), torch.randn(1, 3, H), torch.arange(3)[None]
    with torch.no_grad():
        torch.testing.assert_close(back.draft(ids, hid, pos, back.new_cache()), d.draft(ids, hid, pos, d.new_cache()))


def test_the_config_refuses_what_cannot_be_built():
    g = LayerGeometry(H, 128, 4, 2, 16)
    base = {"hidden_size": H, "vocab_size": V, "draft_vocab_size": 100, "aux_layers": [1, 2, 3], "layer": g}
    for bad, message in (({"aux_layers": [1, 2]}, "exactly 3"), ({"num_depths": 1}, "num_depths"),
                         ({"mask_token_id": V}, "mask_token_id"), ({"draft_vocab_size": V + 1}, "draft_vocab_size"),
                         ({"num_layers": 0}, "num_layers")):
        with pytest.raises(ValueError, match=message):
            PEagleConfig(**{**base, **bad})


def test_unattached_heads_say_so(target):
    d = PEagleDrafter(drafter(target).config)
    with pytest.raises(HeadsError, match="not attached"):
        d.embed(torch.tensor([[1]]))
