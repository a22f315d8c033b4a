"""DSpark heads on the DFlash block (headway/heads/dflash.py): the Markov head's bias and the
confidence head's estimate by hand, an untrained Markov head leaving the block as it was, the
survival a decoder reads, save / load, and the refusals."""

import pytest
import torch

from headway.heads import DFlashConfig, DFlashDrafter, HeadsError, load_heads
from headway.heads.dflash import survival
from headway.heads.layers import LayerGeometry
from headway.testing import tiny_target

H, V = 64, 384


@pytest.fixture(scope="module")
def target():
    model, _ = tiny_target("llama", num_hidden_layers=4)
    return model


def dspark(target, vocab=torch.arange(40, 140), **kw):
    torch.manual_seed(4)
    opts = {"markov_rank": 8, "confidence_head": True} | kw
    return DFlashDrafter.for_target(target, mask_token_id=5, block_size=4, aux_layers=[1, 2, 3], draft_vocab=vocab,
                                    **opts).eval()


def slots(d):
    torch.manual_seed(0)
    return torch.randn(2, 3, H), torch.tensor([[41, 50, 60], [70, 80, 1]])


def test_an_untrained_markov_head_is_the_plain_block(target):
    d = dspark(target)
    h, parents = slots(d)
    with torch.no_grad():
        plain = d.norm(h) @ d.lm_head.weight.T
        torch.testing.assert_close(d.logits(h, parents=parents), plain)  # markov_w2 starts at zero


def test_markov_bias_and_confidence_by_hand(target):
    d = dspark(target)
    h, parents = slots(d)
    with torch.no_grad():
        d.markov_head.markov_w2.weight.normal_()
        e = d.markov_head.markov_w1.weight[parents]  # (2, 3, r) the embedding of the token before each slot
        want = d.norm(h) @ d.lm_head.weight.T + e @ d.markov_head.markov_w2.weight.T
        torch.testing.assert_close(d.logits(h, parents=parents), want)
        x = torch.cat([d.norm(h), e], -1)
        p = torch.sigmoid(x @ d.confidence_head.proj.weight[0] + d.confidence_head.proj.bias[0])
        torch.testing.assert_close(d.confidence(h, parents), p)
        plain = dspark(target, confidence_with_markov=False)
        assert plain.confidence_head.proj.weight.shape == (1, H) and plain.confidence(h, parents).shape == (2, 3)
    with pytest.raises(HeadsError, match="needs the token before each slot"):
        d.logits(h)


def test_survival_is_the_running_product():
    conf = torch.tensor([[0.5, 0.5, 0.25], [1.0, 0.0, 1.0]])
    assert survival(conf).tolist() == [[0.5, 0.25, 0.0625], [1.0, 0.0, 0.0]]


def test_save_load_round_trip(target, tmp_path):
    d = dspark(target)
    with torch.no_grad():
        d.markov_head.markov_w2.weight.normal_()
    back = load_heads(d.save_pretrained(tmp_path / "h"), target=target)
    assert back.config == d.config and back.has_markov and back.has_confidence
    h, parents = slots(d)
    with torch.no_grad():
        torch.testing.assert_close(back.logits(h, parents=parents), d.logits(h, parents=parents))
        torch.testing.assert_close(back.confidence(h, parents), d.confidence(h, parents))


def test_old_dflash_checkpoints_load_without_the_new_fields(target, tmp_path):
    """A config.json written before DSpark (no markov_rank, confidence_head keys) is a plain DFlash."""
    import json

    folder = dspark(target, markov_rank=0, confidence_head=False).save_pretrained(tmp_path / "h")
    cfg = json.loads((folder / "config.json").read_text())
    for key in ("markov_rank", "confidence_head", "confidence_with_markov"):
        del cfg[key]
    (folder / "config.json").write_text(json.dumps(cfg))
    back = load_heads(folder, target=target)
    assert not back.has_markov and not back.has_confidence


def test_the_config_refuses_what_cannot_be_built():
    g = LayerGeometry(H, 128, 4, 2, 16)
    base = {"hidden_size": H, "vocab_size": V, "aux_layers": [1, 2], "layer": g}
    with pytest.raises(ValueError, match="use one"):
        DFlashConfig(**base, markov_rank=4, correction_rank=4)
    with pytest.raises(ValueError, match="confidence_with_markov needs a Markov head"):
        DFlashConfig(**base, confidence_head=True)
    assert DFlashConfig(**base, confidence_head=True, confidence_with_markov=False).confidence_head
