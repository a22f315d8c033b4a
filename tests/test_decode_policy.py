"""The batch-aware policy: speculate or decode plainly per step, by batch size; either way, and
across switches between the two inside one generation, every row stays exact."""

import pytest

from headway.decode import Speculator
from headway.decode.policy import TreePolicy, batch_table, nearest_size, untuned_speculates
from headway.decode.shapes import chain

from test_decode_batch import batch, llama, oracles  # noqa: F401  (fixtures)
from test_decode_exact import make_heads


def policy(**kw):
    return TreePolicy(chain(3), chain(3), 1 << 20, **kw)


def test_untuned_one_prompt_speculates_and_an_untuned_batch_decodes_plainly():
    """Without a tuned table the decoder drafts only where the gain over plain decoding is known to
    be positive: one prompt drafts, every batch decodes plainly, greedy or sampled, whatever it
    decoded before (nothing is measured, so nothing a busy machine does can flip it)."""
    p = policy()
    assert [untuned_speculates(b) for b in (1, 2, 4, 16, 64)] == [True, False, False, False, False]
    for _ in range(3):  # the same answer every step: a rule, not a measurement
        assert p.speculate(1) and p.speculate(1, sampling=True)
        assert not any(p.speculate(b, s) for b in (2, 4, 16, 64) for s in (False, True))
    assert not policy(by_batch={1: False}).speculate(1)  # a table overrides the rule, both ways
    assert policy(by_batch={16: True}).speculate(16) and policy(by_batch={16: True}).speculate(4, sampling=True)
    assert policy(batch_aware=False).speculate(16)  # always (A/B)


def test_an_untuned_batch_decodes_plainly_and_exactly(llama, batch):  # noqa: F811
    """generate_batch with untuned heads: no step drafts (one target forward per new token after the
    prefill's), and every row is the target's greedy output; one prompt still drafts."""
    model, tok = llama
    ps, refs = batch
    spec = Speculator(model, tok, make_heads("eagle3", model), tree="chain-3")
    spec.new_proposer = oracles(spec, refs, ps, model.config.vocab_size)  # drafts that would be accepted
    n = 12
    out = spec.generate_batch(ps, max_new_tokens=n)
    assert [r.ids for r in out.rows] == [ref[:n] for ref in refs]
    assert all(sum(r.stats.accepted_per_depth) == 0 for r in out.rows)
    spec.new_proposer = oracles(spec, refs, ps, model.config.vocab_size)  # row 0's oracle for prompt 0
    one = spec.generate(ps[0], max_new_tokens=n)
    assert one.ids == refs[0][:n] and sum(one.stats.accepted_per_depth) > 0


def test_a_sampling_table_decides_sampled_batches():
    """T>0 follows its own tuned table (sampled drafts are accepted less often); without one, T=0's."""
    p = policy(by_batch={1: True, 8: False}, by_batch_sampling={1: False, 4: True})
    assert p.speculate(1) and not p.speculate(1, sampling=True)  # one prompt too, when a table says so
    assert p.speculate(4, sampling=True) and p.speculate(2) and not p.speculate(4)  # 4: nearer 8 than 1
    assert not p.speculate(8) and p.speculate(8, sampling=True)
    assert not policy(by_batch={1: True, 8: False}).speculate(8, sampling=True)


def test_a_table_tree_is_drafted_at_its_batch_size():
    """A tuned entry may name the tree that was fastest at that size: larger batches draft smaller trees."""
    p = policy(by_batch=batch_table({"1": True, "4": "chain-1", "8": False}))
    assert p.shape_for(100, False, 1).depth == 3  # True: the default tree
    assert p.speculate(4) and p.shape_for(100, False, 5).depth == 1  # 5: the nearest tuned size is 4
    assert not p.speculate(8)
    assert p.shape_for(0, False, 4).depth == 0 and p.largest_size() == 4  # the default chain-3: 4 nodes


