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
