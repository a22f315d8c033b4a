"""The objective terms EAGLE-3 and DFlash can add (train/objectives.py): HASS's Top-K distillation,
GRIFFIN's token alignment, the expected accepted length of a chain; each by hand, each against a
reference built on the plain unroll / every block's slots, each wired through its option, and every
TTT length, decay and draft vocabulary size the objective grid runs."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from headway.config import ConfigError, load_config
from headway.heads import DFlashDrafter, Eagle3Drafter
from headway.testing import tiny_target
from headway.train.blocks import anchor_candidates, draft_blocks, select_anchors, slot_labels
from headway.train.config import TrainConfig
from headway.train.dflash import dflash_loss
from headway.train.objectives import Terms, expected_accepted, in_topk, reached, topk_distill
from headway.train.recipe import train
from headway.train.ttt import eagle3_ttt_loss, label_mask, shift_left, unroll

from train_utils import distilled_rows, save_rows

pytestmark = pytest.mark.usefixtures("one_thread")


# -- the pure terms ----------------------------------------------------------------------------
def test_topk_distill_weighs_only_the_targets_k_likeliest_tokens():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logq = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    want = -(0.5 * logq[0, 0] + 0.3 * logq[0, 1])
    torch.testing.assert_close(topk_distill(p, logq, 2), want[None])
    torch.testing.assert_close(topk_distill(p, logq, 99), -(p * logq).sum(-1))  # K past the vocabulary: the soft CE


def test_in_topk_and_reached_by_hand():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    assert in_topk(logits, torch.tensor([1, 1]), 2).tolist() == [True, False]
    assert in_topk(logits, torch.tensor([-1, 3]), 4).tolist() == [False, True]  # -1: no token to draft
    hits = torch.tensor([[True, False, True, True], [True, True, True, False]])
    assert reached(hits).tolist() == [[True, True, False, False], [True, True, True, True]]


def test_expected_accepted_by_hand():
    probs = torch.tensor([[0.5, 0.5, 1.0], [1.0, 0.0, 1.0]])
    assert expected_accepted(probs).tolist() == [0.5 + 0.25 + 0.25, 1.0]


def test_terms_are_read_from_an_option_section():
    cfg = load_config(TrainConfig, None, {"target": "demo", "kind": "dflash", "dflash.topk_weight": 0.5,
                                          "dflash.topk_k": 4, "dflash.align_topk": 3, "dflash.chain_weight": 0.1})
    assert Terms.of(cfg.dflash) == Terms(0.5, 4, 3, 0.1) and Terms.of(cfg.eagle) == Terms()
    with pytest.raises(ConfigError, match="eagle.topk_k"):
        load_config(TrainConfig, None, {"target": "demo", "kind": "eagle3", "eagle.topk_k": 0})


# -- EAGLE-3 -----------------------------------------------------------------------------------
def randomized(drafter):
    """Random matrices large enough that the residual branches matter (the init is near an identity)."""
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return drafter


@pytest.fixture(scope="module")
def eagle():
    """A random EAGLE-3 drafter over the whole vocabulary (every data token draftable), a batch with
    prompts and padding, the target's logits: what the loss reads."""
    target, _ = tiny_target()
    torch.manual_seed(0)
    d = randomized(Eagle3Drafter.for_target(target, draft_vocab_size=target.config.vocab_size))
    ids = torch.randint(3, 300, (3, 14))
    lm = torch.zeros_like(ids)
    lm[0, 4:12] = 1
    lm[1, 2:] = 1
    lm[2, 6:13] = 1
    out = target(input_ids=ids, output_hidden_states=True)
    fused = d.fuse([out.hidden_states[i] for i in d.feature_layers]).detach()
    return d, ids, lm, fused, out.logits.detach()


def reference(d, ids, lm, fused, logits, steps, decay, align=0, chain=0.0, topk=0.0, k=10):
    """Every step at every index (plain ``unroll``); GRIFFIN's mask and the chain built index by index."""
    p = F.softmax(logits.float(), -1)
    top = logits.argmax(-1)
    loss, alive, probs, starts = 0.0, torch.ones_like(lm, dtype=torch.bool), [], label_mask(lm, 2)
    for j, (_, lg) in enumerate(unroll(d, ids, fused, steps)):
        valid = label_mask(lm, j + 2)
        scored = valid & alive if align else valid
        logq = F.log_softmax(lg.float(), -1)  # (B, T, V)
        pj, labels = shift_left(p, j + 1), shift_left(top, j + 1)
        n = scored.sum().clamp(min=1)
        step = -(pj[scored] * logq[scored]).sum() / n
        if topk:
            step = step + topk * topk_distill(pj[scored], logq[scored], k).sum() / n
        loss = loss + decay ** j * step
        probs.append(torch.where(valid, logq.gather(-1, labels[..., None])[..., 0].exp(), 0.0))
        data = shift_left(ids, j + 2)  # what step j predicts and step j+1 reads
        alive = alive & valid & (lg.topk(max(align, 1), -1).indices == data[..., None]).any(-1)  # used with align
    if chain:
        loss = loss - chain * expected_accepted(torch.stack(probs, -1))[starts].mean()
    return loss


