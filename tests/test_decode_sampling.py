"""Sampling is exact: speculative samples follow the target's processed distribution.

A 6-token vocabulary makes the distribution over the first three generated tokens enumerable
(216 sequences). Each sample runs the real decoder parts (proposer, tree, target verify forward,
KV commit, ``verify_sample`` with fresh random draws); decode states are memoised by the emitted
prefix (there are at most 42), so 5,000 samples per head kind and tree shape take seconds.

Sample counts are set by the biased controls, which run at the same counts as the exact tests they
guard: at 5,000 memoised samples a verifier that forgets to renormalise scores p ~ 1e-114 (the test
asks < 1e-6), typical acceptance p = 0 to float precision; at 3,000 sampled-chain samples a chain
verifier whose bonus skips the residual scores p ~ 3e-48, and at 5,000 single draws p ~ 1e-111.
HEADWAY_FULL_SAMPLING=1 runs every case at the earlier, longer counts.
"""

import itertools
import math
import os
import zlib

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from headway.decode import Speculator
from headway.decode.node_logits import NodeProbs
from headway.decode.sampling import (SamplingParams, processed_probs, sample_from, verify_sample,
                                     verify_sampled_chain)
from headway.decode.tree import TreeBuffers
from headway.heads import DFlashDrafter, Eagle1Drafter, Eagle3Drafter, MedusaHeads, PEagleDrafter
from headway.testing import tiny_tokenizer

FULL = os.environ.get("HEADWAY_FULL_SAMPLING") == "1"
V, N_TOKENS = 6, 3
N_SAMPLES = 20_000 if FULL else 5_000  # memoised draws per case (see the docstring for the controls' power)
N_CHAIN = 10_000 if FULL else 3_000  # sampled-chain draws: every one drafts anew (~10 ms each)
PROMPT = [0, 3, 2, 5]


@pytest.fixture(scope="module")
def target():
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, bos_token_id=0, eos_token_id=None,
                      pad_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)  # spread but not flat next-token distributions
    return model


DRAFT_VOCAB = torch.tensor([1, 2, 3, 5])  # the -vocab kinds draft over these 4 of the 6 tokens


def heads_for(kind, model):
    torch.manual_seed(1)
    vocab = DRAFT_VOCAB if kind.endswith("-vocab") else None
    if kind.startswith("medusa"):
        h = MedusaHeads.for_target(model, num_heads=3, draft_vocab=vocab)
        with torch.no_grad():
            for p in h.parameters():
                p.normal_(0, 0.5)
        return h
    if kind.startswith("eagle1"):
        return Eagle1Drafter.for_target(model, draft_vocab=vocab)
    if kind.startswith("dflash"):
        h = DFlashDrafter.for_target(model, mask_token_id=4, block_size=4, num_layers=1, draft_vocab=vocab,
                                     correction_rank=4 if kind.endswith("-correction") else 0)
        if h.has_correction:
            with torch.no_grad():  # random, so each depth's draft depends on the path above it
                h.correction.out.weight.normal_(0, 1.0)
        return h
    if kind == "dspark":  # random Markov and confidence heads: drafts depend on the parent token
        h = DFlashDrafter.for_target(model, mask_token_id=4, block_size=4, num_layers=1, markov_rank=4,
                                     confidence_head=True)
        with torch.no_grad():
            h.markov_head.markov_w2.weight.normal_(0, 1.0)
            h.confidence_head.proj.weight.normal_(0, 1.0)
        return h
    if kind == "peagle":
        h = PEagleDrafter.for_target(model, draft_vocab_size=4, num_depths=3, num_layers=2, mask_token_id=4)
    else:
        h = Eagle3Drafter.for_target(model, draft_vocab_size=4)
    h.set_draft_vocab(DRAFT_VOCAB)
    return h


@torch.no_grad()
def exact_distribution(model, params):
    """P(x1, x2, x3 | prompt) under the processed target distribution, by enumeration."""
    probs = {}
    for seq in itertools.product(range(V), repeat=N_TOKENS - 1):
        ids = torch.tensor([PROMPT + list(seq)])
        step = processed_probs(model(ids).logits[0, -N_TOKENS:], params)  # (3, V)
        for x3 in range(V):
            p = step[0, seq[0]] * step[1, seq[1]] * step[2, x3]
            probs[seq + (x3,)] = float(p)
    return probs


