"""Reduced draft vocabularies for Medusa heads and EAGLE-1 drafters: shapes, the d2t / t2d
mapping, EAGLE-1's cached lm_head rows, strict save / load (old checkpoints included), and the
Medusa training labels, KL and evaluation over the draft vocabulary."""

import json

import pytest
import torch
import torch.nn.functional as F

from headway.config import ConfigError, load_config
from headway.decode.proposers import make_proposer
from headway.heads import Eagle1Drafter, HeadsError, MedusaConfig, MedusaHeads, load_heads
from headway.testing import tiny_target
from headway.train.batch import TargetBatch
from headway.train.config import TrainConfig
from headway.train.losses import IGNORE_INDEX, medusa_labels
from headway.train.tasks import MedusaTask

from train_utils import distilled_rows, save_rows

H, V, N = 64, 384, 50


@pytest.fixture(scope="module")
def target():
    model, _ = tiny_target("llama")
    return model


def ids_for(n=N, seed=0):
    """n distinct target ids, unsorted and spread over the vocabulary."""
    return torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:n]


def medusa(target, vocab=None, k=3):
    torch.manual_seed(0)
    heads = MedusaHeads.for_target(target, num_heads=k, draft_vocab=vocab)
    with torch.no_grad():
        for p in heads.blocks.parameters():
            p.normal_(0, 0.05)
    return heads


# -- shapes and the mapping -------------------------------------------------------------------------
def test_parameter_and_buffer_shapes(target):
    full, reduced = medusa(target), medusa(target, ids_for())
    assert [tuple(lm.weight.shape) for lm in reduced.lm_heads] == [(N, H)] * 3
    assert reduced.d2t.shape == (N,) and reduced.d2t.dtype == torch.long
    assert reduced.t2d.shape == (V,) and reduced.t2d.dtype == torch.bool and int(reduced.t2d.sum()) == N
    assert set(reduced.state_dict()) == set(full.state_dict()) | {"d2t", "t2d"}
    assert reduced(torch.randn(2, 5, H)).shape == (3, 2, 5, N)
    assert (full.draft_vocab_size, reduced.draft_vocab_size) == (V, N)

    e_full, e_red = Eagle1Drafter.for_target(target), Eagle1Drafter.for_target(target, draft_vocab=ids_for())
    assert "d2t" not in e_full.state_dict() and not e_full.has_draft_vocab  # the old layout, unchanged
    assert {k: v.shape for k, v in e_red.named_parameters()} == {k: v.shape for k, v in e_full.named_parameters()}
    assert set(e_red.state_dict()) == set(e_full.state_dict()) | {"d2t", "t2d"}
    assert (e_full.draft_vocab_size, e_red.draft_vocab_size) == (V, N)
    assert make_proposer(e_red).draft_vocab_size == N and make_proposer(reduced).draft_vocab_size == N


def test_configs_refuse_impossible_vocabularies():
    with pytest.raises(ValueError, match="own_lm_head=true"):
        MedusaConfig(hidden_size=H, vocab_size=V, own_lm_head=False, draft_vocab_size=10)
    with pytest.raises(ValueError, match="1..384"):
        MedusaConfig(hidden_size=H, vocab_size=V, draft_vocab_size=V + 1)
    with pytest.raises(ConfigError, match="own_lm_head=true") as e:
        load_config(TrainConfig, None, {"target": "t", "medusa.own_lm_head": False, "medusa.draft_vocab_size": 10})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["medusa", "eagle1"])
