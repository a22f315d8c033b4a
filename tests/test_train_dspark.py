"""DSpark as a DFlash option: the Markov and confidence heads train with the block (the target left
bit-identical), the confidence term is its definition, and evaluation reports the confidence head
against the overlap it estimates."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from headway.config import ConfigError
from headway.heads import DFlashDrafter, load_heads
from headway.target import load_target
from headway.testing import tiny_target
from headway.train.blocks import draft_blocks, select_anchors, anchor_candidates, slot_labels, slot_parents
from headway.train.config import TrainConfig
from headway.train.dflash import DFlashTask, dflash_loss
from headway.train.recipe import fit

from test_train_dflash import config as dflash_config, setup  # noqa: F401  (setup: the fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
DSPARK = {"dflash.markov_rank": 8, "dflash.confidence_head": True}


def config(setup, out: Path, **kw) -> TrainConfig:
    """test_train_dflash's recipe with DSpark's heads."""
    return dflash_config(setup, out, **{**DSPARK, **kw})


def test_dspark_heads_train_with_the_block_and_leave_the_target_bit_identical(setup, tmp_path):
    target, tok = load_target(str(setup[1]), device="cpu")
    before = {k: v.clone() for k, v in target.state_dict().items()}
    torch.manual_seed(0)
    init = DFlashTask(config(setup, tmp_path / "init")).build(target)
    final = fit(config(setup, tmp_path / "run"), target, tok)
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), f"target tensor {k} changed"
    heads = load_heads(final, target=target)
    assert isinstance(heads, DFlashDrafter) and heads.has_markov and heads.has_confidence
    trained = dict(init.named_parameters())
    for name, p in heads.named_parameters():
        assert not torch.equal(p, trained[name]), f"drafter tensor {name} did not train"
    assert not init.markov_head.markov_w2.weight.any()  # it started at zero
    ev = json.loads((final / "config.json").read_text())["metadata"]["eval"]
    conf = ev["confidence_head"]
    assert [len(conf[k]) for k in ("estimate", "overlap", "abs_error")] == [3, 3, 3]
    assert all(0 <= x <= 1 for k in ("estimate", "overlap") for x in conf[k])
    assert 1.0 <= ev["tau"] <= 4.0 and len(ev["top1"]) == 3
    log = (tmp_path / "run" / "log.jsonl").read_text()
    assert '"confidence_bce"' in log and '"confidence_error"' in log


def test_the_confidence_term_is_its_definition():
    """loss(weight 1) - loss(weight 0) = Σ_k w_k · BCE(logit, Σ_v min(p_v, q_v)) / scored slots, q the
    Markov-biased draft at the slot (teacher-forced on the data's tokens), p the target's over the draft
    vocabulary at the token before it."""
    target, _ = tiny_target("llama", num_hidden_layers=4)
    torch.manual_seed(0)
    d = DFlashDrafter.for_target(target, mask_token_id=5, block_size=4, aux_layers=[1, 2, 3], markov_rank=8,
                                 confidence_head=True, draft_vocab=torch.arange(384))
    with torch.no_grad():
        d.markov_head.markov_w2.weight.normal_()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 384, (2, 16), generator=g)
    mask = torch.tensor([[0] * 3 + [1] * 13, [0] * 5 + [1] * 11])
    context = d.fuse([torch.randn(2, 16, 64, generator=g) for _ in range(3)])
    tl = torch.randn(2, 16, 384, generator=g) * 2
    anchors, valid = select_anchors(anchor_candidates(mask, 4), 5, torch.rand(2, 16, generator=g))
    args = (d, ids, context, tl, tl.argmax(-1), mask, anchors, valid)
    with torch.no_grad():
        delta = dflash_loss(*args, gamma=2.0, confidence_weight=1.0)[0] - dflash_loss(*args, gamma=2.0,
                                                                                       confidence_weight=0.0)[0]
        out = draft_blocks(d, ids, context, anchors)[:, :, 1:]
        pos, scored = slot_labels(anchors, valid, mask, 4)
        parents = slot_parents(ids, pos)
        terms = []
        for b, j, k in scored.nonzero().tolist():
            q = d.logits(out[b, j, k], parents=parents[b, j, k]).softmax(-1)
            overlap = torch.minimum(q, tl[b, pos[b, j, k] - 1].softmax(-1)).sum()
            z = d.confidence_logit(out[b, j, k], parents[b, j, k])
            terms.append(torch.exp(torch.tensor(-k / 2.0)) * F.binary_cross_entropy_with_logits(z, overlap))
    torch.testing.assert_close(delta, torch.stack(terms).sum() / len(terms), rtol=1e-4, atol=1e-5)


def test_dspark_options_are_checked(setup, tmp_path):
    with pytest.raises(ConfigError, match="markov_rank' and 'dflash.correction_rank"):
        config(setup, tmp_path, **{"dflash.correction_rank": 4})
    with pytest.raises(ConfigError, match="confidence_with_markov' needs a Markov head"):
        config(setup, tmp_path, **{"dflash.markov_rank": 0})
    ok = config(setup, tmp_path, **{"dflash.markov_rank": 0, "dflash.confidence_with_markov": False})
    assert ok.dflash.confidence_head and not ok.dflash.markov_rank
