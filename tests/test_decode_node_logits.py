"""Verification projects the target's lm_head only at the nodes it reads, and stays exact."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, Gemma2Config

from headway.decode import Speculator
from headway.decode.node_logits import PREFETCH_ROWS, NodeLogits, head_matches_logits
from headway.decode.proposers import make_proposer
from headway.decode.sampling import SamplingParams
from headway.decode.tree import TreeBuffers, first_children
from headway.decode.verify import verify_greedy, verify_greedy_walk
from headway.testing import tiny_target, tiny_tokenizer
from test_decode_exact import OracleProposer, make_heads, prompts, reference

# root; 1, 2 at depth 1; 3 under 1; 4 under 3; 5 under 2
PARENTS = torch.tensor([-1, 0, 0, 1, 3, 2])


class Capture:
    """A step hook keeping each step's node logits."""

    def __init__(self, out):
        self.out = out

    def on_step(self, batch, scored, verdicts, new, times):
        self.out.extend(scored.node_logits)


def test_rows_are_projected_when_read_with_the_first_child_chain():
    torch.manual_seed(0)
    head = nn.Linear(8, 11, bias=False)
    hidden = torch.randn(6, 8)
    full = head(hidden).detach()
    lazy = NodeLogits(TreeBuffers.build(PARENTS), hidden=hidden, head=head)
    assert lazy.lazy and lazy.projections == 0
    torch.testing.assert_close(lazy[0], full[0], rtol=0, atol=1e-6)
    assert lazy.projections == 1 and set(lazy.rows) == {0, 1, 3, 4}  # the root and its first-child chain
    lazy[3], lazy[4]
    assert lazy.projections == 1  # already there
    torch.testing.assert_close(lazy[2], full[2], rtol=0, atol=1e-6)
    assert lazy.projections == 2 and set(lazy.rows) == {0, 1, 2, 3, 4, 5}
    torch.testing.assert_close(lazy.all(), full, rtol=0, atol=1e-6)
    assert lazy.projections == 2  # nothing left to project
    eager = NodeLogits(TreeBuffers.build(PARENTS), full=full)
    assert not eager.lazy and torch.equal(eager[5], full[5]) and eager.projections == 0
    with pytest.raises(ValueError, match="either"):
        NodeLogits(TreeBuffers.build(PARENTS))


def test_first_children_in_rank_order_once_per_shape():
    assert first_children(PARENTS) == {0: 1, 1: 3, 3: 4, 2: 5}
    b = TreeBuffers.build(PARENTS)
    assert b.first_child is b.first_child  # computed once: a static shape's buffers are reused every step


def test_prefetch_is_capped():
    chain = torch.arange(-1, 19)  # a chain of 20 nodes
    lazy = NodeLogits(TreeBuffers.build(chain), hidden=torch.randn(20, 4), head=nn.Linear(4, 3))
    lazy[0]
    assert sorted(lazy.rows) == list(range(PREFETCH_ROWS))


def random_tree(g, n, vocab):
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    tokens = [0] * n
    for p in set(parents[1:]):  # siblings carry distinct tokens, as every proposer's top-k does
        kids = [i for i in range(1, n) if parents[i] == p]
        for i, t in zip(kids, torch.randperm(vocab, generator=g)[:len(kids)].tolist()):
            tokens[i] = t
    return torch.tensor(parents), torch.tensor(tokens)


def test_walk_verdict_equals_the_vectorised_one():
    g = torch.Generator().manual_seed(0)
    V, accepted_some = 7, 0
    for trial in range(300):
        parents, tokens = random_tree(g, int(torch.randint(2, 14, (1,), generator=g)), V)
        b = TreeBuffers.build(parents)
        logits = torch.randn(parents.numel(), V, generator=g)
        for i in range(1, parents.numel()):  # plant agreement often, so that long paths are accepted
            if torch.rand((), generator=g) < 0.6:
                logits[parents[i], tokens[i]] = 10.0 + torch.rand((), generator=g)
        want = verify_greedy(tokens[None], b.parents[None], b.retrieve[None], logits[None])[0]
        bound = TreeBuffers.build(parents, levels=int(b.depth.max()) + 1)  # every node's path, a deeper bound
        also = verify_greedy(tokens[None], bound.parents[None], bound.retrieve[None], logits[None])[0]
        assert also.nodes.tolist() == want.nodes.tolist() and int(also.bonus) == int(want.bonus), trial
        lazy = NodeLogits(b, hidden=logits, head=nn.Identity())
        got = verify_greedy_walk(tokens, b, lazy)
        assert got.nodes.tolist() == want.nodes.tolist() and int(got.bonus) == int(want.bonus), trial
        assert len(lazy.rows) < parents.numel() or parents.numel() <= PREFETCH_ROWS or got.accepted > 0
        accepted_some += got.accepted > 1
    assert accepted_some > 30  # multi-node paths were checked, not only rejections at the root


