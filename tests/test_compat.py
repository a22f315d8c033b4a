"""headway.compat: one behaviour over transformers v5 releases that take the KV cache and select
hidden states differently (5.17 reads neither ``cache=`` nor a layer list as 5.2x does)."""

import inspect

import pytest
import torch
from transformers import DynamicCache

import headway.compat as compat
from headway.compat import cache_kwarg, hidden_states_arg, selects_hidden_states
from headway.data.features import target_features
from headway.data.generation import FeatureSpec, greedy_batch
from headway.target import load_target


@pytest.fixture(params=["release", "every-layer"])
def either_way(request, monkeypatch):
    """The probed behaviour of this release, and the fallback older releases get (all hidden states)."""
    if request.param == "every-layer":
        monkeypatch.setattr(compat, "_SELECTS", False)
    return request.param


def test_the_kv_cache_goes_in_under_the_name_this_release_reads(llama_dir):
    model, _ = load_target(str(llama_dir), device="cpu")
    assert cache_kwarg() in inspect.signature(type(model).forward).parameters
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **{cache_kwarg(): cache})
        model(input_ids=torch.tensor([[4]]), use_cache=True, **{cache_kwarg(): cache})
    assert cache.get_seq_length() == 4  # an ignored kwarg would leave it empty


def test_asked_hidden_states_are_the_full_tuples_entries(llama_dir, either_way):
    model, _ = load_target(str(llama_dir), device="cpu")
    ids = torch.tensor([[5, 6, 7, 8]])
    n = model.config.num_hidden_layers
    with torch.no_grad():
        full = model(input_ids=ids, output_hidden_states=True).hidden_states
        asked = model(input_ids=ids, output_hidden_states=hidden_states_arg([1, n])).hidden_states
    assert isinstance(hidden_states_arg([1]), bool) == (not selects_hidden_states())  # the list where it works
    for i in (1, n):  # n: after the final norm, what the lm_head reads
        torch.testing.assert_close(asked[i], full[i], rtol=0, atol=0)


def test_features_and_distilled_features_do_not_depend_on_the_release(llama_dir, either_way):
    model, _ = load_target(str(llama_dir), device="cpu")
    ids, n = torch.tensor([[5, 6, 7, 8]]), model.config.num_hidden_layers
    feats = target_features(model, ids, None, [1, "final"])
    with torch.no_grad():
        full = model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(feats["hidden_states.1"], full[1], rtol=0, atol=0)
    torch.testing.assert_close(feats["final"], full[n], rtol=0, atol=0)
    spec = FeatureSpec({"1": 1}, torch.float32)
    answer = greedy_batch(model, [[5, 6, 7]], 4, [0], 0, spec)[0]
    row = torch.tensor([[5, 6, 7, *answer.tokens]])
    with torch.no_grad():
        whole = model(input_ids=row, output_hidden_states=True).hidden_states[1][0]
    torch.testing.assert_close(answer.features["1"], whole, rtol=1e-4, atol=1e-5)  # cached steps, same states


def test_the_probe_leaves_the_global_rng_where_it_was(monkeypatch):
    monkeypatch.setattr(compat, "_SELECTS", None)
    torch.manual_seed(5)
    a = torch.rand(3)
    torch.manual_seed(5)
    assert isinstance(selects_hidden_states(), bool)
    torch.testing.assert_close(torch.rand(3), a, rtol=0, atol=0)


def test_drop_last_removes_the_last_entries_with_or_without_a_layer_crop():
    """Dynamic layers crop; static layers of releases without ``crop`` step their length counter back."""
    from types import SimpleNamespace

    from headway.decode.kv import drop_last

    cache = DynamicCache()
    keys = torch.arange(2 * 7 * 4, dtype=torch.float32).view(1, 2, 7, 4)
    cache.update(keys, keys + 1, 0)
    static = SimpleNamespace(cumulative_length=torch.tensor(7))  # no crop attribute
    cache.layers.append(static)
    drop_last(cache, 3)
    assert cache.layers[0].keys.shape[2] == 4 and torch.equal(cache.layers[0].keys, keys[:, :, :4])
    assert int(static.cumulative_length) == 4
    drop_last(cache, 0)  # nothing to drop: unchanged
    assert cache.layers[0].keys.shape[2] == 4 and int(static.cumulative_length) == 4
