"""Sampling in batches is exact: every row of ``generate_batch`` follows the target's processed
distribution, with its own parameters and generator, whatever the other rows do (padding, other
prompts, greedy neighbours, plain steps the batch policy takes). The checks of
``test_decode_sampling.py`` (enumerated distribution over three tokens of a 6-token vocabulary,
chi-square and total variation), run through the whole batched decoder; biased verifiers are caught."""

import copy
import itertools
import math

import pytest
import torch

from headway.decode import Speculator
from headway.decode import step as step_module
from headway.decode.sampling import SamplingParams, verify_sample, verify_sampled_chain
from headway.testing import tiny_tokenizer

from test_decode_sampling import (N_TOKENS, PROMPT, chi_square_pvalue, heads_for, smoothed_heads, target,  # noqa: F401
                                  total_variation, tv_bound)

OTHER = [0, 1, 4, 2, 5, 3, 1]  # a longer prompt: rows of PROMPT are left-padded beside it
ROWS = 16


@torch.no_grad()
def exact(model, prompt, params):
    from headway.decode.sampling import processed_probs

    V = model.config.vocab_size
    probs = {}
    for seq in itertools.product(range(V), repeat=N_TOKENS - 1):
        step = processed_probs(model(torch.tensor([prompt + list(seq)])).logits[0, -N_TOKENS:], params)
        for x3 in range(V):
            probs[seq + (x3,)] = float(step[0, seq[0]] * step[1, seq[1]] * step[2, x3])
    return probs


def tv_limit(probs, n):
    """The mean total variation of ``n`` exact draws plus five of its standard deviations (cells
    independent, normal approximation: sd of |X/n - p| is sqrt(p(1-p)/n * (1 - 2/pi)))."""
    spread = 0.5 * math.sqrt(sum(p * (1 - p) for p in probs.values()) * (1 - 2 / math.pi) / n)
    return tv_bound(probs, n) - 0.01 + 5 * spread


def no_eos(model):
    """Three tokens always: no token of the 6 stops a row."""
    model = copy.copy(model)
    model.generation_config = copy.deepcopy(model.generation_config)
    model.generation_config.eos_token_id = []
    return model


def batched_counts(spec, n_per_prompt, params, seed, greedy_rows=0):
    """Rows alternate PROMPT / OTHER; the first ``greedy_rows`` rows decode at temperature 0."""
    counts = {tuple(PROMPT): {}, tuple(OTHER): {}}
    greedy = []
    calls = 2 * n_per_prompt // (ROWS - greedy_rows)
    for c in range(calls):
        prompts = [PROMPT if i % 2 == 0 else OTHER for i in range(ROWS)]
        temps = [0.0 if i < greedy_rows else params.temperature for i in range(ROWS)]
        out = spec.generate_batch(prompts, max_new_tokens=N_TOKENS, temperature=temps, top_k=params.top_k,
                                  top_p=params.top_p, seed=[seed * 100_000 + c * ROWS + i for i in range(ROWS)])
        for i, (p, row) in enumerate(zip(prompts, out.rows)):
            assert len(row.ids) == N_TOKENS
            if i < greedy_rows:
                greedy.append((tuple(p), row.ids))
            else:
                cell = counts[tuple(p)]
                cell[tuple(row.ids)] = cell.get(tuple(row.ids), 0) + 1
    return counts, greedy


def alternating(spec):
    """Draft at every other step (deterministic, unlike the measured policy): plain steps, and the
    drafter catching up after them, inside every generation."""
    turns = itertools.cycle([True, False])
    spec.policy.speculate = lambda batch_size, sampling=False: next(turns)
    return spec


CASES = [("eagle3", "dynamic-3-3-8", False), ("medusa", "mc_sim_7b_63", False), ("eagle3", "chain-3", False),
         ("dflash", "chain-3", False), ("eagle3", "chain-3", True), ("dflash-correction", "dynamic-3-3-8", False),
         ("eagle3", "fork-2", True), ("dflash-correction", "fork-2", False)]


