"""DSpark in the decoder: the Markov head biases every node by its parent token, and the confidence
head chooses how many of a chain's drafts each step verifies (``trees.sized_chain``), which never
changes the output: greedy equals HF greedy with drafts really accepted and lengths really varying,
and sampling follows the target's distribution (the chi-square test, with its control)."""

import pytest
import torch

from headway.decode import Speculator
from headway.decode.proposers import DFlashProposer, make_proposer
from headway.decode.sampling import SamplingParams, verify_sample
from headway.heads.dflash import survival
from headway.testing import tiny_target, tiny_tokenizer

from test_decode_exact import OracleProposer, make_heads, tie_free_prompts
from test_decode_sampling import (N_SAMPLES, assert_follows, chi_square_pvalue, exact_distribution, heads_for,
                                  speculative_samples)
from test_decode_sampling import target as sampling_target  # noqa: F401  (the 6-token target fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 40


@pytest.fixture(scope="module")
def llama():
    model, tok = tiny_target("llama")
    return (model, tok, *tie_free_prompts(model, tok, 3, NEW, candidates=10, seed=5))


def steep_costs(spec, per_node=0.45):
    """A verify-cost curve (seconds, 1 + per_node per extra token) that makes the chain's length turn on
    the confidences (the rest of a step, milliseconds here, hardly counts against it)."""
    most = spec.tree.size
    spec.policy.verify_costs_by_threads[torch.get_num_threads()] = \
        1.0 + per_node * torch.arange(most, dtype=torch.float64)


class Sizes:
    """A step hook recording every step's verified tree size."""

    def __init__(self):
        self.sizes = []

    def on_step(self, batch, scored, verdicts, new, times):
        if scored is not None:
            self.sizes += [t.buffers.size for t in scored.drafts.trees]


def oracle_dspark(spec, ref, prompt, seed):
    """The real DSpark proposer (its block, Markov bias and confidence head run every step) whose trees
    are an oracle's, accepted in part, in full or not at all: the confidence cuts accepted drafts too."""
    def new():
        inner = make_proposer(spec.heads)
        orc = OracleProposer(inner, ref, len(prompt), spec.target.config.vocab_size, seed)
        prefill, accept, root = inner.prefill, inner.accept, inner.root_logprobs

        def both(real, fake):
            return lambda *a: (real(*a), fake(*a))[1]

        inner.prefill, inner.accept = both(prefill, orc.prefill), both(accept, orc.accept)
        inner.root_logprobs = lambda: (root(), orc.root_logprobs())[1]
        inner.expand, inner.to_target_ids = orc.expand, (lambda ids: ids)
        return inner

    return new


def test_confidence_chosen_lengths_change_nothing(llama):
    model, tok, ps, refs = llama
    heads = make_heads("dspark", model)
    runs = {}
    for sizing in (True, False):
        spec = Speculator(model, tok, heads, tree="chain-4", confidence_sizing=sizing)
        assert spec.policy.confidence_sizing is sizing
        steep_costs(spec)
        rec = Sizes()
        spec.hooks.append(rec)
        taus = []
        for i, (p, ref) in enumerate(zip(ps, refs)):
            assert spec.generate(p, max_new_tokens=NEW).ids == ref, (sizing, "random drafts", i)
            spec.new_proposer = oracle_dspark(spec, ref, p, i)
            out = spec.generate(p, max_new_tokens=NEW)
            assert out.ids == ref, (sizing, "oracle drafts", i)
            taus.append(out.stats.tau)
            del spec.new_proposer
        runs[sizing] = rec.sizes, taus
    sized, full = runs[True][0], runs[False][0]
    assert set(full) == {5}  # off: the whole chain every step
    assert len(set(sized)) >= 3 and min(sized) < 5 and 5 in sized  # on: the length really varies per step
    assert min(runs[True][1]) > 1.2  # drafts accepted under the cut too


def test_sampled_chains_and_batches_verify_the_whole_chain(llama):
    """A cut chosen from drawn tokens would bias which drafts are tested, and a batch's verify pads to its
    widest row: both verify every draft (as a batch does an adaptive tree's TOTAL)."""
    model, tok, ps, refs = llama
    spec = Speculator(model, tok, make_heads("dspark", model), tree="chain-4", batch_policy="always")
    steep_costs(spec)
    rec = Sizes()
    spec.hooks.append(rec)
    spec.generate(ps[0], max_new_tokens=12, temperature=1.0, seed=0)
    out = spec.generate_batch(ps, max_new_tokens=12)
    assert [r.ids for r in out.rows] == [r[:12] for r in refs]
    assert set(rec.sizes) == {5}
    spec.generate(ps[0], max_new_tokens=12)
    assert min(rec.sizes) < 5  # the same speculator does cut a greedy prompt's chain
    assert not Speculator(model, tok, make_heads("dflash", model), tree="chain-4").policy.confidence_sizing