def grads(loss, d):
    return torch.autograd.grad(loss, [p for p in d.parameters() if p.requires_grad], allow_unused=True)


def assert_same(got, want, d):
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads(got, d), grads(want, d)):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# a random drafter rarely drafts the data's token first: among its top 100 of 384, about a quarter of the time
TERMS = [Terms(topk_weight=0.7, topk_k=5), Terms(align_topk=1), Terms(align_topk=100), Terms(chain_weight=0.5),
         Terms(0.3, 3, 100, 0.2)]


@pytest.mark.parametrize("terms", TERMS, ids=str)
def test_eagle3_terms_equal_the_reference_unroll(eagle, terms):
    """Each term (and all together) equals its definition on the full unroll, loss and gradients, with
    the loss's skipping of prompt rows: GRIFFIN's mask really drops positions, the chain really pulls."""
    d, ids, lm, fused, logits = eagle
    got, m = eagle3_ttt_loss(d, ids, fused, logits, lm, steps=4, decay=0.8, terms=terms)
    want = reference(d, ids, lm, fused, logits, 4, 0.8, terms.align_topk, terms.chain_weight, terms.topk_weight,
                     terms.topk_k)
    assert_same(got, want, d)
    plain, _ = eagle3_ttt_loss(d, ids, fused, logits, lm, steps=4, decay=0.8)
    assert not torch.allclose(got, plain)  # the term changed the loss
    if terms.align_topk == 100:
        assert 0 < m["reached1"] < 1 and m["reached3"] < m["reached1"]
    if terms.chain_weight:
        assert 0 < m["chain"] < 4


def test_eagle3_alignment_over_every_draft_and_a_top_k_of_the_whole_vocabulary_change_nothing(eagle):
    """Answers from the first token on: every chain's earlier steps have labels, so aligning over the
    whole vocabulary drops nothing (with prompts it drops the chains that start in the prompt)."""
    d, ids, _, fused, logits = eagle
    lm = torch.ones_like(ids)
    V = d.t2d.numel()
    plain, m = eagle3_ttt_loss(d, ids, fused, logits, lm, steps=3, hard_weight=0.5)
    aligned, m2 = eagle3_ttt_loss(d, ids, fused, logits, lm, steps=3, hard_weight=0.5, terms=Terms(align_topk=V))
    torch.testing.assert_close(aligned, plain)
    assert m2["reached1"] == 1 and m2["reached2"] == 1
    doubled, _ = eagle3_ttt_loss(d, ids, fused, logits, lm, steps=3, terms=Terms(topk_weight=1.0, topk_k=V))
    soft, _ = eagle3_ttt_loss(d, ids, fused, logits, lm, steps=3)
    torch.testing.assert_close(doubled, 2 * soft)  # K = V: the Top-K term is the soft CE again


# -- DFlash ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dflash():
    target, _ = tiny_target()
    torch.manual_seed(1)
    f = randomized(DFlashDrafter.for_target(target, mask_token_id=5, block_size=5))
    ids = torch.randint(3, 300, (2, 16))
    lm = torch.zeros_like(ids)
    lm[0, 3:] = 1
    lm[1, 5:14] = 1
    out = target(input_ids=ids, output_hidden_states=True)
    ctx = f.fuse([out.hidden_states[i] for i in f.feature_layers]).detach()
    anchors, valid = select_anchors(anchor_candidates(lm, 5), 6)
    return f, ids, lm, ctx, out.logits.detach(), anchors, valid


def dflash_reference(f, ids, lm, ctx, logits, anchors, valid, gamma, terms):
    out = draft_blocks(f, ids, ctx, anchors)[:, :, 1:]  # (B, n, bs-1, H)
    pos, lab = slot_labels(anchors, valid, lm, f.block_size)
    logq = F.log_softmax(f.logits(out).float(), -1)  # (B, n, bs-1, V)
    b = torch.arange(ids.shape[0])[:, None, None]
    p = F.softmax(logits[b, pos - 1].float(), -1)
    top = logits.argmax(-1)[b, pos - 1]
    data = ids[b, pos]
    hits = lab & (logq.topk(max(terms.align_topk, 1), -1).indices == data[..., None]).any(-1)
    scored = lab & reached(hits) if terms.align_topk else lab
    w = torch.exp(-torch.arange(f.block_size - 1).float() / gamma).expand_as(lab)
    per = -(p * logq).sum(-1) + terms.topk_weight * topk_distill(p.flatten(0, 2), logq.flatten(0, 2),
                                                                 terms.topk_k).view_as(lab)
    loss = (w * per)[scored].sum() / scored.sum()
    q = torch.where(lab, logq.gather(-1, top[..., None])[..., 0].exp(), 0.0)
    return loss - terms.chain_weight * expected_accepted(q)[lab[..., 0]].mean()