@pytest.mark.parametrize("kind,shape,plain_steps", CASES)
def test_batched_sampling_matches_target(target, kind, shape, plain_steps):
    model = no_eos(target)
    params = SamplingParams(temperature=1.0)
    heads = smoothed_heads(kind, model) if shape in ("chain-3", "fork-2") else heads_for(kind, model)
    spec = Speculator(model, tiny_tokenizer(), heads, tree=shape, sampling_tree=shape, batch_policy="always")
    if plain_steps:
        alternating(spec)
    n = 2_000
    counts, _ = batched_counts(spec, n, params, seed=len(kind) + len(shape) + plain_steps)
    for prompt, cell in counts.items():
        probs = exact(model, list(prompt), params)
        total = sum(cell.values())
        assert total >= n * 0.9
        assert chi_square_pvalue(cell, probs, total) > 1e-3, (kind, shape, prompt)
        assert total_variation(cell, probs, total) < tv_limit(probs, total)


def test_batched_rows_keep_their_own_parameters(target):
    """Greedy rows beside sampled ones stay the target's greedy output; top-k rows never leave the top-k."""
    model = no_eos(target)
    spec = alternating(Speculator(model, tiny_tokenizer(), heads_for("eagle3", model), tree="chain-3",
                                  sampling_tree="chain-3"))
    params = SamplingParams(temperature=0.8, top_k=2)
    counts, greedy = batched_counts(spec, 400, params, seed=5, greedy_rows=4)
    for prompt, got in greedy:
        ids = torch.tensor([list(prompt)])  # an explicit mask: HF would mask every id equal to the pad id
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == ref
    for prompt, cell in counts.items():
        probs = exact(model, list(prompt), params)
        assert all(probs[k] > 0 for k in cell)  # nothing outside the top-2 at any depth


def test_batched_seeds_replay(target):
    model = no_eos(target)
    spec = Speculator(model, tiny_tokenizer(), heads_for("eagle3", model), tree="dynamic-3-3-8", batch_policy="always")
    a = spec.generate_batch([PROMPT, OTHER] * 3, max_new_tokens=N_TOKENS, temperature=1.0, seed=3)
    b = spec.generate_batch([PROMPT, OTHER] * 3, max_new_tokens=N_TOKENS, temperature=1.0, seed=3)
    assert [r.ids for r in a.rows] == [r.ids for r in b.rows]


@pytest.mark.parametrize("shape", ["dynamic-3-3-8", "chain-3", "fork-2"])
def test_biased_batched_verifiers_are_caught(target, monkeypatch, shape):
    model = no_eos(target)
    params = SamplingParams(temperature=1.0)
    if shape == "chain-3":
        monkeypatch.setattr(step_module, "verify_sampled_chain", lambda *a: verify_sampled_chain(*a, residual=False))
        heads = heads_for("eagle1", model)
    else:
        monkeypatch.setattr(step_module, "verify_sample", lambda *a, **k: verify_sample(*a, **k, renormalise=False))
        heads = heads_for("medusa" if shape == "dynamic-3-3-8" else "eagle1", model)
    # every step drafts: the biased verifier runs every step
    spec = Speculator(model, tiny_tokenizer(), heads, tree=shape, sampling_tree=shape, batch_policy="always")
    counts, _ = batched_counts(spec, 2_000, params, seed=9)
    cell = counts[tuple(PROMPT)]
    total = sum(cell.values())
    assert chi_square_pvalue(cell, exact(model, PROMPT, params), total) < 1e-6


def test_generate_batch_checks_per_row_arguments(target):
    spec = Speculator(target, tiny_tokenizer(), heads_for("eagle3", target))
    with pytest.raises(ValueError, match="temperature has 2 values for 3 prompts"):
        spec.generate_batch([PROMPT] * 3, max_new_tokens=3, temperature=[1.0, 0.5])
    with pytest.raises(ValueError, match="top_p"):
        spec.generate_batch([PROMPT] * 2, max_new_tokens=3, temperature=1.0, top_p=[1.0, 0.0])
