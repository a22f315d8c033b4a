"""Greedy speculative output must equal the target's own greedy output, token for token.

What the matrix covers (``test_random_heads_match_greedy_generate``): on llama, every head kind
(``KINDS``: Medusa, EAGLE-1, EAGLE-3, DFlash, P-EAGLE, DSpark, and the reduced-vocabulary variants)
with every tree shape (``SHAPES``: a chain, a static Medusa tree, a dynamic tree). Every other
architecture in ``ARCHITECTURES`` runs two or three kinds with every shape, at least one of them
drafting from the target's hidden features at several layers (EAGLE-3 or DFlash), and every kind
runs on at least one architecture besides llama (``ARCH_KINDS``), rather than the full product (~8
minutes of CI; P-EAGLE and DSpark on every architecture: tests/test_decode_peagle.py). Oracle drafts add long generations with real acceptance on three architectures; sampled
exactness is tests/test_decode_sampling.py's (every kind) and tests/test_decode_exact_archs.py's.
"""

import pytest
import torch

from headway.decode import Speculator
from headway.decode import kv
from headway.decode.args import DecodeError
from headway.decode.proposers import make_proposer
from headway.heads import DFlashDrafter, Eagle1Drafter, Eagle3Drafter, MedusaHeads, PEagleDrafter
from headway.testing import ARCHITECTURES, sample_texts, tiny_target

SHAPES = ["chain-4", "mc_sim_7b_63", "dynamic-4-4-12"]
KINDS = ["medusa", "eagle1", "eagle3", "dflash", "medusa-vocab", "eagle1-vocab", "dflash-vocab",
         "dflash-correction", "peagle", "dspark"]  # -vocab: a reduced draft vocabulary; -correction: DFlash with a
# path correction; peagle: P-EAGLE (K drafts in one call); dspark: DFlash with DSpark's Markov and confidence heads


def draft_vocab(model, n=200, seed=5):
    """n target ids spread over the vocabulary (not a prefix: draft id != target id)."""
    V = model.get_output_embeddings().weight.shape[0]
    return torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:n]


def make_heads(kind, model, seed=1, vocab=None):
    torch.manual_seed(seed)
    if kind.endswith("-vocab"):
        vocab = draft_vocab(model) if vocab is None else vocab
    if kind.startswith("medusa"):
        heads = MedusaHeads.for_target(model, num_heads=4, draft_vocab=vocab)
        with torch.no_grad():  # random (not zero) ResBlocks so the heads disagree with each other
            for p in heads.blocks.parameters():
                p.normal_(0, 0.05)
        return heads
    if kind.startswith("eagle1"):
        return Eagle1Drafter.for_target(model, draft_vocab=vocab)
    if kind.startswith("dflash"):  # 2 layers, a block of 5: 4 drafted depths
        heads = DFlashDrafter.for_target(model, mask_token_id=3, block_size=5, num_layers=2, draft_vocab=vocab,
                                         correction_rank=8 if kind.endswith("-correction") else 0)
        if heads.has_correction:
            with torch.no_grad():  # the correction starts at zero; random so drafts depend on the path
                heads.correction.out.weight.normal_(0, 1.0)
        return heads
    if kind == "peagle":  # 2 layers, K = 4 drafts per call
        return PEagleDrafter.for_target(model, draft_vocab_size=200, num_depths=4, num_layers=2, mask_token_id=3)
    if kind == "dspark":  # DFlash's block of 5 with DSpark's Markov and confidence heads
        heads = DFlashDrafter.for_target(model, mask_token_id=3, block_size=5, num_layers=2, markov_rank=8,
                                         confidence_head=True)
        with torch.no_grad():  # the Markov head starts at zero; random so drafts depend on the parent
            heads.markov_head.markov_w2.weight.normal_(0, 1.0)
            heads.confidence_head.proj.weight.normal_(0, 1.0)  # confidences far apart: verify lengths vary
        return heads
    return Eagle3Drafter.for_target(model, draft_vocab_size=200)


def prompts(tok, n=20, seed=0):
    """Code prefixes of varied length from real source."""
    g = torch.Generator().manual_seed(seed)
    text = "\n".join(sample_texts(60_000))
    out = []
    for _ in range(n):
        start = int(torch.randint(0, len(text) - 400, (1,), generator=g))
        length = int(torch.randint(10, 300, (1,), generator=g))
        out.append(tok(text[start:start + length])["input_ids"][:120] or [5])
    return out


@torch.no_grad()
def tie_free(model, ids, ref, eps=1e-4):
    """True when every greedy choice along the reference wins by more than ``eps`` in logit: a tree
    forward and a sequential forward differ by float rounding (~1e-7), which may flip a genuine tie."""
    logits = model(torch.tensor([ids + ref])).logits[0, len(ids) - 1:-1]  # (len(ref), V)
    top2 = logits.topk(2, dim=-1).values
    return bool((top2[:, 0] - top2[:, 1] > eps).all())


