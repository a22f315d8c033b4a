"""The target forward of training agrees with the one `headway features` stores, on every architecture."""

import pytest
import torch

from headway.data.features import target_features
from headway.testing import ARCHITECTURES, tiny_target
from headway.train.batch import collate, target_batch


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_routes_agree(arch):
    model, _ = tiny_target(arch)
    rows = [{"input_ids": list(range(3, 15)), "loss_mask": [0] * 4 + [1] * 8},
            {"input_ids": list(range(20, 27)), "loss_mask": [1] * 7}]
    b = collate(rows, pad_id=2)
    L = model.config.num_hidden_layers
    fast = target_batch(model, b, [-1, 1, L], need_logits=False)
    full = target_batch(model, b, [-1, 1, L], need_logits=True)
    stored = target_features(model, b["input_ids"], b["attention_mask"], ["final", 1])
    for i in (-1, 1, L):
        torch.testing.assert_close(fast.hidden[i], full.hidden[i], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast.hidden[-1], stored["final"])
    assert fast.logits is None and full.logits.shape == (2, 12, model.get_output_embeddings().weight.shape[0])
    # the final post-norm state is what the target's own lm_head reads
    torch.testing.assert_close(model.get_output_embeddings()(full.hidden[-1]), full.logits, rtol=1e-4, atol=1e-4)
    # features leave inference mode, so heads can train on them
    w = torch.nn.Parameter(torch.ones(()))
    (fast.hidden[-1] * w).sum().backward()
    assert w.grad is not None


def test_stored_batch_projects_only_positions_followed_by_an_answer_token():
    """Offline logits: the lm_head runs where token s+1 is an answer token (every loss reads only
    those) and equals the online logits there; elsewhere zeros."""
    from headway.train.batch import collate_features, lm_head_logits, shift_mask, stored_batch

    model, _ = tiny_target("llama")
    rows = [{"input_ids": list(range(3, 15)), "loss_mask": [0] * 4 + [1] * 8},
            {"input_ids": list(range(20, 27)), "loss_mask": [0] * 2 + [1] * 4 + [0]}]
    online = target_batch(model, collate(rows, pad_id=2), [-1], need_logits=True)
    stored = [{"input_ids": torch.tensor(r["input_ids"]), "loss_mask": torch.tensor(r["loss_mask"]),
               "features": {"final": online.hidden[-1][i, : len(r["input_ids"])]}} for i, r in enumerate(rows)]
    b = collate_features(stored, pad_id=2)
    used = shift_mask(b["loss_mask"])
    assert used.tolist() == [[False] * 3 + [True] * 8 + [False], [False, True, True, True, True] + [False] * 7]
    offline = stored_batch(b, [-1], lm_head_logits(model.get_output_embeddings()), torch.device("cpu"),
                           torch.float32)
    torch.testing.assert_close(offline.logits[used], online.logits[used], rtol=1e-5, atol=1e-5)
    assert offline.logits[~used].abs().sum() == 0


def test_stored_logits_reduced_to_rows_and_argmax():
    """StoredLogits with rows: only those columns of the full projection; its argmax from the
    full projection (in chunks smaller than the batch) or, with top='data', the given next tokens."""
    from headway.train.batch import StoredLogits, lm_head_logits

    model, _ = tiny_target("llama")
    head = model.get_output_embeddings()
    final = torch.randn(37, head.weight.shape[1])
    next_ids = torch.randint(0, head.weight.shape[0], (37,))
    full, none = lm_head_logits(head)(final)
    assert none is None and full.shape == (37, head.weight.shape[0])
    rows = torch.tensor([5, 1, 90, 7, 33])  # draft order need not be sorted
    exact = StoredLogits(head, rows=rows, top="logits", chunk=8)
    part, top = exact(final, next_ids)
    torch.testing.assert_close(part, full[:, rows], rtol=1e-5, atol=1e-5)
    assert torch.equal(top, full.argmax(-1))
    greedy = StoredLogits(head, rows=rows, top="data")
    part2, top2 = greedy(final, next_ids)
    torch.testing.assert_close(part2, full[:, rows], rtol=1e-5, atol=1e-5)
    assert torch.equal(top2, next_ids)
    # evaluation measures against the target: the same rows, the argmax from the logits
    part3, top3 = greedy.exact()(final, next_ids)
    assert torch.equal(top3, full.argmax(-1)) and greedy.top == "data"
    torch.testing.assert_close(part3, part2, rtol=1e-5, atol=1e-5)
    assert StoredLogits(head, rows=torch.arange(head.weight.shape[0]), top="logits").rows is None  # all, in order
    with pytest.raises(ValueError, match="top must be"):
        StoredLogits(head, top="argmax")
