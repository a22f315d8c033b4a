"""DFlash training: anchors and block masks (pure), the loss, what trains and what must not, resume,
online == offline features, and a briefly trained block drafter beating its untrained self."""

import json
from pathlib import Path

import pytest
import torch

from headway.config import ConfigError, load_config
from headway.heads import DFlashDrafter, load_heads
from headway.target import load_target
from headway.testing import save_tiny_target
from headway.train.config import TrainConfig
from headway.train.blocks import (accepted_at_every_anchor, anchor_candidates, block_mask, block_predictions,
                                  decoder_anchors, row_draws, select_anchors, slot_labels)
from headway.train.dflash import DFlashTask, least_used_token
from headway.train.recipe import fit, train

from test_eagle_train import greedy_text  # noqa: F401  (the fixture: text the tiny target writes greedily)
from train_utils import distilled_rows, online_and_offline_losses, save_rows

pytestmark = pytest.mark.usefixtures("one_thread")


# -- pure pieces -------------------------------------------------------------------------------
def test_anchor_candidates_need_an_answer_token_and_a_label_after_it():
    m = torch.tensor([[0, 0, 1, 1, 1, 1, 0]])
    assert anchor_candidates(m, 4).tolist() == [[False, False, True, True, True, False, False]]
    assert anchor_candidates(m, 3, whole=True).tolist() == [[False, False, True, True, False, False, False]]


def test_select_anchors_samples_candidates_only_and_pads_short_rows():
    cand = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0], [0, 0, 0, 1, 0, 0, 0, 0]], dtype=torch.bool)
    a, v = select_anchors(cand, 3)  # earliest first
    assert a.tolist() == [[1, 2, 4], [3, 0, 0]] and v.tolist() == [[True, True, True], [True, False, False]]
    draws = torch.rand(2, 8, generator=torch.Generator().manual_seed(0))
    a, v = select_anchors(cand, 4, draws)
    assert all(bool(cand[b, i]) for b in range(2) for i, ok in zip(a[b].tolist(), v[b].tolist()) if ok)
    assert v.sum(1).tolist() == [4, 1] and a[0].tolist() == sorted(a[0].tolist())
    picks = {tuple(select_anchors(cand, 2, torch.rand(2, 8, generator=torch.Generator().manual_seed(s)))[0][0].tolist())
             for s in range(40)}
    assert len(picks) > 5  # uniform draws pick different subsets


def test_row_draws_depend_on_the_row_alone():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    att = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    d = row_draws(ids, att, seed=0, step=3)
    again = row_draws(torch.tensor([[8, 9, 0, 0, 0]]), torch.tensor([[1, 1, 0, 0, 0]]), seed=0, step=3)
    torch.testing.assert_close(again[0, :4], d[1])  # another batch, another padding: the same draws
    assert not torch.equal(row_draws(ids, att, seed=0, step=4), d) and not torch.equal(row_draws(ids, att, 1, 3), d)


def test_block_mask_by_hand():
    """T=4 context positions, blocks of 2 at anchors 1 and 3: block j sees context < anchor j and its own slots."""
    m = block_mask(torch.tensor([[1, 3]]), 4, 2, torch.float32)[0, 0] == 0  # (4 queries, 4 + 4 keys)
    want = [[1, 0, 0, 0, 1, 1, 0, 0],
            [1, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 1, 0, 0, 0, 1, 1],
            [1, 1, 1, 0, 0, 0, 1, 1]]
    assert m.int().tolist() == want


def test_slot_labels_stop_at_the_row_end_and_at_prompt_tokens():
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1]])
    pos, lab = slot_labels(torch.tensor([[1, 4]]), torch.tensor([[True, True]]), loss_mask, 4)
    assert pos.tolist() == [[[2, 3, 4], [5, 5, 5]]]
    assert lab.tolist() == [[[True, True, False], [True, False, False]]]
    assert least_used_token(torch.tensor([3, 0, 5, 0, 2])) == 3


