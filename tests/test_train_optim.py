"""optim.name: AdamW (torch's) or MuonAdamW — Muon on the heads' hidden matrices, AdamW on the rest,
checked step by step against torch's own AdamW and Muon."""

import pytest
import torch

from headway.config import ConfigError, load_config
from headway.heads import Eagle3Drafter
from headway.testing import tiny_target
from headway.train.config import OptimConfig, TrainConfig
from headway.train.optim import make_optimizer
from headway.train.optim import MuonAdamW, muon_eligible, orthogonalize
from headway.train.tasks import ParamGroup


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (32, 32)])
def test_orthogonalize_pushes_every_singular_value_near_one(shape):
    k = min(shape)
    u, _ = torch.linalg.qr(torch.randn(shape[0], k))
    v, _ = torch.linalg.qr(torch.randn(shape[1], k))
    g = u @ torch.diag(torch.logspace(-1, 1, k)) @ v.T  # singular values 0.1 .. 10
    out = orthogonalize(g)
    s = torch.linalg.svdvals(out.float())
    assert out.shape == g.shape
    assert s.min() > 0.5 and s.max() < 1.5, s  # the quintic iteration lands near 1, not exactly on it
    torch.testing.assert_close(out.float(), u @ v.T, atol=0.5, rtol=0)  # and keeps g's singular vectors


def steps(opt_params, opt, n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in opt_params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def test_adamw_groups_match_torch_adamw_with_decoupled_decay():
    torch.manual_seed(0)
    a = [torch.randn(8, 4, requires_grad=True), torch.randn(4, requires_grad=True)]
    b = [p.detach().clone().requires_grad_() for p in a]
    start = [p.detach().clone() for p in a]
    ours = MuonAdamW([{"params": [a[0]], "weight_decay": 0.1}, {"params": [a[1]]}], lr=1e-2, betas=(0.9, 0.95))
    ref = torch.optim.AdamW([{"params": [b[0]], "weight_decay": 0.1}, {"params": [b[1]], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    steps(a, ours)
    steps(b, ref)
    for x, y, x0 in zip(a, b, start):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        assert (x - x0).abs().max() > 1e-3


def test_muon_groups_match_torch_muon_scaled_to_adamw_rms():
    torch.manual_seed(0)
    a = [torch.randn(24, 40, requires_grad=True)]
    b = [a[0].detach().clone().requires_grad_()]
    start = a[0].detach().clone()
    ours = MuonAdamW([{"params": a, "weight_decay": 0.1, "muon": True}], lr=2e-3, momentum=0.95)
    ref = torch.optim.Muon(b, lr=2e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                           adjust_lr_fn="match_rms_adamw")
    steps(a, ours)
    steps(b, ref)
    moved = (b[0] - start).abs().max()
    assert moved > 1e-3
    assert (a[0] - b[0]).abs().max() < 0.05 * moved  # the same steps up to bf16 rounding in Newton-Schulz


def test_make_optimizer_puts_hidden_matrices_on_muon_and_vocab_matrices_norms_on_adamw():
    target, _ = tiny_target()
    heads = Eagle3Drafter.for_target(target, draft_vocab_size=64)
    params = [p for p in heads.parameters() if p.requires_grad]
    names = {id(p): n for n, p in heads.named_parameters()}
    o = OptimConfig(name="muon", lr=1e-3, weight_decay=0.01)
    opt = make_optimizer([ParamGroup("heads", params)], o, names)
    assert isinstance(opt, MuonAdamW)
    on_muon = {names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]}
    on_adamw = {names[id(p)] for g in opt.param_groups if not g["muon"] for p in g["params"]}
    assert "fc.weight" in on_muon and any(n.startswith("midlayer.self_attn.q_proj") for n in on_muon)
    assert any("mlp" in n for n in on_muon)
    assert "lm_head.weight" in on_adamw and any("norm" in n for n in on_adamw)
    assert on_muon.isdisjoint(on_adamw) and len(on_muon) + len(on_adamw) == len(params)
    assert {g["weight_decay"] for g in opt.param_groups if g["muon"]} == {o.muon_weight_decay}
    assert not muon_eligible("fc.weight", torch.zeros(1, 8))  # a vector in matrix shape stays on AdamW
    plain = make_optimizer([ParamGroup("heads", params)], OptimConfig(), names)
    assert type(plain) is torch.optim.AdamW and {g["muon"] for g in plain.param_groups} == {False}


def test_an_unknown_optimizer_is_refused_by_name():
    with pytest.raises(ConfigError, match="optim.name"):
        load_config(TrainConfig, None, {"kind": "eagle3", "target": "t", "data": "d", "optim.name": "sgd"})


def test_muon_is_refused_where_accelerate_shards_the_heads():
    """Muon orthogonalises whole matrices: FSDP / DeepSpeed runs (sharded heads) are refused by name;
    DDP and single-process runs are not."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from headway.train.errors import TrainError
    from headway.train.accel import check_optimizer

    cfg = load_config(TrainConfig, None, {"kind": "eagle3", "target": "t", "data": "d", "optim.name": "muon"})
    for kind in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        with pytest.raises(TrainError, match="optim.name=muon"):
            check_optimizer(SimpleNamespace(distributed_type=kind), cfg.optim.name)
    for kind in (DistributedType.NO, DistributedType.MULTI_CPU):
        check_optimizer(SimpleNamespace(distributed_type=kind), cfg.optim.name)
    cfg.optim.name = "adamw"
    check_optimizer(SimpleNamespace(distributed_type=DistributedType.FSDP), cfg.optim.name)
