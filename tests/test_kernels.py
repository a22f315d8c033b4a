"""headway.kernels: the weight-major product of few-row linears equals F.linear, is swapped in only
inside its ``with`` block, only where the plan says, and keeps tree decoding exact."""

import pytest
import torch
import torch.nn.functional as F
from test_decode_exact import OracleProposer, make_heads, prompts, reference
from torch import nn

from headway import kernels
from headway.decode import Speculator
from headway.decode.proposers import make_proposer
from headway.kernels import BUCKETS, LinearKernels, LinearPlan, plain_linears, probe_plan, weight_major, \
    weight_major_linear
from headway.testing import tiny_target

S, W, N = "stock", "weight-major", "native"


@pytest.mark.parametrize("shape", [(1, 24), (2, 24), (7, 24), (1, 1, 24), (2, 5, 24), (3, 1, 24)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("width", [None, 4, 8])  # padded with zero rows where that is more than the rows
def test_weight_major_equals_f_linear(shape, bias, width):
    torch.manual_seed(0)
    lin = nn.Linear(24, 40, bias=bias)
    x = torch.randn(shape)
    got = weight_major_linear(x, lin.weight, lin.bias, width)
    assert got.shape == (*shape[:-1], 40) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_plan_buckets_by_hand():
    plan = LinearPlan((S, W, W, S, W))  # buckets 1 | 2 | 3-4 | 5-8 | 9-12; the rest stock
    assert [plan.use(n) for n in (1, 2, 3, 4, 5, 8, 9, 12, 13, 16, 500)] == \
        [False, True, True, True, False, False, True, True, False, False, False]
    assert plan.describe() == "weight-major at 2, 3-4, 9-12 rows"
    mixed = LinearPlan((S, N, W, N, S), widths=(2, 2, 4))
    assert [mixed.kernel(n) for n in (1, 2, 3, 4, 5, 8, 9, 17)] == [S, N, W, W, N, N, S, S]
    assert mixed.describe() == "native at 2, 5-8 rows; weight-major at 3-4 rows (3 as 4)"
    assert LinearPlan.everywhere(N).kernel(64) == N and LinearPlan.everywhere(N).kernel(65) == S
    assert LinearPlan().describe() == "stock" and not LinearPlan().active
    assert LinearPlan.everywhere().use(64) and not LinearPlan.everywhere().use(65)  # prefill stays stock
    wide = LinearPlan((S,) * 6 + (N, N, W, W))  # buckets 17-24 | 25-32 | 33-48 | 49-64
    assert [wide.kernel(n) for n in (16, 17, 32, 33, 64, 65)] == [S, N, N, W, W, S]
    assert wide.describe() == "native at 17-24, 25-32 rows; weight-major at 33-48, 49-64 rows"
    padded = LinearPlan((S, W, W, S, S), widths=(2, 2, 4, 4, 8))
    assert [padded.width(n) for n in (1, 2, 3, 4, 5, 6, 9)] == [2, 2, 4, 4, 8, 6, 9]  # past the tuple: its own
    assert padded.describe() == "weight-major at 2, 3-4 rows (3 as 4)"  # 5 as 8 runs stock: not named


def test_linears_run_at_the_plans_width(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    seen = []
    real = kernels.weight_major_linear
    monkeypatch.setattr(kernels, "weight_major_linear",
                        lambda x, w, b=None, width=None: seen.append(width) or real(x, w, b, width))
    x = torch.randn(1, 3, 8)
    stock = [model(x[:, :n]) for n in (3, 2, 1)]
    with weight_major(plain_linears(model), LinearPlan((W,) * len(BUCKETS), widths=(4, 2, 4))):
        for n, want in zip((3, 2, 1), stock):
            torch.testing.assert_close(model(x[:, :n]), want, rtol=1e-5, atol=1e-6)
    assert seen == [4, 4, 2, 2, 4, 4]  # each of the two linears at its row count's width


class Scaled(nn.Linear):  # a Linear subclass (LoRA, quantised layers) keeps its own forward
    def forward(self, x):
        return 2 * super().forward(x)


def test_context_swaps_plain_linears_only_and_restores_them(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Scaled(16, 8), nn.Linear(8, 4))
    linears = plain_linears(model, model)  # the same module twice is listed once
    assert linears == [model[0], model[3]]
    calls = []
    real = F.linear
    monkeypatch.setattr(kernels.F, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    few, many = torch.randn(3, 8), torch.randn(80, 8)
    stock_few, stock_many = model(few), model(many)
    calls.clear()
    with weight_major(linears, LinearPlan.everywhere()):
        assert "forward" in model[0].__dict__ and "forward" not in model[2].__dict__
        torch.testing.assert_close(model(few), stock_few, rtol=1e-5, atol=1e-6)
        assert calls == [3]  # only the subclass went through F.linear
        calls.clear()
        torch.testing.assert_close(model(many), stock_many, rtol=1e-5, atol=1e-6)
        assert calls == [80, 80, 80]  # 80 rows: past the last bucket, stock
    assert all("forward" not in m.__dict__ for m in model.modules())
    with pytest.raises(RuntimeError, match="boom"), weight_major(linears, LinearPlan.everywhere()):
        raise RuntimeError("boom")
    assert all("forward" not in m.__dict__ for m in model.modules())  # restored after an error too


def test_probe_picks_the_faster_kernel_per_bucket(monkeypatch):
    """The decision, with a fake clock. Widths: 3 rows run as 4 (faster by more than the margin), 5
    and 6 at their own count (8 is within the margin, or slower), 7 as 8, 1 as 2; never another width
    than the next power of two (2 columns are the fastest of all here). Buckets: weight-major at 2 and
    3-4 (faster) and 9-12 (faster), stock at 1 (slower), 5-8 (within the margin), 16 (equal), 24 and 32
    (slower), 48 and 64 (within the margin)."""
    cost = {"stock": {1: 1.0, 2: 2.0, 4: 2.0, 8: 2.05, 12: 3.0, 16: 4.0, 24: 6.0, 32: 8.0, 48: 12.0, 64: 16.0},
            "weight-major": {2: 1.0, 3: 1.5, 4: 1.2, 5: 2.0, 6: 1.9, 7: 2.1, 8: 1.96, 12: 2.5, 16: 4.0, 24: 7.0,
                             32: 9.0, 48: 11.7, 64: 15.5}}
    timed = []
    monkeypatch.setattr(kernels, "_time", lambda linears, rows, kernel: timed.append((kernel, rows))
                        or cost[kernel][rows])
    plan = probe_plan([nn.Linear(4, 4)], margin=0.05, with_native=False)
    assert plan.widths == (2, 2, 4, 4, 5, 6, 8, 8)
    assert plan.kernels == (S, W, W, S, W, S, S, S, S, S)
    assert plan.describe() == "weight-major at 2, 3-4, 9-12 rows (3 as 4)"  # 7 as 8 runs stock: not named
    assert len(timed) == 2 + 2 * 23  # warm-up, then each of the 10 stock and 13 weight-major passes twice
    assert probe_plan([]) == LinearPlan()  # nothing on the CPU: stock


def test_probe_on_real_weights_returns_a_plan():
    plan = probe_plan(plain_linears(nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))), reps=1)
    assert isinstance(plan, LinearPlan) and len(plan.kernels) == len(BUCKETS)
    assert set(plan.kernels) <= {S, W, N}
    assert len(plan.widths) == kernels.MAX_PAD and all(w >= max(n, 2) for n, w in enumerate(plan.widths, 1))


def test_linear_kernels_choices(monkeypatch):
    model, drafter = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), nn.Linear(8, 8)
    probes = []
    monkeypatch.setattr(kernels, "probe_plan", lambda linears: probes.append(len(linears))
                        or LinearPlan((W,) + (S,) * (len(BUCKETS) - 1)))
    assert LinearKernels("stock", model).plan() == LinearPlan() and LinearKernels("stock", model).linears == []
    assert LinearKernels("weight-major", model).plan() == LinearPlan.everywhere()
    auto = LinearKernels("auto", model, drafter)
    assert len(auto.linears) == 3  # the drafter's linears follow the target's plan
    assert auto.plan().describe() == "weight-major at 1 rows" and auto.plan().active
    assert probes == [2]  # probed once, on the target's linears
    assert LinearKernels("auto", model).plan().active and probes == [2]  # shared by decoders on this target
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        auto.plan()
    finally:
        torch.set_num_threads(threads)
    assert probes == [2, 2]  # another thread count: probed again
    with pytest.raises(ValueError, match="unknown linear kernel 'fast'"):
        LinearKernels("fast", model)


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_tree_decoding_stays_exact_with_weight_major_linears(kind):
    """The drafter and the target both run weight-major; greedy output equals HF generate's (stock)."""
    model, tok = tiny_target("llama")
    spec = Speculator(model, tok, make_heads(kind, model), tree="chain-3", linear_kernel="weight-major")
    assert len(spec.kernels.linears) > len(plain_linears(model)) - 1  # the heads' linears too
    for p in prompts(tok, n=4):
        ref = reference(model, p, 16)
        spec.new_proposer = lambda: OracleProposer(make_proposer(spec.heads), ref, len(p), model.config.vocab_size)
        assert spec.generate(p, max_new_tokens=16).ids == ref
    assert all("forward" not in m.__dict__ for m in model.modules())  # nothing left swapped in


def test_batched_decoding_runs_weight_major(monkeypatch):
    model, tok = tiny_target("llama")
    spec = Speculator(model, tok, make_heads("eagle3", model), tree="chain-2", linear_kernel="weight-major")
    seen = []
    real = kernels.weight_major_linear
    monkeypatch.setattr(kernels, "weight_major_linear",
                        lambda x, w, b=None, width=None: seen.append(1) or real(x, w, b, width))
    ps = prompts(tok, n=3)
    out = spec.generate_batch(ps, max_new_tokens=8)
    assert seen and [r.ids for r in out.rows] == [reference(model, p, 8) for p in ps]


def test_distill_hf_engine_writes_the_same_rows_weight_major(llama_dir, tmp_path, monkeypatch):
    """``distill --linear-kernel`` is a speed knob: forced weight-major, the batch's decode steps run
    through it and the dataset equals the stock one; it is not a setting a resume compares."""
    from test_data_distill import PROMPTS, cfg_for, write_jsonl

    from headway.data.distill import distill, load_distilled

    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    stock = load_distilled(distill(cfg_for(llama_dir, src, tmp_path / "stock", linear_kernel="stock")))
    seen = []
    real = kernels.weight_major_linear
    monkeypatch.setattr(kernels, "weight_major_linear",
                        lambda x, w, b=None, width=None: seen.append(1) or real(x, w, b, width))
    wm = load_distilled(distill(cfg_for(llama_dir, src, tmp_path / "wm", linear_kernel="weight-major")))
    assert seen and wm["input_ids"] == stock["input_ids"] and wm["loss_mask"] == stock["loss_mask"]
    assert "linear_kernel" not in (tmp_path / "wm" / "headway_distill.json").read_text()


def test_probing_leaves_the_global_rng_alone():
    linears = [nn.Linear(32, 48), nn.Linear(48, 32)]
    torch.manual_seed(3)
    state = torch.get_rng_state()
    probe_plan(linears, reps=1, with_native=False)
    assert torch.equal(torch.get_rng_state(), state)  # a user's seeded sampling is not moved by a probe


def test_the_config_choices_are_the_kernel_names():
    """target.py repeats the names (it stays light for --help; the kernels sit below every room)."""
    from headway.target import LINEAR_KERNELS

    assert LINEAR_KERNELS == kernels.KERNELS
