"""EAGLE pure parts: the training-time-test mask, unrolling == inference drafting, losses,
simulated acceptance, draft vocabulary mapping, and the drafter layer's attention geometry."""

import pytest
import torch
import torch.nn.functional as F

from headway.heads import Eagle1Drafter, Eagle3Drafter
from headway.heads.layers import DraftCache
from headway.testing import tiny_target
from headway.train.ttt import (chain_accepted, decoder_step_starts, eagle1_loss, eagle3_ttt_loss, label_mask, label_rows, rows_mask,
                               shift_left, summarize_acceptance, acceptance_stats, ttt_mask, unroll, unroll_rows)

NEG = torch.finfo(torch.float32).min


def visible(mask):
    return (mask[0, 0] == 0).int().tolist()


def test_ttt_mask_hand_drawn_three_steps():
    # T = 3; columns: step-0 keys 0..2 | step-1 keys 0..2 | step-2 keys 0..2
    assert visible(ttt_mask(3, 0, torch.float32, "cpu")) == [
        [1, 0, 0],
        [1, 1, 0],
        [1, 1, 1]]
    assert visible(ttt_mask(3, 2, torch.float32, "cpu")) == [
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1]]
    m = ttt_mask(4, 1, torch.bfloat16, "cpu")
    assert m.shape == (1, 1, 4, 8) and m.dtype == torch.bfloat16
    assert m[0, 0, 0, 1] == torch.finfo(torch.bfloat16).min and m[0, 0, 3, 7] == 0


def test_shift_left():
    x = torch.tensor([[1, 2, 3, 4]])
    assert shift_left(x, 2).tolist() == [[3, 4, 0, 0]]
    assert shift_left(x, 5, -1).tolist() == [[-1, -1, -1, -1]]


@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama")


def drafters(target):
    torch.manual_seed(0)
    e1 = Eagle1Drafter.for_target(target)
    e3 = Eagle3Drafter.for_target(target, draft_vocab_size=200)
    e3.set_draft_vocab(torch.randperm(target.config.vocab_size)[:200])
    for d in (e1, e3):  # random drafters: make the residual branches matter
        with torch.no_grad():
            for p in d.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.2)
    return e1, e3


def features(drafter, target, ids):
    out = target(input_ids=ids, output_hidden_states=True)
    hs = out.hidden_states
    return drafter.fuse([hs[i] for i in drafter.feature_layers]), out.logits


@pytest.mark.parametrize("which", [0, 1])
def test_unroll_equals_inference_drafting(llama, which):
    """Unrolled step j at index t == a depth-j chain node drafted after the prefix 0..t, through a cache."""
    target, _ = llama
    drafter = drafters(target)[which]
    torch.manual_seed(1)
    ids = torch.randint(3, 300, (2, 9))
    hidden, _ = features(drafter, target, ids)
    steps = 4
    outs = [o for o, _ in unroll(drafter, ids, hidden, steps)]
    for t in (0, 3, 4):
        P = t + 1
        cache = DraftCache()
        pos = torch.arange(P)[None].expand(2, P)
        mask = ttt_mask(P, 0, torch.float32, "cpu")
        h = drafter(ids[:, 1:P + 1], hidden[:, :P], pos, mask, cache)[:, -1:]  # prefix entries 0..t
        torch.testing.assert_close(h[:, 0], outs[0][:, t], atol=2e-4, rtol=2e-4)
        for j in range(1, steps):
            if t + j + 1 >= ids.shape[1]:
                break
            node_mask = torch.zeros(1, 1, 1, len(cache) + 1)  # the node sees the prefix, its ancestors, itself
            h = drafter(ids[:, t + j + 1:t + j + 2], h, torch.full((2, 1), t + j), node_mask, cache)
            torch.testing.assert_close(h[:, 0], outs[j][:, t], atol=2e-4, rtol=2e-4)


