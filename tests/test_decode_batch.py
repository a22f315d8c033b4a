"""Batched greedy decoding: every row equals its own unbatched greedy output, token for token.

The speculators here draft at every step (``batch_policy="always"``), so a row's drafts and
acceptance compare step by step with its unbatched run; the batch policy's plain steps are tested
in ``test_decode_policy.py``."""

import pytest
import torch

from headway.decode import Speculator
from headway.decode.args import DecodeError
from headway.decode.kv import PaddedRows
from headway.decode.padding import catch_up_visible, first_slots, left_pad, prefill_mask, used_columns
from headway.decode.proposers import EagleProposer, RowsProposer, make_proposer
from headway.testing import tiny_target

from test_decode_exact import OracleProposer, make_heads, prompts, reference, tie_free

CASES = [(kind, shape) for kind in ("medusa", "eagle1", "eagle3", "dflash") for shape in ("chain-4", "dynamic-4-4-12")] + \
    [("medusa", "mc_sim_7b_63"), ("dflash-vocab", "mc_sim_7b_63"), ("dflash-correction", "dynamic-4-4-12"),
     ("peagle", "chain-4"), ("peagle", "mc_sim_7b_63"), ("dspark", "dynamic-4-4-12")]


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
    spec = Speculator(model, tok, make_heads(kind, model), tree=shape, batch_policy="always")
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
        spec = Speculator(model, tok, make_heads("eagle1", model), tree="chain-4", batch_policy="always")
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
    spec = Speculator(model, tok, make_heads("medusa", model), tree="mc_sim_7b_63", batch_policy="always")
    one = spec.generate_batch([ps[0]], max_new_tokens=25).rows[0]
    assert one.ids == spec.generate(ps[0], max_new_tokens=25).ids == refs[0][:25]
    assert one.text == tok.decode(one.ids)
    out = spec.generate_batch(ps, max_new_tokens=1)  # the prefill's token only
    assert [r.ids for r in out.rows] == [[r[0]] for r in refs] and out.target_forwards == 0


def test_refusals(llama):
    model, tok = llama
    spec = Speculator(model, tok, make_heads("medusa", model), tree="chain-4", batch_policy="always")
    with pytest.raises(DecodeError, match="temperature must be"):
        spec.generate_batch([[5, 6], [7]], temperature=[0.7, -1.0])
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
    model, tok = llama
    ps, refs = batch
    real = PaddedRows.keep

    def leaky(kv, *args):
        real(kv, *args)
        kv.valid[:, -1:] = True  # the last kept tree slot: a gap for rows that accepted less

    monkeypatch.setattr(PaddedRows, "keep", leaky)
    spec = Speculator(model, tok, make_heads("eagle1", model), tree="chain-4", batch_policy="always")
    spec.new_proposer = oracles(spec, refs, ps, model.config.vocab_size)
    out = spec.generate_batch(ps, max_new_tokens=40)
    assert sum(r.ids != ref for r, ref in zip(out.rows, refs)) >= 1


class TwinChecked:
    """The proposer of B rows under test, every answer compared with B proposers of one row each fed
    the same inputs (the drafts' float rounding may differ, nothing else); the trees themselves come
    from per-row oracles, so rows accept 0..depth drafts per step and the drafter's cache gets gaps."""

    def __init__(self, batched, singles, oracles):
        self.b, self.rows, self.orc = batched, RowsProposer(singles), RowsProposer(oracles)
        self.max_depth, self.draft_vocab_size, self.temperatures = batched.max_depth, None, None
        self.feature_layers = batched.feature_layers
        self.checked, self.worst = 0, 0.0

    def _check(self, got, want):
        assert got.shape == want.shape
        diff = float((got - want).abs().max())
        self.worst = max(self.worst, diff)
        self.checked += 1
        assert diff < 1e-3, f"row log-probs differ by {diff}"  # log-probs of a row equal its unbatched ones up to float rounding

    def prefill(self, *args):
        for p in (self.b, self.rows, self.orc):
            p.prefill(*args)

    def accept(self, *args):
        for p in (self.b, self.rows, self.orc):
            p.accept(*args)

    def root_logprobs(self):
        self._check(self.b.root_logprobs(), self.rows.root_logprobs())
        return self.orc.root_logprobs()

    def expand(self, parent_rows, tokens, depth):
        self._check(self.b.expand(parent_rows, tokens, depth), self.rows.expand(parent_rows, tokens, depth))
        return self.orc.expand(parent_rows, tokens, depth)

    def to_target_ids(self, ids):
        return ids  # the oracles draft target ids

    def end_tree(self):
        for p in (self.b, self.rows, self.orc):
            p.end_tree()

    def select(self, keep):
        for p in (self.b, self.rows, self.orc):
            p.select(keep)