def test_accepted_at_every_anchor_counts_each_blocks_greedy_run_in_chunks():
    """Every whole-block anchor gets its block's run of drafts equal to the label, the same in
    chunks as in one call; a block whose drafts are the label is accepted whole."""
    from headway.testing import tiny_target

    target, _ = tiny_target()
    torch.manual_seed(0)
    d = DFlashDrafter.for_target(target, mask_token_id=3, block_size=4).eval()
    ids = torch.randint(4, 384, (2, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(2, 14, dtype=torch.long)
    mask[0, 3:14], mask[1, 5:11] = 1, 1
    context = torch.randn(2, 14, target.config.hidden_size, generator=torch.Generator().manual_seed(2))
    logits, rows, pos = block_predictions(d, ids, mask, context, 14)  # every anchor, one call
    drafts = d.to_target_ids(logits.argmax(-1))  # (N, 3)
    label = torch.randint(4, 384, (2, 14), generator=torch.Generator().manual_seed(3))
    j = int((rows == 1).nonzero()[0])  # row 1's first block (blocks of one row overlap)
    label[0, pos[0] - 1] = drafts[0]  # row 0's first block's drafts are the label: all 3 accepted
    label[1, pos[j, :2] - 1] = drafts[j, :2]  # row 1's first block: its first two (its third: another token)
    label[1, pos[j, 2] - 1] = 4 if drafts[j, 2] != 4 else 5
    with torch.no_grad():
        one, at = accepted_at_every_anchor(d, ids, mask, context, label, chunk=100)
        chunked, at2 = accepted_at_every_anchor(d, ids, mask, context, label, chunk=2)
    assert torch.equal(at, anchor_candidates(mask, 4, whole=True)) and torch.equal(at2, at)
    assert torch.equal(chunked, one) and torch.equal(one[~at], torch.zeros_like(one[~at]))
    want = (drafts == label[rows[:, None], pos - 1]).long().cumprod(1).sum(1)
    assert torch.equal(one[rows, pos[:, 0] - 1], want)
    assert want[0] == 3 and want[j] == 2


def test_decoder_anchors_start_at_the_answer_and_move_past_the_accepted_drafts():
    """Blocks of 4 over an answer at 3..14: the prefill emits token 3, so the first block is
    anchored there; accepting a drafts moves a + 1 on; the walk ends where no whole block fits.
    9 marks anchors the walk must never read."""
    loss_mask = torch.zeros(1, 16, dtype=torch.long)
    loss_mask[0, 3:15] = 1
    at = anchor_candidates(loss_mask, 4, whole=True)  # anchors 3..11
    accepted = torch.tensor([[0, 0, 0, 1, 9, 3, 9, 9, 9, 0, 2, 9, 0, 0, 0, 0]])
    # 3 accepts 1 -> 5 accepts 3 -> 9 accepts 0 -> 10 accepts 2 -> 13: not a whole-block anchor
    assert decoder_anchors(accepted, at, loss_mask)[0].nonzero().flatten().tolist() == [3, 5, 9, 10]


# -- through the loop ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash_train")
    target = save_tiny_target(root / "target")
    data = save_rows(root / "data", [{**r, "index": i} for i, r in enumerate(distilled_rows(48, 384, seed=1))])
    return root, target, data


def config(setup, out: Path, **kw) -> TrainConfig:
    _, target, data = setup
    base = {"kind": "dflash", "target": str(target), "data": str(data), "output_dir": str(out), "batch_size": 4,
            "max_steps": 6, "log_every": 1, "save_every": 0, "eval_fraction": 0.25, "progress": False,
            "optim.lr": 3e-3, "dflash.block_size": 4, "dflash.draft_vocab_size": 128, "dflash.anchors": 6}
    return load_config(TrainConfig, None, {**base, **kw})


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]


def test_trains_every_drafter_tensor_and_leaves_target_bit_identical(setup, tmp_path):
    target, tok = load_target(str(setup[1]), device="cpu")
    before = {k: v.clone() for k, v in target.state_dict().items()}
    task = DFlashTask(config(setup, tmp_path / "init"))
    torch.manual_seed(0)  # the loop's seed: the same initial weights as the run below
    init = task.build(target)
    final = fit(config(setup, tmp_path / "run"), target, tok)
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), f"target tensor {k} changed"
    heads = load_heads(final, target=target)
    assert isinstance(heads, DFlashDrafter) and heads.config.block_size == 4
    for name, p in heads.named_parameters():
        assert not torch.equal(p, dict(init.named_parameters())[name]), f"drafter tensor {name} did not train"
    assert torch.equal(heads.d2t, init.d2t) and int(heads.t2d.sum()) == 128  # the draft vocabulary is data
    rows = target.get_output_embeddings().weight[init.draft_token_ids()]
    assert torch.equal(init.lm_head.weight, rows)  # the own lm_head starts as the target's rows
    meta = json.loads((final / "config.json").read_text())["metadata"]
    ev = meta["eval"]
    assert meta["training"]["steps"] == 6 and meta["mask_token"]["chosen_by"] == "least used answer token"
    assert list(meta["training"]["options"]) == ["dflash"]  # the card records the options DFlash reads
    assert meta["training"]["options"]["dflash"]["block_size"] == 4
    assert 1.0 <= ev["tau"] <= 4.0 and ev["positions"] > 0 and len(ev["accept_rate_by_depth"]) == 3
    assert 1.0 <= ev["tau_decode"] <= 4.0 and 0 < ev["decode_steps"]  # blocks where a decoder's steps start
    assert 0 < ev["draft_vocab_coverage"] <= 1  # the share of held-out answer tokens the draft vocabulary has
    assert len(ev["top1"]) == 3 and sum(ev["accept_hist"]) == ev["positions"] and len(ev["calibration"]["accuracy"]) == 3
    log = (tmp_path / "run" / "log.jsonl").read_text()
    assert '"acc_slot1"' in log and '"acc_slot3"' in log