def test_d2t_t2d_round_trip(target, kind):
    ids = ids_for()
    heads = medusa(target, ids) if kind == "medusa" else Eagle1Drafter.for_target(target, draft_vocab=ids).eval()
    want = ids.sort().values  # draft ids follow target ids
    assert torch.equal(heads.draft_token_ids(), want)
    assert torch.equal(heads.to_target_ids(torch.arange(N)), want)
    assert torch.equal(torch.arange(N) + heads.d2t, want)
    assert torch.equal(heads.t2d, torch.isin(torch.arange(V), ids))
    assert torch.equal(heads.to_draft_ids(want), torch.arange(N))
    outside = torch.tensor([i for i in range(V) if i not in set(ids.tolist())][:7])
    assert (heads.to_draft_ids(outside) == -1).all()
    assert torch.equal(heads.to_draft_ids(torch.tensor([IGNORE_INDEX, want[3]]), missing=-7), torch.tensor([-7, 3]))
    x = torch.randint(0, N, (4, 6))  # any shape
    assert torch.equal(heads.to_draft_ids(heads.to_target_ids(x)), x)
    with pytest.raises(HeadsError, match="distinct"):
        heads.set_draft_vocab(torch.cat([ids[:-1], ids[:1]]))
    with pytest.raises(HeadsError, match="has 3 ids"):
        heads.set_draft_vocab(ids[:3])


# -- EAGLE-1: rows of the target's lm_head ----------------------------------------------------------
def test_eagle1_draft_logits_are_the_target_rows_and_train_mode_is_full(target):
    ids = ids_for()
    d = Eagle1Drafter.for_target(target, draft_vocab=ids)
    h = torch.randn(2, 3, H)
    full = target.get_output_embeddings()(h)  # (2, 3, V)
    d.train()  # training: the paper's full-vocabulary loss
    assert torch.equal(d.logits(h), full) and torch.equal(d.to_target_ids(torch.tensor([7])), torch.tensor([7]))
    d.eval()  # decoding / evaluation: the draft vocabulary only
    lg = d.logits(h)
    assert lg.shape == (2, 3, N)
    torch.testing.assert_close(lg, full[..., ids.sort().values])
    restricted = full.masked_fill(~d.t2d, float("-inf"))
    assert torch.equal(d.to_target_ids(lg.argmax(-1)), restricted.argmax(-1))
    assert torch.equal(d.draft_logits(h), lg)  # the proposer's call, whatever the mode
    d.train()
    assert torch.equal(d.draft_logits(h), lg) and d.draft_to_target_ids(torch.tensor([0])) == ids.min()


def test_eagle1_rows_are_cached_and_follow_the_target(tmp_path):
    model, _ = tiny_target("llama")  # its own copy: this test edits and casts the target
    d = Eagle1Drafter.for_target(model, draft_vocab=ids_for()).eval()
    h = torch.randn(1, 2, H)
    w1, _ = d._draft_lm_rows()
    d.logits(h)
    assert d._draft_lm_rows()[0] is w1  # sliced once, not per call
    assert not any("lm_rows" in k for k in d.state_dict())
    lm = model.get_output_embeddings()
    with torch.no_grad():
        lm.weight.mul_(2.0)  # the shared target module changed in place
    torch.testing.assert_close(d.logits(h), lm(h)[..., d.draft_token_ids()])
    model.to(torch.float64)  # the target moved / was cast: rows follow its dtype
    out = d.logits(h)
    assert out.dtype == torch.float64 and d._draft_lm_rows()[0].dtype == torch.float64
    torch.testing.assert_close(out, lm(h.double())[..., d.draft_token_ids()])
    w2, _ = d._draft_lm_rows()
    d.to(torch.float64)  # moving the drafter drops the cache
    assert "_lm_rows" not in d.__dict__ and d._draft_lm_rows()[0] is not w2
    with torch.inference_mode():
        assert d.logits(h.double()).shape == (1, 2, N)