def first_token_states(spec, params, gen):
    """Draw the first token with the decoder's own sampler; prefill once per distinct first token
    (memoised in ``states``). Returns the drawing function."""
    ids = torch.tensor([PROMPT])
    logits0 = spec.target(ids).logits[0, -1]

    def draw(states):
        prefix = (int(spec._choose(logits0, params, gen)),)
        if prefix not in states:
            spec_choose = spec._choose
            spec._choose = lambda *a, x=prefix[0]: torch.tensor(x)
            states[prefix] = spec.start(ids, params, gen)
            spec._choose = spec_choose
        return prefix

    return draw


@torch.no_grad()
def speculative_samples(spec, params, n, seed, verifier=verify_sample, lazy=False):
    """``lazy``: the verifier reads each node's distribution from the on-demand lm_head rows
    (``NodeProbs``), as the decoder does for trees on CPU, instead of all of them."""
    gen = torch.Generator().manual_seed(seed)
    first_state = first_token_states(spec, params, gen)
    states, scored_memo, counts = {}, {}, {}
    for _ in range(n):
        prefix = first_state(states)
        while len(prefix) < N_TOKENS:
            if prefix not in scored_memo:
                st = spec.fork(states[prefix])
                scored = spec.draft_and_score(st)
                # the full rows' distribution depends only on the prefix: processed once per prefix
                scored_memo[prefix] = (st, scored, None if lazy else processed_probs(scored.logits, params))
            st, scored, full_probs = scored_memo[prefix]
            u = torch.rand(scored.tree.buffers.size + 1, generator=gen)
            # the lazy rows are read anew by every walk, as the decoder reads them
            probs = NodeProbs(scored.node_logits, lambda x: processed_probs(x, params)) if lazy else full_probs
            verdict = verifier(scored.tree.tokens, scored.tree.buffers, probs, u[:-1], u[-1])
            new = scored.tree.tokens[verdict.nodes[1:]].tolist() + [int(verdict.bonus)]
            nxt = prefix + tuple(new)
            if len(nxt) < N_TOKENS and nxt not in states:
                twin = spec.fork(st)
                assert spec.commit(twin, scored, verdict) == new and tuple(twin.rows[0].emitted) == nxt
                states[nxt] = twin
            prefix = nxt
        key = prefix[:N_TOKENS]
        counts[key] = counts.get(key, 0) + 1
    return counts


def chi_square_pvalue(counts, probs, n):
    """Pearson chi-square over the enumerated sequences, pooling cells with expected count < 5."""
    cells, pool_obs, pool_exp = [], 0.0, 0.0
    for key, p in probs.items():
        e, o = p * n, counts.get(key, 0)
        if e < 5:
            pool_obs, pool_exp = pool_obs + o, pool_exp + e
        else:
            cells.append((o, e))
    if pool_exp > 0:
        cells.append((pool_obs, pool_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def total_variation(counts, probs, n):
    return 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in probs.items())


def tv_bound(probs, n):
    """Mean total variation of ``n`` exact draws (normal approximation, E|X/n - p| per cell) plus
    0.01, about five standard deviations of that sum: an exact sampler stays under it, while a
    bias of a few percent on any likely sequence does not."""
    mean = 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * n)) for p in probs.values())
    return mean + 0.01


def assert_follows(counts, probs, n):
    """``n`` sampled sequences pass the chi-square test and stay under the total-variation bound."""
    assert chi_square_pvalue(counts, probs, n) > 1e-3, total_variation(counts, probs, n)
    assert total_variation(counts, probs, n) < tv_bound(probs, n)


def seed_of(*parts) -> int:
    # str hashes change per process (PYTHONHASHSEED); a checksum keeps each case's draws fixed
    return zlib.crc32("/".join(parts).encode()) % 1000


KINDS = ("medusa", "eagle1", "eagle3", "dflash", "medusa-vocab", "eagle1-vocab", "dflash-vocab", "dflash-correction",
         "peagle", "dspark")
