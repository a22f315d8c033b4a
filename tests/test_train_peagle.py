"""P-EAGLE training: the mask slots a step trains and what each may see (pure, by hand), the batched
training layout equal to a decoder's parallel draft slot for slot, the loss equal to its definition,
evaluation's chains equal to the decoder's drafts, what trains and what must not, the loss falling,
resume, online == offline features, calibration and the options' checks."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from headway.config import ConfigError, load_config
from headway.heads import PEagleDrafter, load_heads
from headway.target import load_target
from headway.testing import save_tiny_target, tiny_target
from headway.train.config import TrainConfig
from headway.train.errors import TrainError
from headway.train.parallel import cod_slots, every_slot, kept_per_depth, slot_mask
from headway.train.peagle import PEagleTask, chain_starts, parallel_drafts, peagle_loss, real_pass, slot_pass
from headway.train.recipe import fit, train
from headway.train.ttt import shift_left

from train_utils import distilled_rows, online_and_offline_losses, save_rows

pytestmark = pytest.mark.usefixtures("one_thread")
H, V = 64, 384


# -- pure pieces -------------------------------------------------------------------------------
def test_kept_per_depth_by_hand():
    assert kept_per_depth(10, 5, 0.7, 0.2, None) == [7, 4, 3, 2]  # floor(10 * max(0.7**d, 0.2))
    assert kept_per_depth(10, 5, 0.7, 0.2, 3) == [3, 3, 3, 2]
    assert kept_per_depth(0, 3, 0.7, 0.2, None) == [1, 1]  # every depth trains when it can


def test_cod_slots_keep_everything_at_ratio_one():
    """Row 0: answers at 2..7 of 8. Depth 1 needs x_{a+2} and x_{a+3} in the answer (a = 0..4), depth 2
    x_{a+4} too (0..3). Row 1's one answer token x_7 is no chain's: x_{a+2} would be x_6 (a prompt token)
    for the chain at 4 that reaches it, so only padding."""
    m = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 1]])
    anchor, depth, ok = cod_slots(m, torch.rand(2, 8), num_depths=3, ratio=1.0, ratio_min=0.0)
    n = int(ok[0].sum())
    assert anchor[0, :n].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3] and depth[0, :n].tolist() == [1] * 5 + [2] * 4
    assert n == anchor.shape[1] and not ok[1].any()


def test_cod_slots_nest_chains_and_follow_the_draws():
    g = torch.Generator().manual_seed(0)
    m = torch.zeros(3, 40, dtype=torch.long)
    m[0, 5:], m[1, 10:30], m[2, 2:] = 1, 1, 1
    draws = torch.rand(3, 40, generator=g)
    anchor, depth, ok = cod_slots(m, draws, num_depths=5, ratio=0.6, ratio_min=0.2)
    for b in range(3):
        chains = {d: set(anchor[b][ok[b] & (depth[b] == d)].tolist()) for d in range(1, 5)}
        for d in range(2, 5):
            assert chains[d] <= chains[d - 1]  # a chain kept at depth d is kept at every shallower depth
        for d, kept in chains.items():  # every token a kept chain predicts is an answer token
            assert all(a + d + 2 < 40 and all(m[b, a + j + 2] == 1 for j in range(d + 1)) for a in kept)
        assert [len(chains[d]) for d in range(1, 5)] == sorted((len(chains[d]) for d in range(1, 5)), reverse=True)
    again = cod_slots(m, draws, num_depths=5, ratio=0.6, ratio_min=0.2)
    assert all(torch.equal(x, y) for x, y in zip(again, (anchor, depth, ok)))  # a pure function of the draws
    other = cod_slots(m, torch.rand(3, 40, generator=g), num_depths=5, ratio=0.6, ratio_min=0.2)
    assert not torch.equal(other[0], anchor)


def test_slot_mask_by_hand():
    """T = 3 real slots; slots (1, d1), (1, d2), (0, d1) and one padding slot."""
    anchor, depth = torch.tensor([[1, 1, 0, 0]]), torch.tensor([[1, 2, 1, 0]])
    ok = torch.tensor([[True, True, True, False]])
    visible = slot_mask(anchor, depth, ok, 3, torch.float32)[0, 0] == 0
    assert visible.int().tolist() == [[1, 1, 0, 1, 0, 0, 0],   # (1, 1): real 0..1, itself
                                      [1, 1, 0, 1, 1, 0, 0],   # (1, 2): real 0..1, (1, 1), itself
                                      [1, 0, 0, 0, 0, 1, 0],   # (0, 1): real 0, itself
                                      [1, 0, 0, 0, 0, 0, 0]]   # padding: real 0 only (no NaN row)


def test_every_slot_lists_all_chains_of_a_range():
    anchor, depth, ok = every_slot(2, 3, 5, 3, "cpu")
    assert anchor[0].tolist() == [3, 3, 4, 4] and depth[1].tolist() == [1, 2, 1, 2] and ok.all()


# -- the batched layout is the decoder's ---------------------------------------------------------
@pytest.fixture(scope="module")
def pieces():
    target, _ = tiny_target("llama", num_hidden_layers=4)
    torch.manual_seed(5)
    d = PEagleDrafter.for_target(target, num_depths=4, num_layers=2, mask_token_id=9, norm_before_fc=True).eval()
    ids = torch.randint(3, V, (2, 14))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        fused = d.fuse([hs[i] for i in d.feature_layers])
    return d, ids, fused


def decoder_logits(d, ids, fused, b, a):
    """What a decoder's one parallel draft after real slots 0..a of row b gives: (K, Vd)."""
    x = shift_left(ids, 1)[b:b + 1, :a + 1]
    with torch.no_grad():
        return d.draft(x, fused[b:b + 1, :a + 1], torch.arange(a + 1)[None], d.new_cache())[0]


