"""The exactness matrix on mixture-of-experts and Gemma-style targets (``MORE_ARCHITECTURES``).

Mixtral (every layer sliding), Qwen3-MoE, Gemma 2 (sliding and global layers alternating, soft-capped
attention and final logits, eager attention) and Gemma 3 (sliding then global, sdpa). The fixtures'
sliding window (``SLIDING_WINDOW``, 12) is shorter than every prompt + generation here, so a decoder
that ignored it, or a cache that dropped entries past it, would change the output.
"""

import types

import pytest
import torch
from transformers import AutoModelForCausalLM

from headway.decode import Speculator
from headway.decode import kv as kv_module
from headway.decode.args import DecodeError
from headway.decode.kv import layer_masks, new_cache, window_mask
from headway.decode.node_logits import head_matches_logits
from headway.decode.proposers import make_proposer
from headway.decode.sampling import SamplingParams, verify_sample
from headway.testing import MORE_ARCHITECTURES, tiny_config, tiny_target, tiny_tokenizer

from test_decode_exact import OracleProposer, make_heads, reference, tie_free_prompts
from test_decode_sampling import (V, chi_square_pvalue, exact_distribution, heads_for, seed_of,
                                  speculative_samples, total_variation, tv_bound)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on a shared 2-core machine

KINDS = ("medusa", "eagle1", "eagle3", "dflash", "peagle", "dspark")
SHAPES = ("chain-4", "mc_sim_7b_63", "dynamic-4-4-12")
NEW = 20  # tokens per generation: prompts run from 10 to 120 tokens, all past the window by the end


@pytest.fixture(scope="module")
def cases():
    """arch -> (model, tokenizer, prompts, tie-free HF greedy references)."""
    out = {}
    for arch in MORE_ARCHITECTURES:
        model, tok = tiny_target(arch)
        out[arch] = (model, tok, *tie_free_prompts(model, tok, 2, NEW, candidates=6, seed=3))
    return out


def oracle(spec, ref, prompt, seed):
    return lambda: OracleProposer(make_proposer(spec.heads), ref, len(prompt), spec.target.config.vocab_size, seed)


@pytest.mark.parametrize("arch", MORE_ARCHITECTURES)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_hf_generate(cases, arch, kind):
    """Random heads (the real drafter forward on this architecture; few drafts accepted) on one
    prompt, oracle drafts (accepted in part, in full or not at all) on two, every tree shape: HF
    greedy, token for token."""
    model, tok, ps, refs = cases[arch]
    heads = make_heads(kind, model)
    taus = []
    for shape in SHAPES:
        spec = Speculator(model, tok, heads, tree=shape)
        assert spec.generate(ps[0], max_new_tokens=NEW).ids == refs[0], (arch, kind, shape, "random heads")
        oracle_spec = Speculator(model, tok, heads, tree=shape)
        for i, (p, ref) in enumerate(zip(ps, refs)):
            oracle_spec.new_proposer = oracle(oracle_spec, ref, p, i)
            out = oracle_spec.generate(p, max_new_tokens=NEW)
            assert out.ids == ref, (arch, kind, shape, i, "oracle")
            taus.append(out.stats.tau)
    assert min(taus) > 1.5  # drafts really were accepted, several per step


@pytest.mark.parametrize("arch", ["mixtral", "gemma2"])
def test_static_cache_is_exact(cases, arch):
    """A StaticCache of a sliding-window target: every layer a full static one, the window in the mask."""
    model, tok, ps, refs = cases[arch]
    spec = Speculator(model, tok, make_heads("eagle3", model), tree="dynamic-4-4-12", static_cache=True)
    for i, (p, ref) in enumerate(zip(ps, refs)):
        spec.new_proposer = oracle(spec, ref, p, i)
        assert spec.generate(p, max_new_tokens=NEW).ids == ref, (arch, i)


@pytest.mark.parametrize("arch", MORE_ARCHITECTURES)
def test_batched_rows_equal_unbatched_and_hf(cases, arch):
    model, tok, ps, refs = cases[arch]
    ps, refs = ps + [[5, 9, 11]], refs + [reference(model, [5, 9, 11], NEW)]  # a row shorter than the window
    for kind, shape in (("medusa", "mc_sim_7b_63"), ("eagle3", "dynamic-4-4-12")):
        spec = Speculator(model, tok, make_heads(kind, model), tree=shape, batch_policy="always")
        made = iter(range(10 ** 6))

        def new():  # row i, batched or not, gets an oracle of seed i: rows accept differently
            i = next(made) % len(ps)
            return OracleProposer(make_proposer(spec.heads), refs[i], len(ps[i]), model.config.vocab_size, seed=i)

        spec.new_proposer = new
        out = spec.generate_batch(ps, max_new_tokens=NEW)
        single = [spec.generate(p, max_new_tokens=NEW) for p in ps]
        for ref, row, one in zip(refs, out.rows, single):
            assert row.ids == ref == one.ids, (arch, kind, shape)
            assert row.stats.accepted_per_depth == one.stats.accepted_per_depth
        assert len({tuple(r.stats.accepted_per_depth) for r in out.rows}) > 1  # rows really accept differently
        assert min(r.stats.tau for r in out.rows) > 1.5


@pytest.mark.parametrize("arch", ["gemma2", "mixtral"])
def test_a_decoder_that_ignores_the_window_is_caught(cases, monkeypatch, arch):
    """The comparison can fail: the full tree mask on sliding layers (transformers takes a 4-D mask as
    it is) changes the output."""
    model, tok, ps, refs = cases[arch]
    monkeypatch.setattr(kv_module, "window_mask", lambda mask, window: mask)
    spec = Speculator(model, tok, make_heads("medusa", model), tree="mc_sim_7b_63")
    assert sum(spec.generate(p, max_new_tokens=NEW).ids != ref for p, ref in zip(ps, refs)) >= 1