def tie_free_prompts(model, tok, want, max_new, candidates=12, seed=0):
    """``want`` prompts whose HF greedy continuations of ``max_new`` tokens are tie-free (``tie_free``),
    drawn from ``candidates`` prompts of ``prompts``, and those continuations."""
    ps, refs = [], []
    for p in prompts(tok, n=candidates, seed=seed):
        ref = reference(model, p, max_new)
        if tie_free(model, p, ref) and len(ps) < want:
            ps.append(p)
            refs.append(ref)
    assert len(ps) == want
    return ps, refs


def reference(model, ids, max_new):
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                         pad_token_id=2)
    return out[0, len(ids):].tolist()


class OracleProposer:
    """Drafts the reference continuation at rank 0 most of the time (else at rank 1), so that trees
    are accepted in part, in full, or not at all: every acceptance path of the verifier is exercised.
    A proposer of one row (a batch of several gets one per row: ``RowsProposer``)."""

    def __init__(self, inner, ref_full, prompt_len, vocab, seed=0):
        self.inner, self.ref, self.n, self.V = inner, ref_full, prompt_len, vocab
        self.max_depth = inner.max_depth
        self.feature_layers = inner.feature_layers
        self.draft_vocab_size, self.temperatures = None, None
        self.g = torch.Generator().manual_seed(seed)

    def prefill(self, tokens, valid, position_ids, features, first):
        self.root_pos = tokens.shape[1]

    def accept(self, paths, features, starts):
        self.root_pos = starts[0] + paths[0].numel() - 1

    def _dist(self, depth):
        pos = self.root_pos + depth - self.n  # index into the generated continuation
        logp = torch.randn(self.V, generator=self.g)
        if 0 <= pos < len(self.ref):
            want = self.ref[pos]
            good = torch.rand((), generator=self.g) < 0.7
            logp[want] = 20.0 if good else 10.0
            if not good:
                logp[(want + 1) % self.V] = 20.0
        return logp.log_softmax(-1)

    def root_logprobs(self):
        return self._dist(1)[None]

    def expand(self, parent_rows, tokens, depth):
        return self._dist(depth + 1).expand(*tokens.shape, -1)

    def end_tree(self):
        pass

    def select(self, keep):
        pass

    def to_target_ids(self, ids):
        return ids