def test_path_correction_trains_with_the_block(setup, tmp_path):
    """dflash.correction_rank: the correction's GRU and map train with the block (the map from zero),
    the evaluation runs the corrected drafts, and the decoder stays exact."""
    from headway.decode import Speculator

    target, tok = load_target(str(setup[1]), device="cpu")
    final = fit(config(setup, tmp_path / "run", **{"dflash.correction_rank": 16}), target, tok)
    heads = load_heads(final, target=target)
    assert heads.has_correction and heads.config.correction_rank == 16
    assert heads.correction.out.weight.abs().max() > 0  # it started at zero
    torch.manual_seed(0)
    fresh = DFlashTask(config(setup, tmp_path / "init", **{"dflash.correction_rank": 16})).build(target)
    for name, p in heads.correction.named_parameters():
        assert not torch.equal(p, dict(fresh.correction.named_parameters())[name]), f"{name} did not train"
    ev = json.loads((final / "config.json").read_text())["metadata"]["eval"]
    assert 1.0 <= ev["tau"] <= 4.0 and len(ev["top1"]) == 3
    ids = torch.tensor([[5, 17, 33, 80]])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          pad_token_id=2)[0, 4:].tolist()
    assert Speculator(target, tok, heads, tree="dynamic-3-3-8").generate(ids, max_new_tokens=12).ids == ref


def test_calibration_is_fitted_per_slot(setup, tmp_path):
    """`headway tune --calibration-data` on DFlash heads: one temperature per drafted depth."""
    from headway.train.calibrate import fit_calibration

    target, tok = load_target(str(setup[1]), device="cpu")
    heads = load_heads(fit(config(setup, tmp_path / "run", max_steps=2), target, tok), target=target)
    got = fit_calibration(heads, target, setup[2], max_rows=8)
    assert len(got["temperature_by_depth"]) == 3 and len(got["summary"]["accuracy"]) == 3
    assert len(heads.metadata["calibration"]["temperature_by_depth"]) == 3  # stored by training's evaluation


