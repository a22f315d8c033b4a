"""Adaptive dynamic trees: each step verifies only the drafted nodes worth their verify cost."""

import math

import pytest
import torch

from headway.decode import Speculator
from headway.decode.args import DecodeError
from headway.decode.cost import best_size, cost_by_size, forward_cost, interpolate
from headway.decode.proposers import make_proposer
from headway.decode.shapes import DynamicShape, parse_shape
from headway.decode.trees import select_tree
from headway.testing import tiny_target

from test_decode_exact import OracleProposer, make_heads, prompts, reference, tie_free


# -- the arithmetic ------------------------------------------------------------------------------

def test_best_size_keeps_the_nodes_that_pay_for_themselves():
    gains = torch.tensor([0.9, 0.8, 0.1])
    # tokens per second for 1..4 tokens: 1/1, 1.9/1.1, 2.7/1.2, 2.8/2.0
    assert best_size(gains, torch.tensor([1.0, 1.1, 1.2, 2.0])) == 3
    # verify cost flat: every candidate adds expected tokens for free
    assert best_size(gains, torch.ones(4)) == 4
    # a second token costs double and is accepted 10% of the time: the root alone
    assert best_size(torch.tensor([0.1, 0.05]), torch.tensor([1.0, 2.0, 3.0])) == 1


def test_best_size_is_bounded_by_candidates_and_costs_and_breaks_ties_small():
    assert best_size(torch.tensor([0.5] * 10), torch.ones(3)) == 3  # no more tokens than costs given
    assert best_size(torch.tensor([0.5]), torch.ones(6)) == 2  # nor than the root and its candidates
    assert best_size(torch.empty(0), torch.ones(4)) == 1
    assert best_size(torch.zeros(3), torch.ones(4)) == 1  # nothing to gain: the smallest of equal rates


def test_cost_by_size_interpolates_and_never_decreases():
    curve = {1: 1.0, 4: 4.0, 8: 3.0}  # a dip at 8 (noise) must not make 8 tokens look cheaper than 4
    costs = cost_by_size(curve, 10)
    assert costs.shape == (10,)
    assert costs[:4].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert (costs[1:] >= costs[:-1]).all() and costs[7] == 4.0
    assert math.isclose(interpolate(curve, 16), 6.0)  # proportional past the last size


def test_adaptive_spec_reads_back_and_survives_resizing():
    shape = parse_shape("adaptive-6-5-32")
    assert isinstance(shape, DynamicShape) and shape.adaptive and shape.spec == "adaptive-6-5-32"
    assert parse_shape(shape.spec) == shape
    assert shape.with_(depth=2).adaptive and shape.with_(top_k=3).spec == "adaptive-3-5-32"
    assert not parse_shape("dynamic-6-5-32").adaptive
    assert parse_shape("adaptive").total_tokens == DynamicShape().total_tokens


class _Ids:
    def to_target_ids(self, ids):
        return ids


def test_select_tree_hands_size_for_the_probabilities_best_first_and_keeps_a_closed_tree():
    # root, two depth-1 candidates, and a child under each (cumulative log-probs)
    draft = torch.tensor([-1, 10, 11, 12, 13])
    parent = torch.tensor([-1, 0, 0, 1, 2])
    score = torch.log(torch.tensor([1.0, 0.6, 0.3, 0.5, 0.05]))
    seen = []

    def size_for(gains):
        seen.append(gains.clone())
        return 3

    tree = select_tree(draft, parent, score, 5, _Ids(), torch.tensor(7), size_for)
    assert torch.allclose(seen[0], torch.tensor([0.6, 0.5, 0.3, 0.05]))
    assert tree.tokens.tolist() == [7, 10, 12]  # the root, the best child and its child
    assert tree.buffers.parents.tolist() == [-1, 0, 1]
    one = select_tree(draft, parent, score, 5, _Ids(), torch.tensor(7), lambda g: 0)  # at least the root
    assert one.tokens.tolist() == [7]
    capped = select_tree(draft, parent, score, 3, _Ids(), torch.tensor(7), lambda g: 99)  # at most total
    assert capped.tokens.numel() == 3


# -- in the decoder ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama")


def _set_costs(spec, costs):
    spec.policy.verify_costs_by_threads[torch.get_num_threads()] = torch.as_tensor(costs, dtype=torch.float64)