@pytest.fixture(scope="module")
def models():
    return {arch: tiny_target(arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="module")
def greedy_cases(models):
    """arch -> (20 tie-free prompts, their HF greedy references), built once per architecture."""
    cache = {}

    def get(arch):
        if arch not in cache:
            model, tok = models[arch]
            ps, refs = [], []
            for p in prompts(tok, n=30):
                ref = reference(model, p, 12)
                if tie_free(model, p, ref) and len(ps) < 20:
                    ps.append(p)
                    refs.append(ref)
            cache[arch] = ps, refs
        return cache[arch]

    return get


# Besides llama (every kind), each architecture runs two kinds: at least one drafting from hidden
# features of several layers (EAGLE-3 / DFlash, the kinds whose feature taps depend on the model's
# layout), and together they run every kind once more off llama.
ARCH_KINDS = {"qwen2": ("eagle3", "medusa-vocab"), "qwen3": ("dflash-vocab", "eagle1", "dspark"),
              "mistral": ("dflash", "eagle1-vocab"), "phi3": ("eagle3", "medusa"),
              "gpt_neox": ("eagle3", "dflash-correction", "peagle")}
MATRIX = [("llama", kind) for kind in KINDS] + [(arch, kind) for arch, kinds in ARCH_KINDS.items() for kind in kinds]
assert {a for a, _ in MATRIX} == set(ARCHITECTURES) and {k for a, k in MATRIX if a != "llama"} == set(KINDS)


@pytest.mark.parametrize("arch,kind", MATRIX)
def test_random_heads_match_greedy_generate(models, greedy_cases, arch, kind):
    model, tok = models[arch]
    heads = make_heads(kind, model)
    ps, refs = greedy_cases(arch)
    assert len(ps) == 20  # float near-ties are rare: at most 10 of 30 candidates dropped
    for shape in SHAPES:
        spec = Speculator(model, tok, heads, tree=shape)
        for p, ref in zip(ps, refs):
            out = spec.generate(p, max_new_tokens=12)
            assert out.ids == ref, (arch, kind, shape, p)
            assert out.stats.new_tokens == len(ref)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_neox"])
def test_oracle_drafts_exercise_acceptance_and_stay_exact(models, arch):
    model, tok = models[arch]
    V = model.config.vocab_size
    taus = []
    for kind, shape in [("medusa", "mc_sim_7b_63"), ("eagle1", "dynamic-4-5-16"), ("eagle3", "chain-5")]:
        spec = Speculator(model, tok, make_heads(kind, model), tree=shape)
        for i, p in enumerate(prompts(tok, n=6, seed=3)):
            ref = reference(model, p, 100)  # long: the cache is grown and compacted many times
            spec.new_proposer = lambda: OracleProposer(make_proposer(spec.heads), ref, len(p), V, seed=i)
            out = spec.generate(p, max_new_tokens=100)
            assert out.ids == ref, (arch, kind, shape, i)
            taus.append(out.stats.tau)
            assert sum(out.stats.accepted_per_depth[:1]) > 0
    assert min(taus) > 1.5  # drafts were really accepted, often several per step


@pytest.mark.parametrize("kind", ["medusa", "eagle1"])
def test_reduced_vocab_drafts_the_same_trees_as_the_full_vocab(models, kind):
    """Same weights, and a draft vocabulary holding every token the full-vocabulary heads ever
    drafted on these prompts (~80 ids left out, so draft ids and target ids differ): rank-based
    trees must then be identical, so each prompt accepts exactly as many drafts. A wrong draft ->
    target mapping drafts other tokens and accepts differently."""
    model, tok = models["llama"]
    full = make_heads(kind, model)
    drafted: set[int] = set()

    def recording():
        proposer = make_proposer(full)
        to_target = proposer.to_target_ids

        def record(ids):
            out = to_target(ids)
            drafted.update(out.flatten().tolist())
            return out

        proposer.to_target_ids = record
        return proposer

    spec = Speculator(model, tok, full, tree="mc_sim_7b_63")
    spec.new_proposer = recording
    ps = prompts(tok, n=8)
    ref = [spec.generate(p, max_new_tokens=12) for p in ps]
    vocab = torch.tensor(sorted(drafted))
    V = model.config.vocab_size
    assert 0 < V - vocab.numel() and sum(sum(o.stats.accepted_per_depth) for o in ref) > 0
    reduced = make_heads(f"{kind}-vocab", model, vocab=vocab)
    if kind == "medusa":
        reduced.blocks.load_state_dict(full.blocks.state_dict())
    else:
        reduced.load_state_dict({**full.state_dict(), "d2t": reduced.d2t, "t2d": reduced.t2d})
    assert make_proposer(reduced).draft_vocab_size == vocab.numel()
    spec = Speculator(model, tok, reduced, tree="mc_sim_7b_63")
    for p, r in zip(ps, ref):
        out = spec.generate(p, max_new_tokens=12)
        assert out.ids == r.ids == reference(model, p, 12)
        assert out.stats.accepted_per_depth == r.stats.accepted_per_depth, (kind, p)


def test_prompt_near_context_limit(models):
    model, tok = models["llama"]
    limit = model.config.max_position_embeddings
    text = "\n".join(sample_texts(80_000))
    ids = tok(text)["input_ids"][: limit - 10]
    ref = reference(model, ids, 10)
    for kind, shape in [("medusa", "mc_sim_7b_63"), ("eagle3", "dynamic-4-4-12")]:
        spec = Speculator(model, tok, make_heads(kind, model), tree=shape)
        spec.new_proposer = lambda: OracleProposer(make_proposer(spec.heads), ref, len(ids), model.config.vocab_size)
        out = spec.generate(ids, max_new_tokens=10)  # fills the context window: the tree shrinks near its end
        assert out.ids == ref and len(ids) + len(out.ids) == limit and out.stats.stopped_by == "length"
        with pytest.raises(DecodeError, match="more than the target's context"):  # never fewer tokens in silence
            spec.generate(ids, max_new_tokens=50)


def test_stops_at_eos(models):
    model, tok = models["llama"]
    p = prompts(tok, n=1)[0]
    ref = reference(model, p, 30)
    eos = ref[7]
    model.generation_config.eos_token_id = eos
    try:
        spec = Speculator(model, tok, make_heads("eagle1", model), tree="chain-4")
        spec.new_proposer = lambda: OracleProposer(make_proposer(spec.heads), ref, len(p), model.config.vocab_size)
        out = spec.generate(p, max_new_tokens=30)
        assert out.ids == ref[: ref.index(eos) + 1] and out.stats.stopped_by == "eos"
    finally:
        model.generation_config.eos_token_id = 1


def test_corrupted_mask_is_caught(models, monkeypatch):
    """The comparison can fail: a tree mask that lets nodes see their siblings breaks exactness."""
    model, tok = models["llama"]
    heads = make_heads("medusa", model)
    ps = prompts(tok, n=5)
    real = kv.tree_mask

    def leaky(visible, prefix_len, dtype, kv_len=None):
        return real(torch.ones_like(visible), prefix_len, dtype, kv_len)

    monkeypatch.setattr(kv, "tree_mask", leaky)
    spec = Speculator(model, tok, heads, tree="mc_sim_7b_63")
    mismatches = sum(spec.generate(p, max_new_tokens=16).ids != reference(model, p, 16) for p in ps)
    assert mismatches >= 1