def test_the_tuned_table_takes_the_nearest_size_by_ratio():
    """Rows leave a batch as they finish: a batch of 16 down to 15 rows is decoded as 16 was tuned
    (the nearest smaller size, 8, drafted there and ran 0.93x plain decoding on SmolLM2)."""
    p = policy(by_batch=batch_table({"1": True, "4": False, "16": True}))
    sizes = (1, 2, 3, 4, 5, 7, 8, 12, 15, 16, 32)
    # 2 and 8 lie halfway by ratio: the larger size's entry
    assert [p.speculate(b) for b in sizes] == [True, False, False, False, False, False, True, True, True, True, True]
    assert nearest_size({1, 2, 4, 8, 16}, 15) == 16 and nearest_size({1, 2, 4, 8, 16}, 6) == 8
    assert nearest_size({1, 2, 4, 8, 16}, 5) == 4 and nearest_size({4}, 1) == 4
    assert policy(by_batch={4: False}).speculate(2) is False  # below the smallest: the smallest's
    assert policy(by_batch={1: False}, batch_aware=False).speculate(8)


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "medusa"])
@pytest.mark.parametrize("table", [{1: False}, {2: True, 3: False}, {1: False, 3: True}, {1: "chain-1", 3: "chain-3"}])
def test_switching_between_plain_and_drafted_steps_stays_exact(llama, batch, kind, table):  # noqa: F811
    """Rows leave as they stop, so the batch size crosses the table's cut-over mid-generation: the
    proposer then catches up on the paths of the plain steps it skipped, in one call."""
    model, tok = llama
    ps, refs = batch
    spec = Speculator(model, tok, make_heads(kind, model), tree="chain-4", by_batch=table)
    spec.new_proposer = oracles(spec, refs, ps, model.config.vocab_size)
    lengths = [12, 40, 24, 33, 40, 18][:len(ps)]
    out = spec.generate_batch(ps, max_new_tokens=lengths)  # the batch shrinks through the cut-over
    assert [r.ids for r in out.rows] == [ref[:n] for ref, n in zip(refs, lengths)]
    drafted = sum(sum(r.stats.accepted_per_depth) for r in out.rows)
    assert (drafted > 0) == any(table.values())


@pytest.mark.parametrize("static", [False, True])
def test_one_prompt_decodes_plainly_when_the_table_says_so(llama, batch, static):  # noqa: F811
    """``generate`` (one row, ``OneRow``: no mask over a dynamic cache, the slots past the token
    hidden in a static one) with plain steps only: the target's greedy output, no drafts."""
    model, tok = llama
    ps, refs = batch
    spec = Speculator(model, tok, make_heads("eagle3", model), tree="chain-3", by_batch={1: False},
                      static_cache=static)
    out = spec.generate(ps[0], max_new_tokens=len(refs[0]))
    assert out.ids == refs[0]
    assert out.stats.target_forwards == len(refs[0]) - 1 and sum(out.stats.accepted_per_depth) == 0
    sampled = Speculator(model, tok, make_heads("eagle3", model), tree="chain-3", by_batch={1: True},
                         by_batch_sampling={1: False})
    res = sampled.generate(ps[0], max_new_tokens=8, temperature=1.0, seed=0)
    assert res.stats.target_forwards == 7 and sum(res.stats.accepted_per_depth) == 0  # T>0: its own table


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "peagle"])
def test_drafter_catching_up_in_chunks_drafts_as_one_call(llama, batch, kind, monkeypatch):  # noqa: F811
    """Plain steps are told to the proposer every FLUSH_EVERY steps (bounded memory on long plain
    runs): the drafts after the switch equal those of one catch-up call, and the output stays exact."""
    from headway.decode import step as S

    model, tok = llama
    ps, refs = batch
    lengths = [12, 40, 24, 33, 40]

    def drafted_trees(every):
        monkeypatch.setattr(S, "FLUSH_EVERY", every)
        spec = Speculator(model, tok, make_heads(kind, model), tree="chain-3", by_batch={2: True, 3: False})
        trees = []

        class Capture:
            def on_step(self, b, scored, verdicts, new, times):
                if scored is not None:
                    trees.append([t.tokens.tolist() for t in scored.drafts.trees])

        spec.hooks.append(Capture())
        out = spec.generate_batch(ps, max_new_tokens=lengths)
        assert [r.ids for r in out.rows] == [ref[:n] for ref, n in zip(refs, lengths)]
        return trees

    once, chunked = drafted_trees(10 ** 6), drafted_trees(3)
    assert once and chunked == once