def test_window_mask_by_hand():
    """Each query keeps the last ``window`` of its visible keys: here a 2-token prefix, then a tree
    0 -> 1, 0 -> 2, 1 -> 3 whose node 3 sees prefix, 0, 1 and itself (positions 0..4)."""
    low = torch.finfo(torch.float32).min
    visible = torch.tensor([[1, 1, 1, 0, 0, 0],
                            [1, 1, 1, 1, 0, 0],
                            [1, 1, 1, 0, 1, 0],
                            [1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    mask = torch.zeros(4, 6).masked_fill(~visible, low)[None, None]
    cut = window_mask(mask, 3)[0, 0] == 0
    assert cut.tolist() == [[1, 1, 1, 0, 0, 0],
                            [0, 1, 1, 1, 0, 0],
                            [0, 1, 1, 0, 1, 0],
                            [0, 0, 1, 1, 0, 1]]
    assert torch.equal(window_mask(mask, 6), mask)


def test_layer_masks_per_architecture():
    mask = torch.zeros(1, 1, 2, 5)
    assert layer_masks(tiny_config("llama", 64), mask) is mask
    assert layer_masks(tiny_config("qwen3_moe", 64), mask) is mask  # no window
    assert isinstance(layer_masks(tiny_config("mixtral", 64), mask), torch.Tensor)  # every layer slides
    for arch in ("gemma2", "gemma3"):
        got = layer_masks(tiny_config(arch, 64), mask)
        assert set(got) == {"full_attention", "sliding_attention"} and got["full_attention"] is mask
    assert layer_masks(tiny_config("gemma2", 64), None) is None  # transformers builds its own


@pytest.mark.parametrize("static", [False, True])
def test_caches_keep_every_entry(static):
    """transformers would give Gemma 2's sliding layers a cache that keeps only the window."""
    cfg = tiny_config("gemma2", 64)
    cache = new_cache(cfg, 64 if static else None)
    assert len(cache.layers) == 2 and not any(cache.is_sliding)


def test_unsupported_layer_types_are_refused():
    cfg = types.SimpleNamespace(model_type="llama4_text", layer_types=["chunked_attention", "full_attention"])
    with pytest.raises(DecodeError, match="llama4_text has chunked_attention layers"):
        new_cache(cfg)


def test_soft_capped_logits_keep_the_full_verify_forward(cases):
    """Gemma 2 soft-caps its final logits, so lm_head(hidden) is not its logits: on-demand rows would
    verify against the wrong distribution. The check sees it (and passes Gemma 3 and a Gemma 2
    without the cap: it is the cap it detects)."""
    probe = torch.tensor([[1, 2, 3, 4]])
    gemma2 = cases["gemma2"][0]
    assert not head_matches_logits(gemma2, 2, probe)
    assert head_matches_logits(cases["gemma3"][0], 2, probe)
    uncapped, _ = tiny_target("gemma2", final_logit_softcapping=None)
    assert head_matches_logits(uncapped, 2, probe)
    spec = Speculator(gemma2, cases["gemma2"][1], make_heads("eagle3", gemma2), tree="dynamic-4-4-12")
    assert not spec.runtime.uses_lazy_logits()


# -- sampling: the statistical test of tests/test_decode_sampling.py on a 6-token vocabulary ----------
WINDOW = 3  # the prompt is 4 tokens, 3 are generated: the window decides what the last ones see
N_SAMPLES = 8_000  # test_decode_sampling's controls show 5,000 already suffice; its bounds scale with the count


def sampling_target(arch, window=WINDOW):
    cfg = tiny_config(arch, V, hidden_size=16, intermediate_size=32, max_position_embeddings=64, eos_token_id=None,
                      pad_token_id=None)
    cfg.sliding_window = window
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(12.0)  # spread but not flat next-token distributions
    return model


@pytest.mark.parametrize("arch,kind,shape", [("gemma2", "eagle3", "dynamic-3-3-8"),
                                             ("mixtral", "medusa", "mc_sim_7b_63")])
def test_speculative_sampling_matches_target(arch, kind, shape):
    model = sampling_target(arch)
    params = SamplingParams(temperature=1.0)
    spec = Speculator(model, tiny_tokenizer(), heads_for(kind, model), tree=shape)
    probs = exact_distribution(model, params)
    counts = speculative_samples(spec, params, N_SAMPLES, seed=seed_of(arch, kind, shape))
    assert chi_square_pvalue(counts, probs, N_SAMPLES) > 1e-3, total_variation(counts, probs, N_SAMPLES)
    assert total_variation(counts, probs, N_SAMPLES) < tv_bound(probs, N_SAMPLES)


def test_sampling_controls_on_gemma2():
    """The test above can fail here: a verifier that forgets to renormalise is rejected, and the window
    changes the target's distribution (so a decoder that ignored it would be rejected too)."""
    model = sampling_target("gemma2")
    params = SamplingParams(temperature=1.0)
    probs = exact_distribution(model, params)
    wide = sampling_target("gemma2", window=64)  # the same weights, no window in reach
    assert total_variation({k: p * N_SAMPLES for k, p in exact_distribution(wide, params).items()}, probs,
                           N_SAMPLES) > 0.05
    spec = Speculator(model, tiny_tokenizer(), heads_for("medusa", model), tree="mc_sim_7b_63")
    counts = speculative_samples(spec, params, N_SAMPLES, seed=3,
                                 verifier=lambda *a: verify_sample(*a, renormalise=False))
    assert chi_square_pvalue(counts, probs, N_SAMPLES) < 1e-6