def test_training_slots_equal_the_decoders_parallel_draft(pieces):
    d, ids, fused = pieces
    m = torch.ones_like(ids)
    anchor, depth, ok = cod_slots(m, torch.rand(ids.shape), num_depths=4, ratio=0.6, ratio_min=0.2)
    with torch.no_grad():
        out0, cache = real_pass(d, ids, fused)
        outs = slot_pass(d, anchor, depth, ok, ids.shape[1], cache)
    for b in range(2):
        for a in (0, 5, 9):
            torch.testing.assert_close(d.logits(out0[b, a]), decoder_logits(d, ids, fused, b, a)[0],
                                       rtol=1e-4, atol=1e-4)
        for n in ok[b].nonzero().flatten().tolist():
            a, k = int(anchor[b, n]), int(depth[b, n])
            torch.testing.assert_close(d.logits(outs[b, n]), decoder_logits(d, ids, fused, b, a)[k],
                                       rtol=1e-4, atol=1e-4)


def test_evaluation_drafts_are_the_decoders(pieces):
    d, ids, fused = pieces
    start = chain_starts(torch.ones_like(ids), 4)
    drafts, sums = parallel_drafts(d, ids, fused, start, chunk=3)  # several chunks, the cache cropped between
    for b in range(2):
        for a in start[b].nonzero().flatten().tolist():
            want = d.to_target_ids(decoder_logits(d, ids, fused, b, a).argmax(-1))
            assert drafts[b, a].tolist() == want.tolist()
    assert len(sums) == 4 and all(float(s["count"].sum()) == float(start.sum()) for s in sums)