@pytest.mark.parametrize("terms", TERMS, ids=str)
def test_dflash_terms_equal_the_reference_blocks(dflash, terms):
    f, ids, lm, ctx, logits, anchors, valid = dflash
    top = logits.argmax(-1)
    got, m = dflash_loss(f, ids, ctx, logits, top, lm, anchors, valid, gamma=3.0, terms=terms)
    assert_same(got, dflash_reference(f, ids, lm, ctx, logits, anchors, valid, 3.0, terms), f)
    plain, _ = dflash_loss(f, ids, ctx, logits, top, lm, anchors, valid, gamma=3.0)
    assert not torch.allclose(got, plain)
    if terms.align_topk == 100:
        assert 0 < m["reached"] < 1


# -- the options, through training -------------------------------------------------------------
@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A tiny target with a 32,768-token vocabulary (the grid's largest draft vocabulary), its data."""
    from transformers import AutoModelForCausalLM

    from headway.testing import tiny_config, tiny_tokenizer

    root = tmp_path_factory.mktemp("objectives")
    torch.manual_seed(0)  # the tiny tokenizer's 384 tokens, embeddings and lm_head of 32,768 rows
    model = AutoModelForCausalLM.from_config(tiny_config("llama", 32768), dtype=torch.float32)
    with torch.no_grad():  # the target writes only real tokens (its argmax then lies in every draft vocabulary)
        model.get_output_embeddings().weight[384:] = 0
        model.get_output_embeddings().weight[:384] *= 8
    target = root / "target"
    model.save_pretrained(target)
    tiny_tokenizer(384).save_pretrained(target)
    data = save_rows(root / "data", [{**r, "index": i} for i, r in enumerate(distilled_rows(24, 384, seed=2))])
    return target, data


def run(wide, out: Path, **kw) -> list[dict]:
    target, data = wide
    base = {"target": str(target), "data": str(data), "output_dir": str(out), "batch_size": 4, "max_steps": 2,
            "log_every": 1, "save_every": 0, "eval_fraction": 0.2, "progress": False, "max_length": 16,
            "dflash.block_size": 4, "dflash.anchors": 4, "dflash.eval_anchors": 4}
    train(load_config(TrainConfig, None, {**base, **kw}))
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind,section", [("eagle3", "eagle"), ("dflash", "dflash")])
def test_each_term_reaches_the_loss_through_its_option(wide, tmp_path, kind, section):
    """Options on: their metrics are logged and the loss moves; off: neither."""
    plain = run(wide, tmp_path / "plain", kind=kind, **{"eagle.ttt_steps": 3, f"{section}.draft_vocab_size": 512})
    on = run(wide, tmp_path / "on", kind=kind, **{"eagle.ttt_steps": 3, f"{section}.draft_vocab_size": 512,
                                                   f"{section}.topk_weight": 1.0, f"{section}.align_topk": 2,
                                                   f"{section}.chain_weight": 0.5})
    steps = [r for r in plain if "loss" in r], [r for r in on if "loss" in r]
    reach = "reached1" if kind == "eagle3" else "reached"
    topk = "topk0" if kind == "eagle3" else "topk"
    assert not {"chain", reach, topk} & set(steps[0][0])
    assert {"chain", reach, topk} <= set(steps[1][0]) and steps[1][0]["loss"] != steps[0][0]["loss"]
    assert [r for r in on if r.get("event") == "done"]


@pytest.mark.parametrize("steps,decay,vocab", [(1, 0.8, 4096), (7, 0.5, 32768), (4, 1.0, 16384)])
def test_every_ttt_length_decay_and_draft_vocabulary_of_the_grid_trains(wide, tmp_path, steps, decay, vocab):
    records = run(wide, tmp_path / "e3", kind="eagle3", **{"eagle.ttt_steps": steps, "eagle.step_decay": decay,
                                                           "eagle.draft_vocab_size": vocab})
    logged = [r for r in records if "loss" in r][0]
    assert {f"ce{j}" for j in range(steps)} <= set(logged) and f"ce{steps}" not in logged
    from headway.heads import load_heads

    heads = load_heads(tmp_path / "e3" / "final")
    assert heads.config.draft_vocab_size == vocab
    assert heads.metadata["training"]["options"]["eagle"]["ttt_steps"] == steps


@pytest.mark.parametrize("vocab", [4096, 16384])  # 32,768: the whole vocabulary here (no own lm_head)
def test_dflash_trains_with_every_draft_vocabulary_of_the_grid(wide, tmp_path, vocab):
    run(wide, tmp_path / "df", kind="dflash", **{"dflash.draft_vocab_size": vocab})
    from headway.heads import load_heads

    assert load_heads(tmp_path / "df" / "final").config.draft_vocab_size == vocab