# Every kind with the dynamic tree (the most branching), every shape with one Medusa and one EAGLE
# kind: 13 cases keep CI's suite short; HEADWAY_FULL_SAMPLING=1 runs all 30 (and all 10 sampled chains).
CASES = [(kind, shape) for kind in KINDS for shape in ("chain-3", "mc_sim_7b_63", "dynamic-3-3-8")
         if FULL or shape == "dynamic-3-3-8" or kind in ("medusa", "eagle3")]


@pytest.mark.parametrize("kind,shape", CASES)
def test_speculative_sampling_matches_target(target, kind, shape):
    params = SamplingParams(temperature=1.0)
    spec = Speculator(target, tiny_tokenizer(), heads_for(kind, target), tree=shape)
    probs = exact_distribution(target, params)
    counts = speculative_samples(spec, params, N_SAMPLES, seed=seed_of(kind, shape))
    assert sum(counts.values()) == N_SAMPLES
    p = chi_square_pvalue(counts, probs, N_SAMPLES)
    assert p > 1e-3, (kind, shape, p, total_variation(counts, probs, N_SAMPLES))
    assert total_variation(counts, probs, N_SAMPLES) < tv_bound(probs, N_SAMPLES)


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_sampling_from_on_demand_rows_matches_target(target, kind):
    """The decoder's CPU path: a tree's verify forward skips the lm_head and ``verify_sample`` reads
    the rows of the nodes it walks through (``NodeLogits`` / ``NodeProbs``)."""
    params = SamplingParams(temperature=1.0)
    spec = Speculator(target, tiny_tokenizer(), heads_for(kind, target), tree="dynamic-3-3-10")
    with torch.inference_mode():
        state = spec.start(torch.tensor([PROMPT]), params, torch.Generator())
        assert spec.draft_and_score(state).node_logits.lazy  # more nodes than one projection's rows
    probs = exact_distribution(target, params)
    counts = speculative_samples(spec, params, N_SAMPLES, seed=seed_of(kind, "lazy"), lazy=True)
    assert chi_square_pvalue(counts, probs, N_SAMPLES) > 1e-3
    assert total_variation(counts, probs, N_SAMPLES) < tv_bound(probs, N_SAMPLES)


def test_processed_distribution_with_top_k_and_top_p(target):
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    spec = Speculator(target, tiny_tokenizer(), heads_for("eagle1", target), tree="dynamic-3-3-8")
    probs = exact_distribution(target, params)
    counts = speculative_samples(spec, params, N_SAMPLES, seed=7)
    assert chi_square_pvalue(counts, probs, N_SAMPLES) > 1e-3
    assert all(probs[k] > 0 for k in counts)  # nothing outside top-k / top-p is ever emitted


def test_biased_verifier_is_rejected(target):
    """The same test fails a verifier that forgets to renormalise after a rejection."""
    params = SamplingParams(temperature=1.0)
    spec = Speculator(target, tiny_tokenizer(), heads_for("medusa", target), tree="mc_sim_7b_63")
    probs = exact_distribution(target, params)

    def biased(*args):
        return verify_sample(*args, renormalise=False)

    counts = speculative_samples(spec, params, N_SAMPLES, seed=3, verifier=biased)
    assert chi_square_pvalue(counts, probs, N_SAMPLES) < 1e-6


def test_verify_sample_by_hand():
    # root with children tokens 2 then 4; target at the root: p = [.1, 0, .3, 0, .6, 0]
    b = TreeBuffers.build(torch.tensor([-1, 0, 0]))
    tokens = torch.tensor([0, 2, 4])
    probs = torch.tensor([[0.1, 0, 0.3, 0, 0.6, 0], [0, 1.0, 0, 0, 0, 0], [0, 0, 0, 1.0, 0, 0]])
    # u for node 1 = 0.2 < 0.3: accept token 2; then node 1 has no children: bonus from probs[1] -> 1
    v = verify_sample(tokens, b, probs, torch.tensor([0, 0.2, 0.0]), torch.tensor(0.5))
    assert v.nodes.tolist() == [0, 1] and int(v.bonus) == 1
    # reject 2 (u=0.5 >= .3), residual [.1,0,0,0,.6,0]/.7: accept 4 iff u < .6/.7
    v = verify_sample(tokens, b, probs, torch.tensor([0, 0.5, 0.8]), torch.tensor(0.5))
    assert v.nodes.tolist() == [0, 2] and int(v.bonus) == 3
    v = verify_sample(tokens, b, probs, torch.tensor([0, 0.5, 0.9]), torch.tensor(0.5))
    assert v.nodes.tolist() == [0] and int(v.bonus) == 0  # residual is only token 0
    assert int(sample_from(torch.tensor([0.0, 0.25, 0.75]), torch.tensor(0.3))) == 2