def test_label_rows_and_rows_mask_by_hand():
    # steps 1..2 need index t where token t+3 or t+4 is an answer token
    lm = torch.tensor([[0, 0, 0, 0, 1, 1, 0, 0],
                       [0, 1, 1, 1, 1, 1, 1, 0]])
    idx, ok = label_rows(lm, 3)
    assert idx.shape == (2, 4) and ok.tolist() == [[True] * 3 + [False], [True] * 4]
    assert idx[0, :3].tolist() == [0, 1, 2] and idx[1].tolist() == [0, 1, 2, 3]
    m = rows_mask(torch.tensor([[1, 3]]), 4, 1, torch.float32)  # 2 queries at indices 1, 3; step 1
    assert m.shape == (1, 1, 2, 6)
    assert (m[0, 0] == 0).int().tolist() == [[1, 1, 0, 0, 1, 0],
                                             [1, 1, 1, 1, 0, 1]]


def reference_ttt_loss(d, ids, fused, logits, loss_mask, steps, decay, hard_weight):
    """The loss with every step run at every index (plain ``unroll``): what skipping rows must equal."""
    draft_ids = d.draft_token_ids()
    p = F.softmax(logits.float()[..., draft_ids], -1)
    top = logits.argmax(-1)
    to_draft = torch.zeros(d.t2d.numel(), dtype=torch.long)
    to_draft[draft_ids] = torch.arange(draft_ids.numel())
    loss = 0.0
    for j, (out, lg) in enumerate(unroll(d, ids, fused, steps)):
        valid = label_mask(loss_mask, j + 2) & shift_left(d.t2d[top], j + 1, False)
        logq = F.log_softmax(lg[valid].float(), -1)
        n = valid.sum().clamp(min=1)
        ce = -(shift_left(p, j + 1)[valid] * logq).sum() / n
        hard = F.nll_loss(logq, to_draft[shift_left(top, j + 1)[valid]], reduction="sum") / n
        loss = loss + decay ** j * (ce + hard_weight * hard)
    return loss


def test_eagle3_loss_skipping_prompt_rows_equals_the_full_unroll(llama):
    """Steps 1.. run only where a label follows (answers of rows with prompts and padding of
    different lengths): loss and every gradient equal running them everywhere."""
    target, _ = llama
    _, d = drafters(target)
    d.set_draft_vocab(torch.arange(200))
    torch.manual_seed(3)
    ids = torch.randint(3, 300, (3, 14))
    fused, logits = (x.detach() for x in features(d, target, ids))
    lm = torch.zeros_like(ids)
    lm[0, 5:12] = 1  # prompt 0..4, answer, padding 12..13
    lm[1, 2:] = 1
    lm[2, 9:11] = 1
    assert label_rows(lm, 4)[0].shape[1] < ids.shape[1]  # rows really were skipped
    got, _ = eagle3_ttt_loss(d, ids, fused, logits, lm, steps=4, decay=0.8, hard_weight=1.0)
    g_got = torch.autograd.grad(got, list(d.parameters()), allow_unused=True)
    want = reference_ttt_loss(d, ids, fused, logits, lm, 4, 0.8, 1.0)
    g_want = torch.autograd.grad(want, list(d.parameters()), allow_unused=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for (name, _), a, b in zip(d.named_parameters(), g_got, g_want):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    outs = list(unroll_rows(d, ids, fused, 4, label_rows(lm, 4)[0]))
    assert outs[0].shape[1] == 14 and outs[1].shape[1] == label_rows(lm, 4)[0].shape[1]


def test_eagle3_loss_one_step_by_hand(llama):
    target, _ = llama
    _, d = drafters(target)
    ids = torch.randint(3, 300, (2, 8))
    fused, logits = features(d, target, ids)
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :3] = 0
    loss, m = eagle3_ttt_loss(d, ids, fused, logits, loss_mask, steps=1)
    # by hand: index t predicts the target distribution at t+1 over the draft vocab
    draft_ids = torch.nonzero(d.t2d)[:, 0]
    out = d(ids[:, 1:], fused[:, :-1], torch.arange(7)[None].expand(2, 7), ttt_mask(7, 0, torch.float32, "cpu"))
    p = F.softmax(logits[:, 1:, draft_ids], -1)
    ce = -(p * F.log_softmax(d.logits(out), -1)).sum(-1)  # (2, 7)
    valid = torch.zeros(2, 7, dtype=torch.bool)
    valid[:, 1:6] = True  # predicted token t+2 in 3..7 and inside the sequence
    valid &= d.t2d[logits[:, 1:].argmax(-1)]
    expect = ce[valid].mean() if valid.any() else torch.tensor(0.0)
    torch.testing.assert_close(loss, expect, atol=1e-5, rtol=1e-5)
    assert set(m) == {"ce0", "acc0"}
    # hard_weight adds a cross-entropy to the target's argmax (as a draft-vocab index)
    assert valid.any()
    top = logits[:, 1:].argmax(-1)  # (2, 7) target ids of the label at t+1
    label = (draft_ids[None, None] == top[..., None]).float().argmax(-1)
    hard = F.cross_entropy(d.logits(out)[valid], label[valid])
    both, m_hard = eagle3_ttt_loss(d, ids, fused, logits, loss_mask, steps=1, hard_weight=0.5)
    torch.testing.assert_close(both, expect + 0.5 * hard, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m_hard["ce0"], m["ce0"])  # the logged ce stays the soft one