def twin_checked(spec, refs, ps, vocab, made):
    def new(n):
        single = oracles(spec, refs, ps, vocab)
        made.append(TwinChecked(make_proposer(spec.heads, spec.max_depth, spec.calibrate),
                                [make_proposer(spec.heads) for _ in range(n)], [single() for _ in range(n)]))
        return made[-1]

    return new


TWIN_CASES = [(kind, shape) for kind in ("medusa", "eagle1", "eagle3", "dflash")
              for shape in ("chain-4", "dynamic-4-4-12")] + [("eagle1", "mc_sim_7b_63"), ("dflash-vocab", "mc_sim_7b_63"),
                                                             ("peagle", "chain-4"), ("peagle", "dynamic-4-4-12"),
                                                             ("dspark", "chain-4"), ("dspark", "mc_sim_7b_63")]


@pytest.mark.parametrize("kind,shape", TWIN_CASES)
def test_batched_drafts_equal_unbatched_drafts(llama, batch, kind, shape):
    """One drafter call per level for all rows answers what each row's own proposer (a batch of one)
    answers, through variable acceptance, gaps, rows leaving the batch (EOS) and a batch of one."""
    model, tok = llama
    ps, refs = batch
    eos = refs[1][9]
    model.generation_config.eos_token_id = eos
    try:
        spec = Speculator(model, tok, make_heads(kind, model), tree=shape, batch_policy="always")
        made = []
        spec.new_batch_proposer = twin_checked(spec, refs, ps, model.config.vocab_size, made)
        out = spec.generate_batch(ps, max_new_tokens=40)
        one = spec.generate_batch(ps[:1], max_new_tokens=40).rows[0]
        spec.new_proposer = oracles(spec, refs, ps, model.config.vocab_size)
        single = [spec.generate(p, max_new_tokens=40) for p in ps]
    finally:
        model.generation_config.eos_token_id = 1
    for ref, row, s in zip(refs, out.rows, single):
        want = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert row.ids == s.ids == want
        assert row.stats.accepted_per_depth == s.stats.accepted_per_depth  # the same trees were drafted
    assert "eos" in {r.stats.stopped_by for r in out.rows} and "length" in {r.stats.stopped_by for r in out.rows}
    assert one.ids == refs[0][:len(one.ids)] and one.stats.accepted_per_depth  # batch of one
    assert made[0].checked >= 20 and min(r.stats.tau for r in out.rows) > 1.5


@pytest.mark.parametrize("leak", ["tree", "catch_up"])
def test_a_drafter_that_sees_gaps_is_caught(llama, batch, monkeypatch, leak):
    """The twin check can fail: a drafter mask that lets rows see padding and gap slots while drafting
    (tree), or one that keeps the pad slots of a shorter row's catch-up as real (catch_up), gives
    other log-probs. (A pad query seeing them would not matter: pad queries are never read.)"""
    from headway.decode import proposers

    model, tok = llama
    ps, refs = batch
    if leak == "tree":
        real = proposers.after_prefix
        monkeypatch.setattr(proposers, "after_prefix", lambda valid, new: real(torch.ones_like(valid), new))
    else:
        real = proposers.first_slots
        monkeypatch.setattr(proposers, "first_slots", lambda counts, dev: torch.ones_like(real(counts, dev)))
    spec = Speculator(model, tok, make_heads("eagle1", model), tree="chain-4", batch_policy="always")
    spec.new_batch_proposer = twin_checked(spec, refs, ps, model.config.vocab_size, [])
    with pytest.raises(AssertionError, match="row log-probs differ"):
        spec.generate_batch(ps, max_new_tokens=40)