def test_the_loss_is_its_definition(pieces):
    """Mean soft CE over every scored slot: the real slot at t against the target at t + 1, slot (a, d)
    against the target at a + d + 1, only where that token is an answer token."""
    d, ids, fused = pieces
    g = torch.Generator().manual_seed(1)
    target_logits = torch.randn(2, 14, V, generator=g) * 3
    top = target_logits.argmax(-1)
    m = torch.tensor([[0] * 4 + [1] * 10, [0] * 6 + [1] * 6 + [0] * 2])
    slots = cod_slots(m, torch.rand(2, 14, generator=g), num_depths=4, ratio=0.7, ratio_min=0.2)
    with torch.no_grad():
        loss, metrics = peagle_loss(d, ids, fused, target_logits, top, m, slots)
    terms, by_depth = [], {}
    anchor, depth, ok = slots
    chains = [(b, a, 0) for b in range(2) for a in range(12)] + \
        [(b, int(anchor[b, n]), int(depth[b, n])) for b in range(2) for n in ok[b].nonzero().flatten().tolist()]
    for b, a, k in chains:
        if a + k + 2 >= 14 or not m[b, a + k + 2]:
            continue
        logq = F.log_softmax(decoder_logits(d, ids, fused, b, a)[k], -1)
        ce = -(F.softmax(target_logits[b, a + k + 1], -1) * logq).sum()
        terms.append(ce)
        by_depth.setdefault(k, []).append(ce)
    torch.testing.assert_close(loss, torch.stack(terms).mean(), rtol=1e-4, atol=1e-4)
    for k, ces in by_depth.items():
        torch.testing.assert_close(metrics[f"ce{k}"], torch.stack(ces).mean(), rtol=1e-4, atol=1e-4)
    assert set(by_depth) == {0, 1, 2, 3}


# -- through the loop ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("peagle_train")
    target = save_tiny_target(root / "target", num_hidden_layers=4)
    data = save_rows(root / "data", [{**r, "index": i} for i, r in enumerate(distilled_rows(48, 384, seed=1))])
    return root, target, data


def config(setup, out: Path, **kw) -> TrainConfig:
    _, target, data = setup
    base = {"kind": "peagle", "target": str(target), "data": str(data), "output_dir": str(out), "batch_size": 4,
            "max_steps": 6, "log_every": 1, "save_every": 0, "eval_fraction": 0.25, "progress": False,
            "optim.lr": 3e-3, "peagle.num_depths": 4, "peagle.draft_vocab_size": 128}
    return load_config(TrainConfig, None, {**base, **kw})


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]


def test_trains_every_drafter_tensor_and_leaves_target_bit_identical(setup, tmp_path):
    kw = {"peagle.own_embeddings": True, "peagle.norm_before_fc": True}
    target, tok = load_target(str(setup[1]), device="cpu")
    before = {k: v.clone() for k, v in target.state_dict().items()}
    torch.manual_seed(0)  # the loop's seed: the same initial weights as the run below
    init = PEagleTask(config(setup, tmp_path / "init", **kw)).build(target)
    final = fit(config(setup, tmp_path / "run", **kw), target, tok)
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), f"target tensor {k} changed"
    heads = load_heads(final, target=target)
    assert isinstance(heads, PEagleDrafter) and heads.config.num_depths == 4 and heads.config.num_layers == 2
    for name, p in heads.named_parameters():
        assert not torch.equal(p, dict(init.named_parameters())[name]), f"drafter tensor {name} did not train"
    assert torch.equal(heads.d2t, init.d2t) and int(heads.t2d.sum()) == 128
    assert torch.equal(init.lm_head.weight, target.get_output_embeddings().weight[init.draft_token_ids()])
    meta = json.loads((final / "config.json").read_text())["metadata"]
    ev = meta["eval"]
    assert list(meta["training"]["options"]) == ["peagle"] and meta["mask_token"]["chosen_by"]
    assert 1.0 <= ev["tau"] <= 5.0 and len(ev["accept_rate_by_depth"]) == 4 and len(ev["top1"]) == 4
    assert 1.0 <= ev["tau_decode"] <= 5.0 and ev["decode_steps"] > 0 and len(ev["tau_by_depth"]) == 4
    assert sum(ev["accept_hist"]) == ev["positions"] > 0 and len(ev["calibration"]["accuracy"]) == 4
    assert 0 < ev["draft_vocab_coverage"] <= 1
    log = (tmp_path / "run" / "log.jsonl").read_text()
    assert '"acc0"' in log and '"acc3"' in log and '"ce3"' in log