def test_eagle3_loss_weights_steps_and_reaches_every_parameter(llama):
    target, _ = llama
    _, d = drafters(target)
    d.set_draft_vocab(torch.arange(200))
    ids = torch.randint(3, 200, (2, 10))
    fused_in = [target(input_ids=ids, output_hidden_states=True).hidden_states[i] for i in d.feature_layers]
    logits = target(input_ids=ids).logits
    with torch.no_grad():  # every position's target argmax inside the draft vocabulary
        logits[..., :200] += 100
    lm = torch.ones_like(ids)
    loss, m = eagle3_ttt_loss(d, ids, d.fuse(fused_in), logits, lm, steps=3, decay=0.5)
    torch.testing.assert_close(loss, m["ce0"] + 0.5 * m["ce1"] + 0.25 * m["ce2"])
    loss.backward()
    for name, p in d.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_eagle3_loss_masks_tokens_outside_draft_vocab(llama):
    target, _ = llama
    _, d = drafters(target)
    ids = torch.randint(3, 300, (1, 8))
    fused, logits = features(d, target, ids)
    outside = torch.nonzero(~d.t2d)[0, 0]
    logits = logits.clone()
    logits[..., outside] += 1000  # the target always prefers a token the drafter cannot emit
    loss, m = eagle3_ttt_loss(d, ids, fused, logits, torch.ones_like(ids), steps=2)
    assert loss == 0 and m["acc0"] == 0


def test_eagle1_loss_parts(llama):
    target, _ = llama
    d, _ = drafters(target)
    ids = torch.randint(3, 300, (2, 8))
    out = target(input_ids=ids, output_hidden_states=True)
    f = out.hidden_states[-1]
    lm = torch.ones_like(ids)
    loss, m = eagle1_loss(d, ids, f, out.logits, lm, noise=None, feature_weight=1.0, ce_weight=0.1)
    torch.testing.assert_close(loss, m["feature"] + 0.1 * m["ce0"])
    noisy, _ = eagle1_loss(d, ids, f, out.logits, lm, noise=torch.full_like(f, 0.05))
    assert noisy != loss
    # the feature target is f_{t+1}: a drafter predicting exactly that has zero feature loss
    pred = d(ids[:, 1:], f[:, :-1], torch.arange(7)[None].expand(2, 7), ttt_mask(7, 0, torch.float32, "cpu"))
    by_hand = F.smooth_l1_loss(pred[:, :6], f[:, 1:7])
    torch.testing.assert_close(m["feature"], by_hand, atol=1e-5, rtol=1e-5)
    # the CE: soft labels = the target's distribution at t+1, scored at the trained positions t < T-2
    p = F.softmax(out.logits[:, 1:7].float(), -1)
    q = F.log_softmax(d.full_logits(pred[:, :6]).float(), -1)
    torch.testing.assert_close(m["ce0"], -(p * q).sum(-1).mean(), atol=1e-5, rtol=1e-5)


