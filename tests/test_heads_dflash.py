"""The DFlash block drafter as a module: default layers, the training path equals the decoding
path, an incremental context equals a recomputed one, the block sees only the past, save / load."""

import pytest
import torch

from headway.decode.proposers import DFlashProposer, make_proposer
from headway.feature_layers import dflash_layers
from headway.heads import DFlashDrafter, HeadsError, load_heads
from headway.target import TargetError
from headway.testing import tiny_target
from headway.train.blocks import draft_blocks


@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama", num_hidden_layers=4)


def drafter(model, vocab=None, seed=0, **kw):
    torch.manual_seed(seed)
    d = DFlashDrafter.for_target(model, mask_token_id=3, block_size=kw.pop("block_size", 4),
                                 num_layers=kw.pop("num_layers", 2), draft_vocab=vocab, **kw)
    with torch.no_grad():  # random norms too, so that a wrong wiring of any of them shows
        for name, p in d.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return d.eval()


def features(model, ids, layers):
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return [hs[i] for i in layers]  # [(1, T, H)]


def test_default_layers_follow_the_reference_and_stay_distinct():
    assert dflash_layers(30) == [2, 9, 15, 21, 28]  # SmolLM2: the reference's layers 1, 8, 14, 20, 27, plus one
    assert dflash_layers(36) == [2, 10, 18, 26, 34]
    assert dflash_layers(8) == [2, 3, 4, 5, 6]
    for L in range(1, 12):
        got = dflash_layers(L)
        assert len(set(got)) == len(got) == min(5, L) and all(1 <= i <= L for i in got), (L, got)
    assert dflash_layers(12, n=1) == [7]
    with pytest.raises(ValueError, match="at least 1 layer"):
        dflash_layers(0)


def test_training_blocks_equal_decoding_blocks(llama):
    """A block drafted by the training path (every anchor of a row in one call, masked) equals the
    block the decoder drafts from the context of the positions before its anchor."""
    model, _ = llama
    d = drafter(model)
    ids = list(range(5, 25))
    feats = features(model, ids, d.feature_layers)
    with torch.no_grad():
        anchors = torch.tensor([[2, 7, 11, 16]])
        out = draft_blocks(d, torch.tensor([ids]), d.fuse(feats), anchors)  # (1, 4, bs, H)
        for j, a in enumerate(anchors[0].tolist()):
            ctx = d.context_kv(d.fuse([f[:, :a] for f in feats]), torch.arange(a)[None])
            x = d.block_embeddings(torch.tensor([[ids[a]]]))
            one = d(x, a + torch.arange(d.block_size)[None], ctx)  # no mask: the whole context, the whole block
            torch.testing.assert_close(out[0, j], one[0], rtol=1e-5, atol=1e-5)


def test_block_ignores_the_future_and_reads_every_slot(llama):
    """Changing features at or after the anchor changes nothing; the block is bidirectional: slot 1
    changes when the anchor token does, and slot 1 changes when only slot 3's position moves."""
    model, _ = llama
    d = drafter(model)
    ids = list(range(40, 60))
    feats = features(model, ids, d.feature_layers)
    later = [f.clone() for f in feats]
    for f in later:
        f[:, 9:] += torch.randn_like(f[:, 9:])
    with torch.no_grad():
        a = torch.tensor([[9]])
        base = draft_blocks(d, torch.tensor([ids]), d.fuse(feats), a)
        torch.testing.assert_close(draft_blocks(d, torch.tensor([ids]), d.fuse(later), a), base)
        other = list(ids)
        other[9] += 1
        assert not torch.allclose(draft_blocks(d, torch.tensor([other]), d.fuse(feats), a)[0, 0, 1], base[0, 0, 1])
        ctx = d.context_kv(d.fuse([f[:, :9] for f in feats]), torch.arange(9)[None])
        x = d.block_embeddings(torch.tensor([[ids[9]]]))
        pos = 9 + torch.arange(d.block_size)[None]
        moved = pos.clone()
        moved[0, 3] += 5
        assert not torch.allclose(d(x, moved, ctx)[0, 1], d(x, pos, ctx)[0, 1])


@pytest.mark.parametrize("vocab", [None, torch.arange(100, 200)])
def test_incremental_context_equals_a_fresh_prefill(llama, vocab):
    """The proposer's context after prefill + accepted steps drafts what a proposer prefilled on the
    whole prefix drafts."""
    model, _ = llama
    d = drafter(model, vocab)
    ids = list(range(7, 30))
    feats = features(model, ids, d.feature_layers)
    p = make_proposer(d)
    assert isinstance(p, DFlashProposer) and p.max_depth == 3
    with torch.no_grad():
        prefill(p, ids[:10], [f[:, :10] for f in feats], ids[10])
        p.root_logprobs()
        twin = p.fork()
        p.accept([torch.tensor(ids[10:15])], [[f[0, 10:14] for f in feats]], [10])  # root 10, 3 accepted, bonus 14
        p.accept([torch.tensor(ids[14:16])], [[f[0, 14:15] for f in feats]], [14])  # nothing accepted, bonus 15
        fresh = make_proposer(d)
        prefill(fresh, ids[:15], [f[:, :15] for f in feats], ids[15])
        torch.testing.assert_close(p.root_logprobs(), fresh.root_logprobs())
        torch.testing.assert_close(p.expand(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[1, 2]]), 2),
                                   fresh.logp[:, 2, None].expand(1, 2, -1))
        assert twin.base.tolist() == [10] and p.base.tolist() == [15]  # a fork is independent of later steps
    assert p.root_logprobs().shape == (1, d.draft_vocab_size)