def test_typical_acceptance_is_lossy_and_labelled(target):
    """Typical acceptance accepts more than exact sampling, and the statistical test catches its bias."""
    from headway.decode.sampling import verify_typical

    params = SamplingParams(temperature=1.0)
    spec = Speculator(target, tiny_tokenizer(), heads_for("medusa", target), tree="mc_sim_7b_63", typical=(0.09, 0.3))
    assert "LOSSY" in Speculator.__init__.__doc__

    def typical(tokens, b, probs, u_accept, u_bonus):
        return verify_typical(tokens, b, probs, 0.09, 0.3, u_bonus)

    probs = exact_distribution(target, params)
    counts = speculative_samples(spec, params, N_SAMPLES, seed=5, verifier=typical)
    assert chi_square_pvalue(counts, probs, N_SAMPLES) < 1e-6
    out = spec.generate(PROMPT, max_new_tokens=12, temperature=1.0, seed=0)
    assert len(out.ids) >= 1 and out.stats.target_forwards >= 1


# ---- sampled drafts (chains at temperature > 0) -----------------------------------------------


def first_token_counts(p, q, n, seed, residual=True):
    """Draw x ~ q, verify one sampled draft against p, count the first emitted token."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.numel())
    probs = torch.stack([p, p])  # the target at the root and at the draft node
    for _ in range(n):
        x = sample_from(q, torch.rand((), generator=gen))
        u = torch.rand(3, generator=gen)
        v = verify_sampled_chain(torch.tensor([0, int(x)]), probs, q[None], u[:2], u[2], residual=residual)
        first = int(x) if v.accepted else int(v.bonus)
        counts[first] += 1
    return counts


def test_sampled_draft_verification_emits_the_target_distribution():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    q = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2])  # far from p, even mass where p has none
    n = N_SAMPLES  # the biased control below scores p ~ 1e-111 at 5,000
    counts = first_token_counts(p, q, n, seed=0)
    probs = {(i,): float(p[i]) for i in range(5)}
    got = {(i,): int(counts[i]) for i in range(5)}
    assert counts[4] == 0  # a token the target never emits is never emitted
    assert chi_square_pvalue(got, probs, n) > 1e-3
    biased = first_token_counts(p, q, n, seed=0, residual=False)  # bonus from p instead of (p - q)+
    assert chi_square_pvalue({(i,): int(biased[i]) for i in range(5)}, probs, n) < 1e-6


def test_sampled_drafts_accept_sum_of_min_p_q():
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    q = torch.tensor([0.3, 0.3, 0.3, 0.1])
    gen = torch.Generator().manual_seed(1)
    n, accepted = 20_000, 0
    for _ in range(n):
        x = sample_from(q, torch.rand((), generator=gen))
        u = torch.rand(3, generator=gen)
        accepted += verify_sampled_chain(torch.tensor([0, int(x)]), torch.stack([p, p]), q[None], u[:2], u[2]).accepted
    assert abs(accepted / n - float(torch.minimum(p, q).sum())) < 0.015  # 0.9, against p(top-1) = 0.4


@torch.no_grad()
def fresh_draft_samples(spec, params, n, seed, verify):
    """Like ``speculative_samples``, but every sample drafts anew (drafts are random);
    ``verify(scored, u) -> Verdict``."""
    gen = torch.Generator().manual_seed(seed)
    first_state = first_token_states(spec, params, gen)
    states, counts = {}, {}
    for _ in range(n):
        prefix = first_state(states)
        while len(prefix) < N_TOKENS:
            st = spec.fork(states[prefix])
            scored = spec.draft_and_score(st, params, gen)
            verdict = verify(scored, torch.rand(scored.tree.buffers.size + 1, generator=gen))
            new = scored.tree.tokens[verdict.nodes[1:]].tolist() + [int(verdict.bonus)]
            nxt = prefix + tuple(new)
            if len(nxt) < N_TOKENS and nxt not in states:
                spec.commit(st, scored, verdict)
                states[nxt] = st
            prefix = nxt
        key = prefix[:N_TOKENS]
        counts[key] = counts.get(key, 0) + 1
    return counts


def sampled_chain_samples(spec, params, n, seed, verifier=verify_sampled_chain):
    def verify(scored, u):
        assert scored.draft_probs is not None
        return verifier(scored.tree.tokens, processed_probs(scored.logits, params), scored.draft_probs, u[:-1], u[-1])
    return fresh_draft_samples(spec, params, n, seed, verify)


def smoothed_heads(kind, model):
    """Heads whose draft distribution overlaps the target's, so drafts are often accepted."""
    h = heads_for(kind, model)
    if kind in ("eagle3", "peagle"):
        with torch.no_grad():
            h.lm_head.weight.mul_(0.1)
    if kind.startswith("dflash") or kind == "dspark":
        with torch.no_grad():
            h.norm.weight.mul_(0.1)
    return h