def test_resume_reproduces_the_uninterrupted_run(setup, tmp_path):
    kw = {"max_steps": 6, "eval_fraction": 0.0, "save_every": 2}
    full, part = tmp_path / "full", tmp_path / "part"
    train(config(setup, full, **kw))
    assert train(config(setup, part, stop_after=3, **kw)).name == "checkpoint-3"
    train(config(setup, part, resume_from="latest", **kw))
    a, b = losses(full), losses(part)
    assert len(a) == len(b) == 6
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=1e-6)  # anchors included


@pytest.mark.parametrize("vocab,argmax_from", [(None, "logits"), (128, "logits")])
def test_online_and_offline_features_give_identical_losses(setup, tmp_path, vocab, argmax_from):
    _, target_dir, data = setup
    cfg = config(setup, tmp_path, **{"dflash.draft_vocab_size": vocab, "dflash.argmax_from": argmax_from})
    online, offline = online_and_offline_losses(DFlashTask, cfg, target_dir, data, tmp_path / "feat",
                                                ["dflash", "final"])
    assert online[-1] != online[0]
    torch.testing.assert_close(torch.tensor(offline), torch.tensor(online), rtol=1e-5, atol=1e-5)


def test_options_are_checked(setup, tmp_path):
    with pytest.raises(ConfigError, match="dflash.block_size"):
        config(setup, tmp_path, **{"dflash.block_size": 1})
    with pytest.raises(ConfigError, match="dflash.gamma"):
        config(setup, tmp_path, **{"dflash.gamma": 0})
    target, _ = load_target(str(setup[1]), device="cpu")
    heads = DFlashTask(config(setup, tmp_path, **{"dflash.mask_token_id": 7, "dflash.aux_layers": [1, 2]})).build(target)
    assert heads.config.mask_token_id == 7 and heads.feature_layers == [1, 2]


@pytest.mark.slow
def test_a_briefly_trained_block_drafter_beats_its_untrained_self_and_decodes_faster(greedy_text, tmp_path):
    from headway.decode import Speculator

    target_dir, train_data, eval_data = greedy_text
    base = {"kind": "dflash", "target": str(target_dir), "data": str(train_data), "eval_data": str(eval_data),
            "batch_size": 8, "log_every": 50, "save_every": 0, "progress": False, "optim.lr": 3e-3,
            "optim.warmup_steps": 10, "dflash.block_size": 5, "dflash.draft_vocab_size": 256}
    before = load_heads(train(load_config(TrainConfig, None, {**base, "max_steps": 1,
                                                              "output_dir": str(tmp_path / "untrained")})))
    after = train(load_config(TrainConfig, None, {**base, "max_steps": 200, "output_dir": str(tmp_path / "trained")}))
    e0, e1 = before.metadata["eval"], load_heads(after).metadata["eval"]
    assert e0["tau"] < 1.1 and e1["tau"] > e0["tau"] + 0.3, (e0, e1)
    assert e1["tau_greedy"] == pytest.approx(e1["tau"], abs=0.02)
    assert e1["tau_decode"] > e0["tau_decode"] + 0.2, (e0, e1)
    # the decoder reaches the simulated acceptance on the same kind of text, and stays exact
    model, tok = load_target(str(target_dir))
    spec = Speculator.from_pretrained(model, after, tokenizer=tok, tree="chain-4")
    prompts = torch.randint(3, 384, (6, 4), generator=torch.Generator().manual_seed(1))
    taus = []
    for p in prompts.tolist():
        out = spec.generate(p, max_new_tokens=28)
        ref = model.generate(torch.tensor([p]), max_new_tokens=28, do_sample=False, pad_token_id=2)[0, 4:].tolist()
        assert out.ids == ref
        taus.append(out.stats.tau)
    assert sum(taus) / len(taus) > 1.1  # untrained: 1.0; the simulated 1.5 is over 24 rows, these are 6