def test_eagle1_loss_with_a_draft_vocab_scores_only_its_rows(llama):
    """With a draft vocabulary the CE is over its rows (the target's distribution renormalised on
    them), prompt positions (loss_mask 0) carry no label, and acc compares target ids."""
    target, _ = llama
    torch.manual_seed(1)
    d = Eagle1Drafter.for_target(target, draft_vocab=torch.randperm(target.config.vocab_size)[:50])
    ids = torch.randint(3, 300, (2, 9))
    out = target(input_ids=ids, output_hidden_states=True)
    f = out.hidden_states[-1]
    lm = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]] * 2)  # tokens 3..8 are answers: positions 1..6 trained
    _, m = eagle1_loss(d, ids, f, out.logits, lm, noise=None)
    pred = d(ids[:, 1:], f[:, :-1], torch.arange(8)[None].expand(2, 8), ttt_mask(8, 0, torch.float32, "cpu"))
    draft_ids = d.draft_token_ids()  # the draft rows' target ids (sorted)
    p = F.softmax(out.logits[:, 2:8].float()[..., draft_ids], -1)  # labels at t+1 for t = 1..6
    logits = d.draft_logits(pred[:, 1:7])
    q = F.log_softmax(logits.float(), -1)
    torch.testing.assert_close(m["ce0"], -(p * q).sum(-1).mean(), atol=1e-5, rtol=1e-5)
    hits = d.draft_to_target_ids(logits.argmax(-1)) == out.logits[:, 2:8].argmax(-1)
    torch.testing.assert_close(m["acc0"], hits.float().mean())
    lm_all = torch.ones_like(ids)
    assert eagle1_loss(d, ids, f, out.logits, lm_all, noise=None)[1]["ce0"] != m["ce0"]


def naive_chain(drafter, ids, hidden, t, depth):
    """Inference-style greedy chain after the prefix 0..t: the drafter's target-id tokens."""
    P = t + 1
    cache = DraftCache()
    h = drafter(ids[:, 1:P + 1], hidden[:, :P], torch.arange(P)[None], ttt_mask(P, 0, torch.float32, "cpu"), cache)
    h = h[:, -1:]
    out = []
    for j in range(depth):
        tok = drafter.to_target_ids(drafter.logits(h).argmax(-1))  # (1, 1)
        out.append(int(tok))
        if j + 1 < depth:
            h = drafter(tok, h, torch.full((1, 1), t + j + 1), torch.zeros(1, 1, 1, len(cache) + 1), cache)
    return out


@pytest.mark.parametrize("which", [0, 1])
def test_chain_acceptance_matches_naive_decoding(llama, which):
    target, _ = llama
    drafter = drafters(target)[which]
    torch.manual_seed(2)
    T, depth = 12, 3
    ids = torch.randint(3, 300, (1, T))
    hidden, _ = features(drafter, target, ids)
    chains = {t: naive_chain(drafter, ids, hidden, t, depth) for t in range(T - depth - 1)}
    # a fake verifier whose next token agrees with chain t0 for exactly 2 tokens
    t0 = 4
    greedy = torch.randint(3, 300, (T,))
    greedy[t0 + 1: t0 + 3] = torch.tensor(chains[t0][:2])
    greedy[t0 + 3] = (chains[t0][2] + 1) % 300
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :2] = 0
    accepted, start = chain_accepted(drafter, ids, hidden, greedy[None], loss_mask, depth)
    assert accepted[0, t0] == 2
    for t in range(T):
        fits = t >= 0 and t + depth + 1 < T
        assert bool(start[0, t]) == fits
        if fits:
            n = 0
            while n < depth and chains[t][n] == int(greedy[t + n + 1]):
                n += 1
            assert accepted[0, t] == n, t


def test_acceptance_summary():
    accepted = torch.tensor([[0, 1, 3, 2, 3]])
    start = torch.tensor([[True, True, True, True, False]])
    s = summarize_acceptance(acceptance_stats(accepted, start, 3))
    assert s["positions"] == 4 and s["tau"] == pytest.approx(1 + 6 / 4)
    assert s["accept_rate_by_depth"] == pytest.approx([0.75, 0.5, 0.25])
    assert s["tau_by_depth"] == pytest.approx([1.75, 2.25, 2.5])  # accepted (0, 1, 3, 2) cut at 1, 2, 3


