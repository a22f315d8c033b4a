"""Grouped-query tree attention: the same attention as transformers' sdpa path, switched on only
around the decoder's forwards."""

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from headway.compat import cache_kwarg
from headway.decode import Speculator
from headway.decode import attention
from headway.decode.attention import grouped_attention, tree_attention
from headway.decode.tree import tree_mask
from headway.testing import tiny_target

from test_decode_exact import make_heads, prompts, reference, tie_free


def _tree_mask(q, prefix, seed=0):
    """A random tree's ancestor mask (each node sees some earlier nodes and itself), as an additive mask."""
    g = torch.Generator().manual_seed(seed)
    visible = (torch.rand(q, q, generator=g) < 0.4).tril()
    visible.fill_diagonal_(True)
    return tree_mask(visible, prefix, torch.float32)


@pytest.mark.parametrize("heads,kv_heads,q", [(9, 3, 24), (4, 2, 5), (8, 1, 7), (6, 6, 3)])
def test_grouped_attention_equals_sdpa_on_repeated_heads(heads, kv_heads, q):
    g = torch.Generator().manual_seed(1)
    prefix, d = 40, 16
    query = torch.randn(2, heads, q, d, generator=g)
    key, value = (torch.randn(2, kv_heads, prefix + q, d, generator=g) for _ in range(2))
    mask = torch.cat([_tree_mask(q, prefix, seed=s) for s in (0, 1)])  # (2, 1, q, prefix + q): a mask per row
    rep = heads // kv_heads
    ref = F.scaled_dot_product_attention(query, key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1),
                                         attn_mask=mask, scale=0.3).transpose(1, 2)
    got = grouped_attention(query, key, value, mask, 0.3)
    assert got.shape == (2, q, heads, d) and got.is_contiguous()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama")  # 4 query heads on 2 key/value heads


@torch.inference_mode()
def test_tree_forward_logits_match_sdpa_and_the_config_is_restored(llama):
    model, tok = llama
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    ids = torch.tensor([prompts(tok, n=1, seed=1)[0][:30]])
    prefix, q = ids.shape[1], 9
    tree = torch.randint(3, model.config.vocab_size, (1, q))
    mask = _tree_mask(q, prefix)
    pos = (prefix + torch.arange(q))[None]
    calls = []
    real = attention.grouped_attention
    attention.grouped_attention = lambda *a: calls.append(1) or real(*a)
    try:
        out = {}
        for on in (False, True):
            cache = DynamicCache(config=model.config)
            with tree_attention(model, enabled=on):
                model(input_ids=ids, **{cache_kwarg(): cache}, use_cache=True)  # prefill: no mask -> sdpa's own path
                out[on] = model(input_ids=tree, **{cache_kwarg(): cache}, use_cache=True, attention_mask=mask,
                                position_ids=pos).logits
            assert model.config._attn_implementation == "sdpa"
    finally:
        attention.grouped_attention = real
    assert len(calls) == model.config.num_hidden_layers  # the tree forward only, every layer
    torch.testing.assert_close(out[True], out[False], atol=1e-5, rtol=1e-5)


def test_context_restores_after_an_error_and_leaves_other_implementations_alone(llama):
    model, _ = llama
    with pytest.raises(RuntimeError):
        with tree_attention(model):
            assert model.config._attn_implementation == attention.NAME
            raise RuntimeError
    assert model.config._attn_implementation == "sdpa"
    eager, _ = tiny_target("llama")
    eager.set_attn_implementation("eager")
    with tree_attention(eager):
        assert eager.config._attn_implementation == "eager"


def test_decoding_with_grouped_attention_stays_exact_and_matches_sdpa_trees(llama):
    model, tok = llama
    spec = Speculator(model, tok, make_heads("eagle3", model), tree="dynamic-4-4-12")
    assert spec.runtime.grouped_attention
    checked = 0
    for p in prompts(tok, n=10, seed=7):
        ref = reference(model, p, 16)
        if not tie_free(model, p, ref):
            continue
        spec.runtime.grouped_attention = True
        on = spec.generate(p, max_new_tokens=16)
        spec.runtime.grouped_attention = False
        off = spec.generate(p, max_new_tokens=16)
        assert on.ids == ref == off.ids
        assert on.stats.target_forwards == off.stats.target_forwards  # the same trees were accepted
        checked += 1
    assert checked >= 6
    assert model.config._attn_implementation == "sdpa"
