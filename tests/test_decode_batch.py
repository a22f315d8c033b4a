"""Batched greedy decoding: every row equals its own unbatched greedy output, token for token."""

import pytest
import torch

from headway.decode import Speculator
from headway.decode.args import DecodeError
from headway.decode.batch import left_pad, prefill_mask
from headway.decode.proposers import make_proposer
from headway.testing import tiny_target

from test_decode_exact import OracleProposer, make_heads, prompts, reference, tie_free

CASES = [(kind, shape) for kind in ("medusa", "eagle1", "eagle3") for shape in ("chain-4", "dynamic-4-4-12")] + \
    [("medusa", "mc_sim_7b_63")]


@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama")


@pytest.fixture(scope="module")
def batch(llama):
    """Five prompts of different lengths (one short) with tie-free HF greedy references."""
    model, tok = llama
    ps, refs = [], []
    for p in prompts(tok, n=12, seed=7) + [[5, 9, 11]]:
        ref = reference(model, p, 40)
        if tie_free(model, p, ref) and len({len(q) for q in ps + [p]}) == len(ps) + 1:
            ps.append(p)
            refs.append(ref)
    ps, refs = ps[-5:], refs[-5:]
    assert len(ps) == 5 and len(ps[-1]) == 3
    return ps, refs


def oracles(spec, refs, ps, vocab):
    """new_proposer hands row i (and the i-th unbatched run) an oracle with seed i: rows accept differently."""
    made = iter(range(10 ** 6))

    def new():
        i = next(made) % len(ps)
        return OracleProposer(make_proposer(spec.heads), refs[i], len(ps[i]), vocab, seed=i)

    return new


@pytest.mark.parametrize("kind,shape", CASES)
def test_rows_equal_unbatched_and_hf(llama, batch, kind, shape):
    model, tok = llama
    ps, refs = batch
    spec = Speculator(model, tok, make_heads(kind, model), tree=shape)
    out = spec.generate_batch(ps, max_new_tokens=40)  # random heads: few drafts accepted
    for p, ref, row in zip(ps, refs, out.rows):
        assert row.ids == ref == spec.generate(p, max_new_tokens=40).ids, (kind, shape, len(p))
    spec.new_proposer = oracles(spec, refs, ps, model.config.vocab_size)
    out = spec.generate_batch(ps, max_new_tokens=40)  # oracle drafts: rows accept 0..depth per step
    single = [spec.generate(p, max_new_tokens=40) for p in ps]
    for ref, row, one in zip(refs, out.rows, single):
        assert row.ids == ref == one.ids, (kind, shape)
        assert row.stats.accepted_per_depth == one.stats.accepted_per_depth  # per-row acceptance
        assert row.stats.target_forwards == one.stats.target_forwards
        assert row.stats.stopped_by == "length" and row.stats.new_tokens == 40
    taus = [r.stats.tau for r in out.rows]
    assert min(taus) > 1.5 and len({r.stats.target_forwards for r in out.rows}) > 1  # rows really diverge
    assert out.target_forwards == max(r.stats.target_forwards for r in out.rows)
    assert out.new_tokens == 40 * len(ps)


def test_rows_stop_at_eos_independently(llama, batch):
    model, tok = llama
    ps, refs = batch
    eos = refs[0][6]
    model.generation_config.eos_token_id = eos
    try:
        spec = Speculator(model, tok, make_heads("eagle1", model), tree="chain-4")
        spec.new_proposer = oracles(spec, refs, ps, model.config.vocab_size)
        out = spec.generate_batch(ps, max_new_tokens=40)
        single = [spec.generate(p, max_new_tokens=40) for p in ps]
    finally:
        model.generation_config.eos_token_id = 1
    stopped = []
    for ref, row, one in zip(refs, out.rows, single):
        want = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert row.ids == one.ids == want
        assert row.stats.stopped_by == one.stats.stopped_by == ("eos" if eos in ref else "length")
        stopped.append(row.stats.stopped_by)
    assert stopped[0] == "eos" and len(out.rows[0].ids) == 7
    assert "length" in stopped  # the other rows went on after row 0 left the batch


def test_batch_of_one_and_mixed_max_new(llama, batch):
    model, tok = llama
    ps, refs = batch
    spec = Speculator(model, tok, make_heads("medusa", model), tree="mc_sim_7b_63")
    one = spec.generate_batch([ps[0]], max_new_tokens=25).rows[0]
    assert one.ids == spec.generate(ps[0], max_new_tokens=25).ids == refs[0][:25]
    assert one.text == tok.decode(one.ids)
    out = spec.generate_batch(ps, max_new_tokens=1)  # the prefill's token only
    assert [r.ids for r in out.rows] == [[r[0]] for r in refs] and out.target_forwards == 0


def test_refusals(llama):
    model, tok = llama
    spec = Speculator(model, tok, make_heads("medusa", model), tree="chain-4")
    with pytest.raises(DecodeError, match="greedy only"):
        spec.generate_batch([[5, 6], [7]], temperature=0.7)
    with pytest.raises(DecodeError, match="list of prompts"):
        spec.generate_batch("one prompt")
    with pytest.raises(DecodeError, match="list of prompts"):
        spec.generate_batch([])
    with pytest.raises(DecodeError, match="context"):
        spec.generate_batch([[5], [6] * 500], max_new_tokens=20)


def test_left_pad_and_prefill_mask():
    tokens, valid, pos = left_pad([[4, 5, 6], [7]], pad=0, device=torch.device("cpu"))
    assert tokens.tolist() == [[4, 5, 6], [0, 0, 7]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]
    m = prefill_mask(valid)  # (B, n, n)
    assert m[1].tolist() == [[True, False, False], [False, True, False], [False, False, True]]
    assert m[0].tolist() == torch.ones(3, 3, dtype=torch.bool).tril().tolist()


def test_visible_gaps_are_caught(llama, batch, monkeypatch):
    """The comparison can fail: letting rows see the gap slots rejected drafts left breaks exactness."""
    from headway.decode import batch as batch_module

    model, tok = llama
    ps, refs = batch
    real = batch_module.keep_accepted_rows

    def leaky(b, width, verdicts):
        real(b, width, verdicts)
        b.valid[:, -1:] = True  # the last kept tree slot: a gap for rows that accepted less

    monkeypatch.setattr(batch_module, "keep_accepted_rows", leaky)
    spec = Speculator(model, tok, make_heads("eagle1", model), tree="chain-4")
    spec.new_proposer = oracles(spec, refs, ps, model.config.vocab_size)
    out = spec.generate_batch(ps, max_new_tokens=40)
    assert sum(r.ids != ref for r, ref in zip(out.rows, refs)) >= 1