# -- save / load ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["medusa", "eagle1"])
def test_save_load_round_trip_is_strict(target, tmp_path, kind):
    heads = medusa(target, ids_for()) if kind == "medusa" else Eagle1Drafter.for_target(target, draft_vocab=ids_for())
    path = heads.save_pretrained(tmp_path / "h")
    assert json.loads((path / "config.json").read_text())["draft_vocab_size"] == N
    rng = torch.get_rng_state()
    back = load_heads(path, target=target)
    assert torch.equal(torch.get_rng_state(), rng)  # the module's throwaway init leaves a user's seeded RNG alone
    assert back.config.draft_vocab_size == N
    for k, v in heads.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    h = torch.randn(2, 3, H)
    if kind == "medusa":
        torch.testing.assert_close(back(h), heads(h))
    else:
        torch.testing.assert_close(back.logits(h), heads.eval().logits(h))
    # config and tensors must agree: a checkpoint that lost d2t is refused, not half-loaded
    from safetensors.torch import load_file, save_file

    t = load_file(str(path / "model.safetensors"))
    del t["d2t"]
    save_file(t, str(path / "model.safetensors"))
    with pytest.raises(HeadsError, match="missing \\['d2t'\\]"):
        load_heads(path, target=target)


@pytest.mark.parametrize("kind", ["medusa", "eagle1"])
def test_old_checkpoints_load_and_draft_the_full_vocabulary(target, tmp_path, kind):
    """A checkpoint written before draft vocabularies existed: no config key, no d2t / t2d."""
    heads = medusa(target) if kind == "medusa" else Eagle1Drafter.for_target(target)
    path = heads.save_pretrained(tmp_path / "old")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["draft_vocab_size"]
    (path / "config.json").write_text(json.dumps(cfg))
    back = load_heads(path, target=target)
    assert not back.has_draft_vocab and back.draft_vocab_size == V
    h = torch.randn(2, 3, H)
    if kind == "medusa":
        torch.testing.assert_close(back(h), heads(h))
    else:
        assert torch.equal(back.logits(h), target.get_output_embeddings()(h))
    x = torch.arange(5)
    assert torch.equal(make_proposer(back).to_target_ids(x), x)