@pytest.mark.parametrize("kind", KINDS if FULL else ("eagle3", "medusa-vocab", "dflash", "dflash-correction", "peagle",
                                                     "dspark"))
def test_sampled_chain_drafts_match_target(target, kind):
    params = SamplingParams(temperature=1.0)
    spec = Speculator(target, tiny_tokenizer(), smoothed_heads(kind, target), tree="chain-3")
    probs = exact_distribution(target, params)
    n = N_CHAIN  # every sample drafts anew, so fewer than the memoised tests above
    seed = {"medusa": 12, "eagle1": 13, "eagle3": 14, "medusa-vocab": 15, "eagle1-vocab": 16, "dflash": 17,
            "dflash-vocab": 18, "dflash-correction": 19, "peagle": 22, "dspark": 23}[kind]
    assert_follows(sampled_chain_samples(spec, params, n, seed=seed), probs, n)


def test_sampled_chain_drafts_biased_verifier_is_caught(target):
    params = SamplingParams(temperature=1.0)
    spec = Speculator(target, tiny_tokenizer(), heads_for("eagle1", target), tree="chain-3")
    probs = exact_distribution(target, params)
    n = N_CHAIN  # the exact chains' count: this control shows their power (p ~ 3e-48 here at 3,000)

    def biased(*a):
        return verify_sampled_chain(*a, residual=False)

    counts = sampled_chain_samples(spec, params, n, seed=11, verifier=biased)
    assert chi_square_pvalue(counts, probs, n) < 1e-6


@torch.no_grad()
def test_sampled_drafts_are_used_only_for_chains_at_temperature(target):
    spec = Speculator(target, tiny_tokenizer(), heads_for("eagle1", target), tree="dynamic-3-3-8")
    st = spec.start(torch.tensor([PROMPT]), SamplingParams(1.0), torch.Generator().manual_seed(0))
    assert spec.draft_and_score(spec.fork(st), SamplingParams(1.0), torch.Generator()).draft_probs is None
    chain_spec = Speculator(target, tiny_tokenizer(), heads_for("eagle1", target), tree="chain-3")
    st = chain_spec.start(torch.tensor([PROMPT]), SamplingParams(0.0), torch.Generator())
    assert chain_spec.draft_and_score(chain_spec.fork(st), SamplingParams(0.0), torch.Generator()).draft_probs is None
    off = Speculator(target, tiny_tokenizer(), heads_for("eagle1", target), tree="chain-3", sampled_drafts=False)
    st = off.start(torch.tensor([PROMPT]), SamplingParams(1.0), torch.Generator())
    assert off.draft_and_score(off.fork(st), SamplingParams(1.0), torch.Generator()).draft_probs is None


# ---- sampled children in static trees (fork-N above T=0) ----------------------------------------