def prefill(p, ids, feats, first):
    """A batch of one prompt (no padding)."""
    tokens = torch.tensor([ids])
    p.prefill(tokens, torch.ones_like(tokens, dtype=torch.bool), torch.arange(len(ids))[None], feats,
              torch.tensor([first]))


def test_save_load_round_trip_and_refusals(llama, tmp_path):
    model, _ = llama
    for vocab in (None, torch.arange(50, 150)):
        d = drafter(model, vocab, aux_layers=[1, 3])
        path = d.save_pretrained(tmp_path / f"d{vocab is None}")
        back = load_heads(path, target=model)
        assert isinstance(back, DFlashDrafter) and back.config == d.config
        assert back.state_dict().keys() == d.state_dict().keys()
        assert all(torch.equal(v, back.state_dict()[k]) for k, v in d.state_dict().items())
        # borrowed target modules are not saved: the full-vocabulary drafter owns no lm_head
        assert ("lm_head.weight" in d.state_dict()) == (vocab is not None)
        assert not any(k.startswith(("_target", "embed")) for k in d.state_dict())
    assert "DFlash block drafter" in (path / "README.md").read_text()
    wide, _ = tiny_target("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=4)
    with pytest.raises(TargetError, match=r"hidden_size=64.*hidden_size=32"):
        load_heads(path, target=wide)
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        DFlashDrafter.for_target(model, mask_token_id=3, block_size=1)
    with pytest.raises(ValueError, match="mask_token_id must be a target token id"):
        DFlashDrafter.for_target(model, mask_token_id=10_000)


def test_parameters_are_distinct_per_layer(llama):
    """Every draft layer owns its tensors (Medusa's shared-ResBlock bug, not repeated here)."""
    model, _ = llama
    one, three = drafter(model, num_layers=1), drafter(model, num_layers=3)
    per_layer = sum(p.numel() for p in one.layers[0].parameters())
    assert sum(p.numel() for p in three.parameters()) - sum(p.numel() for p in one.parameters()) == 2 * per_layer
    ptrs = {p.data_ptr() for p in three.parameters()}
    assert len(ptrs) == len(list(three.parameters()))
    with pytest.raises(HeadsError, match="not attached"):
        DFlashDrafter(one.config).target_embed


def test_path_correction_starts_as_the_block_then_reads_the_path(llama, tmp_path):
    """correction_rank: untrained (its map is zero) every slot reads as the plain block; with weights,
    a slot's distribution changes with the token drafted before it, the decoder's node-by-node steps
    equal training's teacher-forced states, and the correction survives save / load. No engine
    computes it, so the exports refuse it by name."""
    from headway.heads.export import ExportError, export_heads

    model, _ = llama
    d = drafter(model, torch.arange(50, 150), correction_rank=8, aux_layers=[1, 3])
    ids = list(range(5, 25))
    a = 7
    feats = [f[:, :a] for f in features(model, ids, d.feature_layers)]
    parents = torch.tensor([ids[a:a + d.block_size - 1]])  # (1, 3): the anchor, then the data's tokens
    with torch.no_grad():
        out = d.block_outputs(torch.tensor([ids[a]]), torch.tensor([a]),
                              d.context_kv(d.fuse(feats), torch.arange(a)[None]))  # (1, 3, H)
        torch.testing.assert_close(d.logits(out, d.path_states(out, parents)), d.logits(out))
        d.correction.out.weight.normal_(0, 1.0)
        want = torch.log_softmax(d.logits(out, d.path_states(out, parents)).float(), dim=-1)[0]  # (3, Vd)
        assert not torch.allclose(want, torch.log_softmax(d.logits(out).float(), dim=-1)[0], atol=1e-3)

        p = DFlashProposer(d)
        prefill(p, ids[:a], feats, ids[a])
        torch.testing.assert_close(p.root_logprobs()[0], want[0], rtol=1e-5, atol=1e-5)
        twin = p.fork()
        one = torch.zeros(1, 1, dtype=torch.long)
        torch.testing.assert_close(p.expand(one, parents[:, 1:2], 1)[0, 0], want[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(p.expand(one, parents[:, 2:3], 2)[0, 0], want[2], rtol=1e-5, atol=1e-5)
        other = twin.expand(one, torch.tensor([[ids[a + 1] + 1]]), 1)[0, 0]  # another parent token
        assert not torch.allclose(other, want[1], atol=1e-3)

    path = d.save_pretrained(tmp_path / "corr")
    back = load_heads(path, target=model)
    assert back.config.correction_rank == 8
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in d.state_dict().items())
    for fmt in ("vllm", "speculators"):
        with pytest.raises(ExportError, match="path correction"):
            export_heads(path, fmt, tmp_path / fmt, target=model)
        assert not (tmp_path / fmt).exists()