@pytest.mark.parametrize("kind,shape", [("eagle1", "dynamic-4-4-12"), ("medusa", "mc_sim_7b_63"),
                                        ("eagle3", "chain-4")])
def test_rows_near_the_context_window_shrink_their_own_trees(llama, batch, kind, shape):
    """Near max_position_embeddings each row drafts its own shallower tree (a prefix of the static
    shape, a shallower dynamic tree) inside the one batched drafting."""
    model, tok = llama
    ps, refs = batch
    ps, refs = ps[:3], refs[:3]
    limit = max(map(len, ps)) + 24
    saved = model.config.max_position_embeddings
    model.config.max_position_embeddings = limit
    try:
        spec = Speculator(model, tok, make_heads(kind, model), tree=shape, batch_policy="always")
        made = []
        spec.new_batch_proposer = twin_checked(spec, refs, ps, model.config.vocab_size, made)
        new = [limit - len(p) - 1 for p in ps]  # every row runs into the window at its own step
        out = [spec.generate_batch([p], max_new_tokens=n).rows[0] for p, n in zip(ps, new)]
        both = spec.generate_batch(ps, max_new_tokens=min(new))
        spec.new_proposer = oracles(spec, refs, ps, model.config.vocab_size)
        single = [spec.generate(p, max_new_tokens=min(new)) for p in ps]
    finally:
        model.config.max_position_embeddings = saved
    for row, s, ref in zip(both.rows, single, refs):
        assert row.ids == s.ids == ref[:min(new)]
        assert row.stats.accepted_per_depth == s.stats.accepted_per_depth
    assert all(len(r.ids) == n for r, n in zip(out, new))


def test_catch_up_visibility_and_columns():
    valid = torch.tensor([[False, True], [True, True]])
    new_valid = first_slots([1, 3], torch.device("cpu"))
    assert new_valid.tolist() == [[True, False, False], [True, True, True]]
    vis = catch_up_visible(valid, new_valid)  # (2, 3, 5)
    assert vis[0].tolist() == [[False, True, True, False, False],  # row 0: its one real token
                               [False, True, True, True, False],  # pad queries: never read; they see
                               [False, True, True, False, True]]  # the real ones and themselves
    assert vis[1].tolist() == [[True, True, True, False, False], [True, True, True, True, False],
                               [True, True, True, True, True]]
    assert used_columns(torch.tensor([[False, True, False], [False, True, True]])).tolist() == [1, 2]
    assert used_columns(torch.ones(2, 2, dtype=torch.bool)) is None


def test_generate_batch_drafts_in_one_call_per_level(llama, batch, monkeypatch):
    """The default proposer drafts all rows in one call (not row by row), and the A/B switch works."""
    model, tok = llama
    ps, refs = batch
    calls = []
    real = EagleProposer.expand
    monkeypatch.setattr(EagleProposer, "expand", lambda self, *a: calls.append(a[1].shape) or real(self, *a))
    spec = Speculator(model, tok, make_heads("eagle1", model), tree="chain-4", batch_policy="always")
    out = spec.generate_batch(ps, max_new_tokens=6)
    assert calls and all(shape == (len(ps), 1) for shape in calls[:3])  # all rows in one call per level
    assert [r.ids for r in out.rows] == [r[:6] for r in refs]
    assert isinstance(spec.new_batch_proposer(2), EagleProposer)
    assert isinstance(spec.new_batch_proposer(1), EagleProposer)  # a batch of one is a batch
    spec.batched_drafting = False
    calls.clear()
    assert isinstance(spec.new_batch_proposer(2), RowsProposer)
    assert [r.ids for r in spec.generate_batch(ps, max_new_tokens=6).rows] == [r[:6] for r in refs]
    assert calls and all(shape == (1, 1) for shape in calls)  # row by row: a batch of one per call