def test_verify_sample_with_a_drawn_child_by_hand():
    # root's children: token 2 (deterministic top-1), then token 4 drawn from q = [0, 0, 0, .5, .5, 0]
    # (the drafter's distribution less token 2). Target at the root: p = [.1, 0, .3, 0, .6, 0].
    b = TreeBuffers.build(torch.tensor([-1, 0, 0]))
    tokens = torch.tensor([0, 2, 4])
    probs = torch.tensor([[0.1, 0, 0.3, 0, 0.6, 0], [0, 1.0, 0, 0, 0, 0], [0, 0, 0, 1.0, 0, 0]])
    q = torch.tensor([0, 0, 0, 0.5, 0.5, 0])
    # reject 2 (u = .5 >= .3): residual r~ = [1/7, 0, 0, 0, 6/7, 0]; accept 4 iff u < min(1, (6/7) / .5) = 1
    v = verify_sample(tokens, b, probs, torch.tensor([0, 0.5, 0.99]), torch.tensor(0.5), proposals={2: q})
    assert v.nodes.tolist() == [0, 2] and int(v.bonus) == 3
    # a drawn 3 (q = .5, r~(3) = 0) is always rejected; the bonus comes from max(r~ - q, 0) = [1/7, 0, 0, 0, 5/14, 0]
    tokens3 = torch.tensor([0, 2, 3])
    # (sum 1/2): u = .39 lands past 1/7 (.39 * .5 = .195) on token 4, u = .2 on token 0
    v = verify_sample(tokens3, b, probs, torch.tensor([0, 0.5, 0.0]), torch.tensor(0.39), proposals={2: q})
    assert v.nodes.tolist() == [0] and int(v.bonus) == 4
    v = verify_sample(tokens3, b, probs, torch.tensor([0, 0.5, 0.0]), torch.tensor(0.2), proposals={2: q})
    assert v.nodes.tolist() == [0] and int(v.bonus) == 0
    # without the drawn child's residual step the bonus would come from [1/7, 0, 0, 0, 6/7, 0]: u = .39 -> 4 too,
    # but u = .15 -> 4 against 0 here (.15 * .5 = .075 < 1/7)
    v = verify_sample(tokens3, b, probs, torch.tensor([0, 0.5, 0.0]), torch.tensor(0.15), proposals={2: q})
    assert int(v.bonus) == 0


def one_depth_counts(p, q, n, seed, first_drawn=True, renormalise=True):
    """One depth with two children by hand: the first drawn from q (``first_drawn``, as ``fork-1``
    draws it) or q's top-1, the second drawn from q less the first; count the first emitted token
    and how often a draft is accepted."""
    gen = torch.Generator().manual_seed(seed)
    b = TreeBuffers.build(torch.tensor([-1, 0, 0]))
    probs = torch.stack([p, p, p])
    counts, accepted = torch.zeros(p.numel()), 0
    for _ in range(n):
        c = int(sample_from(q, torch.rand((), generator=gen))) if first_drawn else int(q.argmax())
        rest = q.clone()
        rest[c] = 0
        rest /= rest.sum()
        x = int(sample_from(rest, torch.rand((), generator=gen)))
        u = torch.rand(4, generator=gen)
        tokens = torch.tensor([0, c, x])
        proposals = {1: q, 2: rest} if first_drawn else {2: rest}
        v = verify_sample(tokens, b, probs, u[:3], u[3], renormalise=renormalise, proposals=proposals)
        counts[int(tokens[v.nodes[1]]) if v.accepted else int(v.bonus)] += 1
        accepted += v.accepted
    return counts, accepted / n


@pytest.mark.parametrize("first_drawn", [True, False])
def test_two_children_emit_the_target_and_accept_more_than_one_sampled_draft(first_drawn):
    p = torch.tensor([0.3, 0.35, 0.2, 0.1, 0.05, 0.0])
    q = torch.tensor([0.6, 0.1, 0.1, 0.1, 0.0, 0.1])  # sharper than p, on the wrong top token, mass where p has none
    n = N_SAMPLES
    counts, rate = one_depth_counts(p, q, n, seed=0, first_drawn=first_drawn)
    probs = {(i,): float(p[i]) for i in range(6)}
    assert counts[5] == 0
    assert chi_square_pvalue({(i,): int(counts[i]) for i in range(6)}, probs, n) > 1e-3
    chain_rate = float(torch.minimum(p, q).sum())  # .6: one sampled draft
    if not first_drawn:  # top-1 first: p(c) + sum_{x != c} min(p(x), q(x) (1 - p(c)) / (1 - q(c))) = .75
        assert abs(rate - 0.75) < 0.025
    assert rate > chain_rate + 0.05
    biased, _ = one_depth_counts(p, q, n, seed=0, first_drawn=first_drawn, renormalise=False)
    assert chi_square_pvalue({(i,): int(biased[i]) for i in range(6)}, probs, n) < 1e-6


