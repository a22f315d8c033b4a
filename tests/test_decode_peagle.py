"""P-EAGLE and DSpark in the decoder (``PEagleProposer``; DSpark as ``DFlashProposer`` with a Markov
and a confidence head): greedy output equals the target's on every fixture architecture, one prompt
and batched, and the P-EAGLE proposer's K distributions after every step equal one fresh parallel
draft (``PEagleDrafter.draft``) over the whole accepted sequence, so its cache bookkeeping (mask
slots cropped, accepted entries appended) is checked directly, not only through the output."""

import copy

import pytest
import torch

from headway.decode import Speculator
from headway.decode.proposers import PEagleProposer, make_proposer
from headway.testing import ARCHITECTURES, MORE_ARCHITECTURES, tiny_target

from test_decode_exact import OracleProposer, make_heads, tie_free_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 16


def greedy_case(arch, n=4):
    """(model, tokenizer, n tie-free prompts, their HF greedy references)."""
    model, tok = tiny_target(arch)
    return (model, tok, *tie_free_prompts(model, tok, n, NEW, seed=11))


@pytest.mark.parametrize("arch", ARCHITECTURES + MORE_ARCHITECTURES)
def test_greedy_equals_hf_on_every_architecture(arch):
    """Random heads (the real drafter forwards on this architecture's features), a chain and a
    dynamic tree, one prompt at a time and the prompts as one batch: HF greedy, token for token."""
    model, tok, ps, refs = greedy_case(arch)
    for kind in ("peagle", "dspark"):
        heads = make_heads(kind, model)
        for shape in ("chain-4", "dynamic-4-4-12"):
            spec = Speculator(model, tok, heads, tree=shape, batch_policy="always")
            for p, ref in zip(ps, refs):
                assert spec.generate(p, max_new_tokens=NEW).ids == ref, (arch, kind, shape, p)
            out = spec.generate_batch(ps, max_new_tokens=NEW)
            assert [r.ids for r in out.rows] == refs, (arch, kind, shape, "batch")


class FreshDraftChecked:
    """Drafts the oracle's trees (accepted in part, in full or not at all) while checking, before each
    tree, that the P-EAGLE proposer's (1, K, Vd) log-probs equal one fresh ``PEagleDrafter.draft`` of
    the whole accepted sequence (the target rerun on it for the features), by ``reference`` heads."""

    def __init__(self, inner, oracle, model, reference_heads):
        self.inner, self.orc, self.model, self.ref = inner, oracle, model, reference_heads
        self.max_depth, self.feature_layers = inner.max_depth, inner.feature_layers
        self.draft_vocab_size, self.temperatures = None, None
        self.seq, self.checked = [], 0

    def prefill(self, tokens, valid, position_ids, features, first):
        self.seq = tokens[0].tolist() + [int(first[0])]
        for p in (self.inner, self.orc):
            p.prefill(tokens, valid, position_ids, features, first)

    def accept(self, paths, features, starts):
        self.seq += paths[0][1:].tolist()  # the accepted drafts, then the bonus: the next root
        for p in (self.inner, self.orc):
            p.accept(paths, features, starts)

    @torch.no_grad()
    def _fresh(self):
        d, seq = self.ref, torch.tensor([self.seq])
        hidden = self.model(seq, output_hidden_states=True).hidden_states
        L = seq.shape[1] - 1  # entries t = 0 .. L - 1 hold (x_{t+1}, f_t); the last holds the root
        fused = d.fuse([hidden[i][:, :L] for i in d.feature_layers])
        return d.draft(seq[:, 1:], fused, torch.arange(L)[None], d.new_cache()).float().log_softmax(-1)

    def root_logprobs(self):
        diff = float((self.inner.root_logprobs()[None] - self._fresh()[:, 0]).abs().max())
        whole = float((self.inner.logp - self._fresh()).abs().max())
        assert max(diff, whole) < 1e-3, f"P-EAGLE drafts differ from a fresh draft by {max(diff, whole)}"
        self.checked += 1
        return self.orc.root_logprobs()

    def expand(self, parent_rows, tokens, depth):
        return self.orc.expand(parent_rows, tokens, depth)

    def to_target_ids(self, ids):
        return ids  # the oracle drafts target ids

    def end_tree(self):
        for p in (self.inner, self.orc):
            p.end_tree()

    def select(self, keep):
        pass


def fresh_checked(spec, model, ref, prompt, reference_heads, made, seed=0):
    def new():
        inner = make_proposer(spec.heads)
        assert isinstance(inner, PEagleProposer)
        made.append(FreshDraftChecked(inner, OracleProposer(inner, ref, len(prompt), model.config.vocab_size, seed),
                                      model, reference_heads))
        return made[-1]

    return new


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_every_step_drafts_what_one_fresh_parallel_draft_does(arch):
    model, tok, ps, refs = greedy_case(arch, n=2)
    heads = make_heads("peagle", model)
    spec = Speculator(model, tok, heads, tree="chain-4")
    for i, (p, ref) in enumerate(zip(ps, refs)):
        made = []
        spec.new_proposer = fresh_checked(spec, model, ref, p, heads, made, seed=i)
        out = spec.generate(p, max_new_tokens=NEW)
        assert out.ids == ref and made[0].checked >= 4
        assert out.stats.tau > 1.5  # the oracle's drafts were accepted: entries of several tokens appended


def test_a_wrong_mask_token_is_caught():
    """The check can fail: decoding with the mask token one lower (the vLLM parity's negative control)
    drafts other distributions than the reference heads."""
    model, tok, ps, refs = greedy_case("llama", n=1)
    heads = make_heads("peagle", model)
    reference_heads = copy.deepcopy(heads)
    heads.config.mask_token_id -= 1
    spec = Speculator(model, tok, heads, tree="chain-4")
    spec.new_proposer = fresh_checked(spec, model, refs[0], ps[0], reference_heads, [])
    with pytest.raises(AssertionError, match="differ from a fresh draft"):
        spec.generate(ps[0], max_new_tokens=NEW)


def test_drafts_at_most_k_and_a_depth_cap_below_it():
    model, tok = tiny_target("llama")
    heads = make_heads("peagle", model)
    assert make_proposer(heads).max_depth == 4 and make_proposer(heads, max_depth=2).max_depth == 2
    assert Speculator(model, tok, heads, tree="chain-7").tree.depth == 4  # K is fixed at training
    assert Speculator(model, tok, heads).tree.depth == 4  # no tree given: the chain of K