def test_adaptive_trees_stay_exact_with_measured_costs(llama):
    model, tok = llama
    for kind in ("eagle1", "eagle3", "medusa"):
        spec = Speculator(model, tok, make_heads(kind, model), tree="adaptive-4-4-12")
        n = 0
        for p in prompts(tok, n=12, seed=2):
            ref = reference(model, p, 16)
            if not tie_free(model, p, ref):
                continue
            n += 1
            assert spec.generate(p, max_new_tokens=16).ids == ref, (kind, p)
        assert n >= 8
        costs = spec.policy.verify_costs(spec.runtime)  # measured on first use, for 1..12 tokens
        assert costs.shape == (12,) and (costs > 0).all() and (costs[1:] >= costs[:-1]).all()


def test_tree_size_follows_the_costs_and_the_drafts_confidence(llama):
    """Free verify tokens: every step verifies the whole budget (as dynamic-K-D-N does); costly
    ones: the root alone, i.e. plain decoding. Same output either way."""
    model, tok = llama
    V = model.config.vocab_size
    p = prompts(tok, n=1, seed=4)[0]
    ref = reference(model, p, 40)
    sizes = {}
    for name, costs in (("free", [0.0] * 12), ("steep", [i * 10.0 for i in range(12)])):
        spec = Speculator(model, tok, make_heads("eagle1", model), tree="adaptive-4-4-12")
        _set_costs(spec, costs)
        spec.new_proposer = lambda: OracleProposer(make_proposer(spec.heads), ref, len(p), V, seed=0)
        out = spec.generate(p, max_new_tokens=40)
        assert out.ids == ref, name
        stats = out.stats
        sizes[name] = stats.tree_nodes / stats.target_forwards
    assert sizes["free"] == 12  # the oracle's 4 x 4 candidates always fill the budget
    assert sizes["steep"] == 1


def test_confident_drafts_get_bigger_trees_than_unsure_ones(llama):
    """At the same costs, the oracle (its right token at ~certainty) buys more nodes per step than
    random heads, whose drafts are rarely worth a second token."""
    model, tok = llama
    V = model.config.vocab_size
    p = prompts(tok, n=1, seed=4)[0]
    ref = reference(model, p, 40)
    costs = [1.0 + 0.08 * i for i in range(12)]  # a token costs 8% of a 1-token step
    sizes = {}
    for name in ("oracle", "random"):
        spec = Speculator(model, tok, make_heads("eagle1", model), tree="adaptive-4-4-12")
        _set_costs(spec, costs)
        if name == "oracle":
            spec.new_proposer = lambda: OracleProposer(make_proposer(spec.heads), ref, len(p), V, seed=0)
        out = spec.generate(p, max_new_tokens=40)
        assert out.ids == ref
        stats = out.stats
        sizes[name] = stats.tree_nodes / stats.target_forwards
    assert sizes["oracle"] > 3 * sizes["random"], sizes


def test_forward_cost_times_each_size(llama):
    model, tok = llama
    spec = Speculator(model, tok, make_heads("eagle3", model), tree="adaptive-4-4-12")
    rng = torch.get_rng_state()
    curve = forward_cost(spec.runtime, [4, 1, 4, 12], repeats=2)
    assert sorted(curve) == [1, 4, 12] and all(t > 0 for t in curve.values())
    assert torch.equal(torch.get_rng_state(), rng)  # timing never moves a user's seeded RNG


def test_adaptive_tree_with_compile_is_refused(llama):
    model, tok = llama
    with pytest.raises(DecodeError, match="adaptive"):
        Speculator(model, tok, make_heads("eagle3", model), tree="adaptive-4-4-12", compile=True)


def test_batches_verify_an_adaptive_tree_at_its_full_budget_and_stay_exact(llama):
    model, tok = llama
    ps = [p for p in prompts(tok, n=8, seed=6)][:3]
    refs = [reference(model, p, 10) for p in ps]
    spec = Speculator(model, tok, make_heads("eagle3", model), tree="adaptive-4-4-12", batch_policy="always")
    out = spec.generate_batch(ps, max_new_tokens=10)
    checked = 0
    for row, p, ref in zip(out.rows, ps, refs):
        if tie_free(model, p, ref):
            assert row.ids == ref
            checked += 1
        assert row.stats.tree_nodes == 12 * row.stats.target_forwards  # the whole budget at every step
    assert checked >= 2