def fork_samples(spec, params, n, seed, renormalise=True):
    """``sampled_chain_samples`` for a fork, whose children are drawn (``tree.proposals``)."""
    def verify(scored, u):
        tree = scored.tree
        assert scored.draft_probs is None and tree.proposals
        return verify_sample(tree.tokens, tree.buffers, processed_probs(scored.logits, params), u[:-1], u[-1],
                             renormalise=renormalise, proposals=tree.proposals)
    return fresh_draft_samples(spec, params, n, seed, verify)


@pytest.mark.parametrize("kind,shape", [("eagle3", "fork-2"), ("medusa-vocab", "fork-2"),
                                        ("dflash-correction", "fork-2"), ("eagle1", "static:[[0],[1],[0,0],[0,1]]"),
                                        ("dspark", "fork-2")])
def test_drawn_children_match_target(target, kind, shape):
    params = SamplingParams(temperature=1.0)
    spec = Speculator(target, tiny_tokenizer(), smoothed_heads(kind, target), tree=shape)
    assert_follows(fork_samples(spec, params, N_CHAIN, seed=seed_of(kind, shape)),
                   exact_distribution(target, params), N_CHAIN)


def test_drawn_children_biased_verifier_is_caught(target):
    params = SamplingParams(temperature=1.0)
    spec = Speculator(target, tiny_tokenizer(), heads_for("eagle1", target), tree="fork-2")
    probs = exact_distribution(target, params)
    counts = fork_samples(spec, params, N_CHAIN, seed=21, renormalise=False)
    assert chi_square_pvalue(counts, probs, N_CHAIN) < 1e-6


@torch.no_grad()
def test_drawn_children_only_above_temperature_and_never_a_sibling(target):
    spec = Speculator(target, tiny_tokenizer(), heads_for("eagle1", target), tree="fork-2")
    st = spec.start(torch.tensor([PROMPT]), SamplingParams(0.0), torch.Generator())
    assert spec.draft_and_score(spec.fork(st), SamplingParams(0.0), torch.Generator()).tree.proposals is None
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(50):
        tree = spec.draft_and_score(spec.fork(st), SamplingParams(1.0), gen).tree
        assert sorted(tree.proposals) == [1, 2, 3, 4]  # fork-2: the chain 1 -> 3, siblings 2 and 4
        assert tree.buffers.parents.tolist() == [-1, 0, 0, 1, 1]
        tok = tree.tokens.tolist()
        assert tok[2] != tok[1] and tok[4] != tok[3]  # a drawn child never repeats its sibling
        assert all(float(tree.proposals[i][tok[i]]) > 0 for i in (1, 2, 3, 4))
        assert float(tree.proposals[2][tok[1]]) == 0 and float(tree.proposals[4][tok[3]]) == 0  # less the first
        seen.add(tok[1])
    assert len(seen) > 1  # drawn, not ranked
    # top_k=1 leaves the drafter's q one token: the sibling has no mass to draw from and takes the
    # best other token, deterministically (no proposal), never its sibling's
    tree = spec.draft_and_score(spec.fork(st), SamplingParams(1.0, top_k=1), gen).tree
    tok = tree.tokens.tolist()
    assert sorted(tree.proposals) == [1, 3] and tok[2] != tok[1] and tok[4] != tok[3]
    chained = Speculator(target, tiny_tokenizer(), heads_for("eagle1", target), tree="static:[[0],[1],[0,0]]")
    st = chained.start(torch.tensor([PROMPT]), SamplingParams(1.0), torch.Generator())
    assert chained.draft_and_score(chained.fork(st), SamplingParams(1.0), gen).tree.proposals is None  # not a fork
    off = Speculator(target, tiny_tokenizer(), heads_for("eagle1", target), tree="fork-2", sampled_drafts=False)
    st = off.start(torch.tensor([PROMPT]), SamplingParams(1.0), torch.Generator())
    assert off.draft_and_score(off.fork(st), SamplingParams(1.0), torch.Generator()).tree.proposals is None
