"""Training's target side on the mixture-of-experts and Gemma-style fixtures (``MORE_ARCHITECTURES``):
the online and stored feature routes agree, and an EAGLE-3 step on a Mixtral target reaches every
drafter parameter."""

import pytest
import torch

from headway.data.features import target_features
from headway.heads import Eagle3Drafter
from headway.testing import MORE_ARCHITECTURES, tiny_target
from headway.train.batch import collate, lm_head_logits, logit_transform, target_batch
from headway.train.ttt import eagle3_ttt_loss

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on a shared 2-core machine

ROWS = [{"input_ids": list(range(3, 25)), "loss_mask": [0] * 4 + [1] * 18},  # 22 tokens: past the window (12)
        {"input_ids": list(range(30, 37)), "loss_mask": [1] * 7}]


@pytest.mark.parametrize("arch", MORE_ARCHITECTURES)
def test_routes_agree(arch):
    model, _ = tiny_target(arch)
    b = collate(ROWS, pad_id=2)
    L = model.config.num_hidden_layers
    fast = target_batch(model, b, [-1, 1, L], need_logits=False)
    full = target_batch(model, b, [-1, 1, L], need_logits=True)
    stored = target_features(model, b["input_ids"], b["attention_mask"], ["final", 1])
    for i in (-1, 1, L):
        torch.testing.assert_close(fast.hidden[i], full.hidden[i], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast.hidden[-1], stored["final"])
    projected = model.get_output_embeddings()(full.hidden[-1])
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:  # Gemma 2: the logits are the lm_head's output, soft-capped
        projected = torch.tanh(projected / cap) * cap
    torch.testing.assert_close(projected, full.logits, rtol=1e-4, atol=1e-4)
    # offline: the stored final state through StoredLogits with the target's own transform
    offline = lm_head_logits(model.get_output_embeddings())
    offline.transform = logit_transform(model.config)
    assert (offline.transform is None) == (cap is None)
    logits, _ = offline(stored["final"].reshape(-1, stored["final"].shape[-1]))
    torch.testing.assert_close(logits, full.logits.reshape(logits.shape), rtol=1e-4, atol=1e-4)


def test_logit_transforms_are_reproduced_or_refused():
    from types import SimpleNamespace as NS

    x = torch.tensor([-100.0, -1.0, 0.0, 2.0, 100.0])
    torch.testing.assert_close(logit_transform(NS(final_logit_softcapping=30.0))(x), torch.tanh(x / 30) * 30)
    torch.testing.assert_close(logit_transform(NS(logit_scale=0.0625))(x), x * 0.0625)  # Cohere
    torch.testing.assert_close(logit_transform(NS(logits_scaling=8.0))(x), x / 8)  # Granite
    assert logit_transform(NS(logit_scale=1.0)) is None and logit_transform(NS()) is None
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0 and logits_scaling=8.0"):
        logit_transform(NS(final_logit_softcapping=30.0, logits_scaling=8.0))


def test_eagle3_step_on_mixtral_reaches_every_parameter():
    target, _ = tiny_target("mixtral")
    torch.manual_seed(0)
    d = Eagle3Drafter.for_target(target, draft_vocab_size=200)
    d.set_draft_vocab(torch.arange(200))
    ids = torch.randint(3, 200, (2, 16))  # longer than the window
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
        logits = out.logits.clone()
        logits[..., :200] += 100  # every position's target argmax inside the draft vocabulary
    fused = d.fuse([out.hidden_states[i] for i in d.feature_layers])
    loss, m = eagle3_ttt_loss(d, ids, fused, logits, torch.ones_like(ids), steps=3, decay=0.5)
    assert torch.isfinite(loss)
    loss.backward()
    for name, p in d.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    opt = torch.optim.SGD(d.parameters(), lr=0.1)
    opt.step()
    again, _ = eagle3_ttt_loss(d, ids, d.fuse([out.hidden_states[i] for i in d.feature_layers]), logits,
                               torch.ones_like(ids), steps=3, decay=0.5)
    assert again < loss  # one step down the gradient lowers the loss