# -- Medusa training over the draft vocabulary ------------------------------------------------------
def batch(target, seed=0, B=2, T=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    loss_mask = torch.ones(B, T, dtype=torch.long)
    loss_mask[:, :2] = 0
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    return TargetBatch(ids, torch.ones_like(ids), loss_mask, {-1: out.hidden_states[-1]}, out.logits)


def task(**medusa_opts):
    return MedusaTask(load_config(TrainConfig, None, {"target": "t", **{f"medusa.{k}": v for k, v in medusa_opts.items()}}))


def test_medusa_labels_outside_the_draft_vocab_are_ignored(target):
    ids = ids_for(150)
    heads, tb = medusa(target, ids), batch(target)
    loss, metrics = task(num_heads=3, decay=1.0).head_loss(heads, tb)
    labels = medusa_labels(tb.input_ids, tb.loss_mask, 3)  # (K, B, T) target ids
    logits = heads(tb.hidden[-1]).float()  # (K, B, T, Vd)
    inside = (labels >= 0) & heads.t2d[labels.clamp(min=0)]
    assert inside.any() and ((labels >= 0) & ~inside).any()  # both kinds of label occur
    want = []
    for k in range(3):
        ce = F.cross_entropy(logits[k][inside[k]], heads.to_draft_ids(labels[k][inside[k]]))
        want.append(ce)
        torch.testing.assert_close(metrics[f"head{k}_ce"], ce)
    torch.testing.assert_close(loss, torch.stack(want).sum())

    # nothing in the vocabulary: no label counts, the loss is 0 (not a wrong class)
    none = ids_for(N, seed=9)
    none = none[~torch.isin(none, tb.input_ids.flatten())][:20]
    loss0, m0 = task(num_heads=3).head_loss(medusa(target, none), tb)
    assert float(loss0.detach()) == 0.0 and all(float(m0[f"head{k}_ce"]) == 0.0 for k in range(3))


def test_medusa_kl_uses_the_target_renormalised_on_the_draft_vocab(target):
    ids = ids_for(150)
    heads, tb = medusa(target, ids), batch(target, seed=1)
    _, metrics = task(num_heads=3, decay=1.0, kl_weight=0.5).head_loss(heads, tb)
    labels = heads.to_draft_ids(medusa_labels(tb.input_ids, tb.loss_mask, 3), missing=IGNORE_INDEX)
    logits = heads(tb.hidden[-1]).float().detach()
    cols = heads.draft_token_ids()
    T = tb.input_ids.shape[1]
    want = 0.0
    for k in range(3):
        s = k + 1
        p = F.softmax(tb.logits[:, s:, cols].float(), -1)  # (B, T-s, Vd) restricted and renormalised
        q = F.log_softmax(logits[k, :, : T - s], -1)
        kl = (p * (p.log() - q)).sum(-1)
        m = labels[k, :, : T - s] != IGNORE_INDEX
        want += float(kl[m].mean())
    assert metrics["kl"].item() == pytest.approx(want, rel=1e-5)


def test_medusa_eval_counts_tokens_outside_the_vocab_as_misses(target):
    ids = ids_for(150)
    heads, tb = medusa(target, ids), batch(target, seed=2)
    t = task(num_heads=3)
    stats = t.eval_stats(heads, tb)
    labels = medusa_labels(tb.input_ids, tb.loss_mask, 3)
    assert torch.equal(stats["count"], (labels != IGNORE_INDEX).sum(dim=(1, 2)))  # every answer token counts
    hit = heads.to_target_ids(heads(tb.hidden[-1]).argmax(-1)) == labels
    assert torch.equal(stats["top1"], hit.sum(dim=(1, 2)))
    out = t.summarize(stats)
    answer = tb.loss_mask.bool()
    assert out["draft_vocab_coverage"] == pytest.approx(float(heads.t2d[tb.input_ids][answer].float().mean()), abs=1e-4)


def test_medusa_and_eagle1_tasks_count_the_vocab_on_the_data(target, tmp_path):
    from headway.data.vocab import draft_vocab, token_frequencies
    from headway.train.eagle import Eagle1Task

    rows = distilled_rows(32, V, seed=3)
    data = save_rows(tmp_path / "data", rows)
    from datasets import load_from_disk

    counts = token_frequencies(load_from_disk(str(data)), V)
    want, _, _ = draft_vocab(counts, 64)
    cfg = load_config(TrainConfig, None, {"target": "t", "data": str(data), "medusa.num_heads": 2, "medusa.draft_vocab_size": 64,
                                          "eagle.draft_vocab_size": 64})
    heads = MedusaTask(cfg).build(target)
    assert torch.equal(heads.draft_token_ids(), want)
    W = target.get_output_embeddings().weight
    assert all(torch.equal(lm.weight, W[want]) for lm in heads.lm_heads)  # the target's rows of those tokens
    meta = heads.metadata["draft_vocab"]
    assert meta["size"] == 64 and meta["answer_token_coverage"] == pytest.approx(
        float(counts[want].sum() / counts.sum()), abs=1e-4)
    drafter = Eagle1Task(cfg).build(target)
    assert torch.equal(drafter.draft_token_ids(), want) and drafter.metadata["draft_vocab"]["size"] == 64
    # None, or the whole vocabulary: nothing changes
    plain = load_config(TrainConfig, None, {"target": "t", "data": str(data), "medusa.draft_vocab_size": V})
    assert not MedusaTask(plain).build(target).has_draft_vocab
    assert not Eagle1Task(load_config(TrainConfig, None, {"target": "t", "data": str(data)})).build(target).has_draft_vocab
    from headway.train.errors import TrainError

    with pytest.raises(TrainError, match="larger than the target's vocabulary of 384"):
        Eagle1Task(load_config(TrainConfig, None, {"target": "t", "data": str(data), "eagle.draft_vocab_size": V + 1})).build(target)
    with pytest.raises(TrainError, match="counted on the training data"):
        MedusaTask(load_config(TrainConfig, None, {"target": "t", "data": str(tmp_path / "gone"), "medusa.draft_vocab_size": 9})
                   ).build(target)