def test_decoder_step_starts_walk_each_answer_as_a_greedy_chain_decoder():
    """Only where a decoder's steps start: the prefill gives an answer's first token, a step that
    accepts a drafts moves a + 1 on, each answer of a chat row is walked, a walk ends where a full
    chain no longer fits. 9 marks counts the walk must never read."""
    T = 20
    loss_mask = torch.zeros(1, T, dtype=torch.long)
    loss_mask[0, 3:12] = 1  # the first answer
    loss_mask[0, 14:20] = 1  # a second turn's answer
    accepted = torch.tensor([[9, 9, 2, 9, 9, 1, 9, 3, 9, 9, 9, 9, 9, 0, 2, 9, 9, 9, 9, 9]])
    start = torch.zeros(1, T, dtype=torch.bool)
    start[0, 2:9] = True
    start[0, 13:17] = True
    steps = decoder_step_starts(accepted, start, loss_mask)
    # index 2 (reads token 3) accepts 2 -> 5 accepts 1 -> 7 accepts 3 -> 11: no full chain fits;
    # the second answer: 13 accepts 0 -> 14 accepts 2 -> 17: none fits
    assert steps[0].nonzero().flatten().tolist() == [2, 5, 7, 13, 14]
    s = summarize_acceptance(acceptance_stats(accepted, steps, 3))
    assert s["tau"] == pytest.approx(1 + (2 + 1 + 3 + 0 + 2) / 5)


def test_draft_vocab_round_trip(llama, tmp_path):
    from headway.data.vocab import draft_vocab
    from headway.heads.eagle_import import check_draft_vocab, t2d_from_d2t

    target, _ = llama
    counts = torch.zeros(384, dtype=torch.long)
    counts[torch.randperm(384)[:150]] = torch.randint(1, 100, (150,))
    d2t_ids, d2t, t2d = draft_vocab(counts, 64)
    d = Eagle3Drafter.for_target(target, draft_vocab_size=64)
    d.set_draft_vocab(d2t_ids)
    assert torch.equal(d.d2t, d2t) and torch.equal(d.t2d, t2d)
    assert torch.equal(d.to_target_ids(torch.arange(64)), d2t_ids)
    assert torch.equal(torch.nonzero(d.t2d)[:, 0], d2t_ids)
    assert torch.equal(t2d_from_d2t(d2t, 384), t2d)
    check_draft_vocab(d2t, t2d, "here")
    # target id -> draft id through t2d: the cumulative count of t2d
    t2d_index = torch.cumsum(t2d.long(), 0) - 1
    assert torch.equal(t2d_index[d2t_ids], torch.arange(64))
    d.save_pretrained(tmp_path / "e3")
    back = Eagle3Drafter.from_pretrained(tmp_path / "e3", target=target)
    assert torch.equal(back.d2t, d.d2t) and torch.equal(back.t2d, d.t2d)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_drafter_follows_target_geometry(arch):
    target, _ = tiny_target(arch)
    cfg = target.config
    for d in (Eagle1Drafter.for_target(target), Eagle3Drafter.for_target(target)):
        layer = d.layers[0] if d.kind == "eagle1" else d.midlayer
        attn = layer.self_attn
        hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        assert attn.q_proj.out_features == cfg.num_attention_heads * hd
        assert attn.k_proj.out_features == cfg.num_key_value_heads * hd < attn.q_proj.out_features  # GQA
        assert layer.mlp.gate_proj.out_features == cfg.intermediate_size
        x = torch.zeros(1, 3, cfg.hidden_size)
        pos = torch.arange(0, 600, 7)[None]
        for a, b in zip(target.model.rotary_emb(x, pos), d.rope(x, pos)):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_drafter_rotary_matches_llama3_rope_scaling():
    from transformers import AutoModelForCausalLM, LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=384, max_position_embeddings=1024, rope_parameters=rope)
    target = AutoModelForCausalLM.from_config(cfg).eval()
    for d in (Eagle1Drafter.for_target(target), Eagle3Drafter.for_target(target)):
        assert d.rotary.rope_type == "llama3"
        x = torch.zeros(1, 3, 64)
        pos = torch.arange(0, 1024, 3)[None]  # past original_max_position_embeddings: scaling matters
        tc, ts = target.model.rotary_emb(x, pos)
        dc, ds = d.rope(x, pos)
        torch.testing.assert_close(dc, tc, atol=0, rtol=0)
        torch.testing.assert_close(ds, ts, atol=0, rtol=0)
    plain = LlamaConfig(**{**cfg.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    ref = AutoModelForCausalLM.from_config(plain).model.rotary_emb(x, pos)[0]
    assert not torch.allclose(ref, tc)  # the scaled rotary really differs from plain RoPE