@torch.no_grad()
def test_markov_bias_per_node_and_survival_along_the_chain(llama):
    model, tok, ps, _ = llama
    d = make_heads("dspark", model)
    p = make_proposer(d)
    assert isinstance(p, DFlashProposer) and p.confident
    ids = torch.tensor([ps[0]])
    out = model(ids, output_hidden_states=True)
    feats = [out.hidden_states[i] for i in d.feature_layers]
    first = out.logits[:, -1].argmax(-1)
    p.prefill(ids, torch.ones_like(ids, dtype=torch.bool), torch.arange(ids.shape[1])[None], feats, first)
    root_lp = p.root_logprobs()  # (1, V)
    h = d.block_outputs(first, torch.tensor([ids.shape[1]]), d.context_kv(d.fuse(feats), torch.arange(ids.shape[1])[None]))
    want = d.logits(h[:, 0], parents=first).float().log_softmax(-1)
    assert (root_lp - want).abs().max() < 1e-4
    parents = torch.tensor([[7, 100]])
    lp = p.expand(torch.zeros(1, 2, dtype=torch.long), parents, 1)  # (1, 2, V): depth 2 after two tokens
    for j in range(2):
        assert (lp[0, j] - d.logits(h[0, 1], parents=parents[0, j]).float().log_softmax(-1)).abs().max() < 1e-4
    assert (lp[0, 0] - lp[0, 1]).abs().max() > 0.1  # the parent token moves the distribution
    chain = torch.tensor([[int(first), 7, 100, 9, 11]])
    conf = d.confidence(h[:, :4], chain[:, :4])  # (1, 4)
    assert torch.allclose(p.chain_survival(chain), survival(conf)) and torch.allclose(survival(conf), conf.cumprod(-1))


def test_sampling_with_confidence_chosen_lengths_matches_target(sampling_target):  # noqa: F811
    """Deterministic chains (the memoised draws verify the greedy tree) cut by the confidence head:
    the target's distribution; the control (a verifier that forgets to renormalise) is rejected."""
    params = SamplingParams(temperature=1.0)
    heads = heads_for("dspark", sampling_target)
    H = sampling_target.config.hidden_size
    with torch.no_grad():  # a confidence from the token before each slot alone: the cut varies with the root
        w = heads.confidence_head.proj.weight  # (1, H + r)
        w[:, :H].zero_()
        w[:, H:].normal_(0, 2.0, generator=torch.Generator().manual_seed(0))
        heads.confidence_head.proj.bias.zero_()
    spec = Speculator(sampling_target, tiny_tokenizer(), heads, tree="chain-3")
    steep_costs(spec, per_node=0.4)
    sizes, real = set(), spec.draft_and_score

    def recording(*a, **kw):
        scored = real(*a, **kw)
        sizes.add(scored.tree.buffers.size)
        return scored

    spec.draft_and_score = recording
    probs = exact_distribution(sampling_target, params)
    assert_follows(speculative_samples(spec, params, N_SAMPLES, seed=31), probs, N_SAMPLES)
    assert len(sizes) >= 2 and min(sizes) < 4  # lengths were really chosen
    biased = speculative_samples(spec, params, N_SAMPLES, seed=31, verifier=lambda *a: verify_sample(*a, renormalise=False))
    assert chi_square_pvalue(biased, probs, N_SAMPLES) < 1e-6


@pytest.mark.parametrize("flag,expected", [([], True), (["--no-confidence-sizing"], False)])
def test_bench_eval_and_generate_pass_the_confidence_sizing_switch(tmp_path, llama, flag, expected):
    """``--no-confidence-sizing`` reaches the decoder from generate, bench and eval (a DSpark head's chains
    are then verified whole: what #62 compares sized chains with)."""
    from headway.bench.configs import BenchConfig
    from headway.bench.eval_configs import EvalConfig
    from headway.bench.run import headway_methods
    from headway.config import parse_cli
    from headway.decode.cli import GenerateConfig

    model, tok, *_ = llama
    folder = make_heads("dspark", model).save_pretrained(tmp_path / "dspark")
    bench = parse_cli(BenchConfig, ["--target", "unused", "--heads", str(folder), "--tree", "chain-4", *flag])
    assert bench.runtime_kwargs()["confidence_sizing"] is expected
    [method] = headway_methods(model, tok, bench)
    assert method.speculator.policy.confidence_sizing is expected
    ev = parse_cli(EvalConfig, ["spec-bench", "--target", "unused", "--heads", str(folder), *flag])
    assert ev.bench_config().confidence_sizing is expected
    gen = parse_cli(GenerateConfig, ["--target", "unused", "--heads", str(folder), "--prompt", "x", *flag])
    assert gen.runtime_kwargs()["confidence_sizing"] is expected