def test_a_frozen_lm_head_ends_the_run_as_the_targets_rows(setup, tmp_path):
    """``peagle.train_lm_head=false``: a real run trains the rest and saves the lm_head as it began."""
    target, tok = load_target(str(setup[1]), device="cpu")
    torch.manual_seed(0)
    init = PEagleTask(config(setup, tmp_path / "init", **{"peagle.train_lm_head": False})).build(target)
    assert not init.lm_head.weight.requires_grad
    final = fit(config(setup, tmp_path / "run", **{"peagle.train_lm_head": False}, eval_fraction=0.0), target, tok)
    heads = load_heads(final, target=target)
    assert torch.equal(heads.lm_head.weight, target.get_output_embeddings().weight[heads.draft_token_ids()])
    assert not torch.equal(heads.fc.weight, init.fc.weight)
    meta = json.loads((final / "config.json").read_text())["metadata"]
    assert meta["draft_vocab"]["lm_head_init"] == "target lm_head rows (frozen)"


def test_training_lowers_the_loss(setup, tmp_path):
    train(config(setup, tmp_path / "run", max_steps=24, eval_fraction=0.0))
    got = losses(tmp_path / "run")
    assert sum(got[-4:]) / 4 < 0.9 * sum(got[:4]) / 4, got  # deterministic: 5.47 -> 4.69 when written


def test_resume_reproduces_the_uninterrupted_run(setup, tmp_path):
    kw = {"max_steps": 6, "eval_fraction": 0.0, "save_every": 2}
    full, part = tmp_path / "full", tmp_path / "part"
    train(config(setup, full, **kw))
    assert train(config(setup, part, stop_after=3, **kw)).name == "checkpoint-3"
    train(config(setup, part, resume_from="latest", **kw))
    a, b = losses(full), losses(part)
    assert len(a) == len(b) == 6
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=1e-6)  # the slots included
    with pytest.raises(TrainError, match="'peagle.num_depths' was 4, now 5"):
        train(config(setup, part, resume_from="latest", **{**kw, "peagle.num_depths": 5}))


@pytest.mark.parametrize("vocab", [None, 128])
def test_online_and_offline_features_give_identical_losses(setup, tmp_path, vocab):
    _, target_dir, data = setup
    cfg = config(setup, tmp_path, **{"peagle.draft_vocab_size": vocab})
    online, offline = online_and_offline_losses(PEagleTask, cfg, target_dir, data, tmp_path / "feat",
                                                ["eagle3", "final"])
    assert online[-1] != online[0]
    torch.testing.assert_close(torch.tensor(offline), torch.tensor(online), rtol=1e-5, atol=1e-5)


def test_calibration_is_fitted_per_depth(setup, tmp_path):
    from headway.train.calibrate import fit_calibration

    target, tok = load_target(str(setup[1]), device="cpu")
    heads = load_heads(fit(config(setup, tmp_path / "run", max_steps=2), target, tok), target=target)
    got = fit_calibration(heads, target, setup[2], max_rows=8)
    assert len(got["temperature_by_depth"]) == 4 and len(got["summary"]["accuracy"]) == 4
    assert len(heads.metadata["calibration"]["temperature_by_depth"]) == 4


def test_options_are_checked(setup, tmp_path):
    for key, value, message in (("peagle.aux_layers", [1, 2], "exactly 3"), ("peagle.num_depths", 1, "num_depths"),
                                ("peagle.down_sample_ratio", 0.0, "down_sample_ratio"),
                                ("peagle.aux_layers", [3, 2, 1], "strictly increasing")):
        with pytest.raises(ConfigError, match=message):
            config(setup, tmp_path, **{key: value})
    out = tmp_path / "run"
    with pytest.raises(TrainError, match="'peagle.mask_token_id' is 9999"):
        train(config(setup, out, **{"peagle.mask_token_id": 9999}))
    assert not out.exists()
    target, _ = load_target(str(setup[1]), device="cpu")
    heads = PEagleTask(config(setup, tmp_path, **{"peagle.mask_token_id": 7, "peagle.aux_layers": [1, 2, 4]})).build(
        target)
    assert heads.config.mask_token_id == 7 and heads.feature_layers == [1, 2, 4]