class RowCounter:
    """Counts the rows that go through the target's lm_head."""

    def __init__(self, model):
        self.rows = self.calls = 0
        model.get_output_embeddings().register_forward_hook(self)

    def __call__(self, module, args, out):
        n = args[0].reshape(-1, args[0].shape[-1]).shape[0]
        self.rows += n
        self.calls += n > 0  # a forward with logits_to_keep = no rows still calls it, on none


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_lazy_verification_is_exact_and_projects_fewer_rows(arch):
    model, tok = tiny_target(arch)
    V = model.config.vocab_size
    ps = prompts(tok, n=4, seed=3)
    refs = [reference(model, p, 40) for p in ps]
    counter = RowCounter(model)
    rows, outs, projections = {}, {}, []
    for mode in ("auto", "all"):
        spec = Speculator(model, tok, make_heads("eagle1", model), tree="dynamic-4-5-16", verify_logits=mode)
        outs[mode] = []
        if mode == "auto":  # keep every step's scored tree, to count its on-demand projections
            spec.hooks.append(Capture(projections))
        spec.runtime.uses_lazy_logits()  # its one-off check projects a probe
        counter.rows = 0
        for i, (p, ref) in enumerate(zip(ps, refs)):
            spec.new_proposer = lambda: OracleProposer(make_proposer(spec.heads), ref, len(p), V, seed=i)
            out = spec.generate(p, max_new_tokens=40)
            assert out.ids == ref, (arch, mode, i)
            st = out.stats
            assert st.tree_nodes == 16 * st.target_forwards
            assert (st.projected_rows < st.tree_nodes) if mode == "auto" else (st.projected_rows == st.tree_nodes)
            assert ("lm_head over" in st.summary()) == (mode == "auto")
            outs[mode].append(out.ids)
        rows[mode] = counter.rows
        assert spec.runtime.lazy_logits is (mode == "auto")
    assert outs["auto"] == outs["all"]
    assert all(s.lazy for s in projections)
    per_step = [s.projections for s in projections]
    assert max(per_step) >= 2 and sum(per_step) / len(per_step) < 2  # off-chain acceptances cost a second one
    prefill = 4  # one row per prompt (logits_to_keep=1)
    assert rows["auto"] == prefill + sum(len(s.rows) for s in projections)  # nothing else projected
    assert rows["all"] == prefill + 16 * len(projections)  # the same trees, every node projected
    # the oracle puts the right token at rank 1 a third of the time, so walks often leave the
    # first-child chain; trained drafts leave it less (rank 0 carries most acceptance)
    assert rows["auto"] < 0.75 * rows["all"], rows


def test_small_trees_and_chains_project_every_row_in_the_forward():
    """Up to PREFETCH_ROWS nodes cost one projection either way, and a walk off the first-child chain
    would cost a second: small trees and chains keep the forward's own projection."""
    model, tok = tiny_target("llama")
    small = Speculator(model, tok, make_heads("eagle3", model), tree="static:[[0],[1],[2],[0,0]]")
    with torch.inference_mode():
        assert not small.draft_and_score(small.start(small.encode([5, 6, 7]), *_greedy())).node_logits.lazy
    spec = Speculator(model, tok, make_heads("eagle3", model), tree="chain-4")
    out = spec.generate([5, 6, 7], max_new_tokens=6)
    assert out.ids == reference(model, [5, 6, 7], 6)
    with torch.inference_mode():
        state = spec.start(spec.encode([5, 6, 7]), *_greedy())
        assert not spec.draft_and_score(state).node_logits.lazy  # a chain: nothing to skip
        params, gen = SamplingParams(temperature=1.0), torch.Generator().manual_seed(0)
        sampled = spec.draft_and_score(spec.start(spec.encode([5, 6, 7]), params, gen), params, gen)
        assert sampled.draft_probs is not None and not sampled.node_logits.lazy
    assert spec.runtime.uses_lazy_logits()  # while trees of this target would be verified lazily


def _greedy():
    return SamplingParams(), torch.Generator()


def test_transformed_logits_keep_the_full_forward():
    """Gemma-2 soft-caps its logits after the lm_head: the on-demand rows would differ, so the check
    refuses them and every node is projected by the model itself; output stays the target's."""
    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, final_logit_softcapping=5.0, max_position_embeddings=128,
                       bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(0)
    gemma = AutoModelForCausalLM.from_config(cfg).eval()
    probe = torch.tensor([[1, 2, 3, 4]])
    assert not head_matches_logits(gemma, cfg.num_hidden_layers, probe)
    llama, _ = tiny_target("llama")
    assert head_matches_logits(llama, llama.config.num_hidden_layers, probe)
    spec = Speculator(gemma, tiny_tokenizer(), make_heads("eagle1", gemma), tree="dynamic-3-3-8")
    out = spec.generate([0, 5, 9], max_new_tokens=8)
    assert spec.runtime.lazy_logits is False and out.ids == reference(gemma, [0, 5, 9], 8)


def test_verify_logits_is_checked():
    model, tok = tiny_target("llama")
    with pytest.raises(Exception, match="verify_logits must be auto or all"):
        Speculator(model, tok, make_heads("eagle1", model), verify_logits="some")


def test_bench_counts_projections_as_target_time_not_forwards():
    """The on-demand rows run the target's lm_head outside its forward; a drafter borrowing the same
    lm_head (EAGLE-1) still counts as drafting when it calls it."""
    from headway.bench.methods import Probe

    model, tok = tiny_target("llama")
    spec = Speculator(model, tok, make_heads("eagle1", model), tree="dynamic-3-3-8")
    lm_head = model.get_output_embeddings()
    probe = Probe(model, [lm_head], [spec.runtime.projection])
    try:
        spec.runtime.projection(torch.randn(3, model.config.hidden_size))
        assert probe.time["target"] > 0 and probe.time["drafter"] == 0 and probe.target_forwards == 0
        lm_head(torch.randn(3, model.config.hidden_size))
        assert probe.time["drafter"] > 0
        model(torch.tensor([[3, 4]]))
        assert probe.target_forwards == 1
    finally:
        probe.close()
    assert sum(p.numel() for p in spec.runtime.projection.parameters()) == 0  # the target's weights, not its own
