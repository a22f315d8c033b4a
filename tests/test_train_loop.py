"""The training loop on tiny targets: what trains, what must not, checkpoints and resume, Medusa-2."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from headway.config import load_config
from headway.heads import MedusaHeads, load_heads
from headway.target import TargetError, load_target
from headway.testing import save_tiny_target, tiny_config, tiny_target
from headway.train.checkpoints import STATE, complete_checkpoints, resolve_resume
from headway.train.config import TrainConfig
from headway.train.errors import TrainError
from headway.train.recipe import fit, train
from headway.train.tasks import adapter_path

from train_utils import distilled_rows, save_rows


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on a shared 2-core machine


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = save_tiny_target(root / "target")
    data = save_rows(root / "data", distilled_rows(48, 384, seed=1))
    return root, target, data


def config(setup, out: Path, **kw) -> TrainConfig:
    root, target, data = setup
    base = {"target": str(target), "data": str(data), "output_dir": str(out), "batch_size": 4, "max_steps": 6,
            "log_every": 1, "save_every": 0, "eval_fraction": 0.25, "progress": False, "medusa.num_heads": 3,
            "optim.lr": 3e-3, "optim.warmup_steps": 2}
    return load_config(TrainConfig, None, {**base, **kw})


def losses(out: Path) -> list[tuple[int, float]]:
    recs = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if "loss" in r]


@pytest.mark.parametrize("own_lm_head", [True, False])
def test_medusa_trains_heads_and_leaves_target_bit_identical(setup, tmp_path, own_lm_head):
    target, tok = load_target(str(setup[1]), device="cpu")
    before = {k: v.clone() for k, v in target.state_dict().items()}
    final = fit(config(setup, tmp_path, **{"medusa.kl_weight": 0.5, "medusa.own_lm_head": own_lm_head}), target, tok)
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), f"target tensor {k} changed"
    assert all(not p.requires_grad for p in target.parameters())

    heads = load_heads(final, target=target)
    fresh = MedusaHeads.for_target(target, num_heads=3, own_lm_head=own_lm_head)
    changed = [k for k, v in heads.state_dict().items() if not torch.equal(v, fresh.state_dict()[k])]
    assert any(k.startswith("blocks.") for k in changed)
    assert any(k.startswith("lm_heads.") for k in changed) == own_lm_head

    meta = json.loads((final / "config.json").read_text())["metadata"]
    assert meta["training"]["steps"] == 6 and meta["training"]["world_size"] == 1
    from headway.tokenizer import tokenizer_fingerprint

    assert meta["tokenizer_fingerprint"] == tokenizer_fingerprint(tok)  # checked by the decoder
    ev = meta["eval"]
    assert len(ev["top1"]) == 3 and len(ev["top5"]) == 3 and 1.0 <= ev["tau"] <= 4.0 and ev["positions"] > 0
    assert "Measured acceptance" in (final / "README.md").read_text()
    log = (tmp_path / "log.jsonl").read_text()
    assert '"kl"' in log and '"tokens_per_s"' in log and '"eval"' in log


@pytest.mark.parametrize("kind", ["medusa", "medusa2"])
def test_medusa_with_a_draft_vocab_trains_and_decodes_exactly(setup, tmp_path, kind):
    """medusa.draft_vocab_size: N-row lm_heads, coverage in the metadata and the eval, KL over the
    draft vocabulary, and the trained heads decode to the target's own greedy output."""
    from headway.decode import Speculator

    target, tok = load_target(str(setup[1]), device="cpu")
    extra = {"lora.r": 4, "max_steps": 3} if kind == "medusa2" else {}
    final = fit(config(setup, tmp_path, kind=kind, **{"medusa.draft_vocab_size": 128, "medusa.kl_weight": 0.5},
                       **extra), target, tok)
    if kind == "medusa2":
        target, _ = load_target(str(setup[1]), device="cpu", adapter=str(adapter_path(final)))
    heads = load_heads(final, target=target)
    assert heads.config.draft_vocab_size == 128 and int(heads.t2d.sum()) == 128
    assert all(lm.weight.shape == (128, 64) for lm in heads.lm_heads)
    meta = heads.metadata
    assert meta["draft_vocab"]["size"] == 128 and 0 < meta["draft_vocab"]["answer_token_coverage"] < 1
    assert 0 < meta["eval"]["draft_vocab_coverage"] <= 1 and 1.0 <= meta["eval"]["tau"] <= 4.0
    assert '"kl"' in (tmp_path / "log.jsonl").read_text()
    ids = torch.tensor([[5, 17, 33, 80]])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                          pad_token_id=2)[0, 4:].tolist()
    assert Speculator(target, tok, heads, tree="mc_sim_7b_63").generate(ids, max_new_tokens=10).ids == ref


def test_loss_goes_down_on_learnable_data(setup, tmp_path):
    out = tmp_path / "run"
    train(config(setup, out, max_steps=30, log_every=5, **{"optim.lr": 1e-2}))
    curve = [loss for _, loss in losses(out)]
    assert curve[-1] < 0.8 * curve[0]


@pytest.mark.parametrize("stop_after", [None, 3])
def test_the_prepared_objects_are_released_before_the_process_group_goes(setup, tmp_path, monkeypatch, stop_after):
    # under DDP the prepared module's reducer owns the process group: freed after end_training
    # destroyed the group it would tear gloo down with the GIL held (a rare hang at exit)
    from accelerate import Accelerator

    seen = []
    real = Accelerator.end_training

    def end_training(self):
        seen.append((list(self._models), list(self._optimizers), list(self._dataloaders)))
        real(self)

    monkeypatch.setattr(Accelerator, "end_training", end_training)
    train(config(setup, tmp_path / "run", max_steps=4, stop_after=stop_after))
    assert seen == [([], [], [])]


def test_resume_reproduces_the_uninterrupted_loss_curve(setup, tmp_path):
    kw = {"grad_accum": 2, "max_steps": 6, "eval_fraction": 0.0, "save_every": 2}
    full = tmp_path / "full"
    train(config(setup, full, **kw))

    part = tmp_path / "part"
    stopped = train(config(setup, part, stop_after=3, **kw))
    assert stopped.name == "checkpoint-3" and not (part / "final").exists()
    # a checkpoint killed mid-write (left as .tmp) and a folder without its state file are never "latest"
    (part / "checkpoints" / "checkpoint-5.tmp").mkdir()
    (part / "checkpoints" / "checkpoint-4").mkdir()
    assert resolve_resume("latest", part).name == "checkpoint-3"

    with pytest.raises(TrainError, match="'medusa.num_heads' was 3, now 2"):  # a different run in the same folder is refused
        train(config(setup, part, resume_from="latest", **{**kw, "medusa.num_heads": 2}))
    with pytest.raises(TrainError, match="global batch of 8 rows, this run has 4"):
        train(config(setup, part, resume_from="latest", **{**kw, "grad_accum": 1}))
    train(config(setup, part, resume_from="latest", **kw))

    a, b = losses(full), losses(part)
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2, 3, 4, 5, 6]
    torch.testing.assert_close(torch.tensor([x for _, x in b]), torch.tensor([x for _, x in a]), rtol=1e-5, atol=1e-6)
    ha, hb = load_heads(full / "final"), load_heads(part / "final")
    for k, v in ha.state_dict().items():
        torch.testing.assert_close(hb.state_dict()[k], v, rtol=1e-5, atol=1e-6)


def test_time_limit_ends_the_run_at_a_log_step_with_final_heads(setup, tmp_path, monkeypatch):
    import headway.train.recipe as loop

    clock = iter(range(0, 10_000, 30))  # every reading of the clock is 30 s after the last
    monkeypatch.setattr(loop.time, "perf_counter", lambda: float(next(clock)))
    final = train(config(setup, tmp_path, max_steps=50, log_every=2, time_limit=2.0))  # 2 minutes
    recs = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    timed = [r for r in recs if r.get("event") == "time_limit"]
    assert len(timed) == 1 and timed[0]["step"] % 2 == 0 and 0 < timed[0]["step"] < 50
    assert [r for r in recs if r.get("event") == "done"][0]["step"] == timed[0]["step"]
    assert final.name == "final" and (final / "config.json").is_file()
    assert any("eval" in r and r["step"] == timed[0]["step"] for r in recs)  # the final eval ran there
    assert load_heads(final) is not None


def test_rerunning_a_finished_run_keeps_its_final_heads_and_what_was_stored_with_them(setup, tmp_path):
    kw = {"max_steps": 2, "eval_fraction": 0.25, "resume_from": "latest"}  # the stop's checkpoint suffices
    final = train(config(setup, tmp_path, **kw))
    cfg_file = final / "config.json"
    stored = json.loads(cfg_file.read_text())
    stored["metadata"]["decode"] = {"tree": "chain-2"}  # what `headway tune` writes after training
    cfg_file.write_text(json.dumps(stored))
    weights = (final / "model.safetensors").read_bytes()
    (tmp_path / "kept.safetensors").write_bytes(weights)

    assert train(config(setup, tmp_path, **kw)) == final  # a rerun of the finished run (a script run twice)
    assert json.loads(cfg_file.read_text())["metadata"]["decode"] == {"tree": "chain-2"}
    assert (final / "model.safetensors").read_bytes() == weights
    events = [json.loads(x).get("event") for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert events[-2:] == ["start", "complete"] and events.count("done") == 1

    shutil.rmtree(final)  # without its final heads, the finished run saves them again from the last checkpoint
    assert train(config(setup, tmp_path, **kw)) == final
    assert "decode" not in json.loads(cfg_file.read_text())["metadata"]
    saved, again = (load_file(f) for f in (tmp_path / "kept.safetensors", final / "model.safetensors"))
    assert saved.keys() == again.keys() and all(torch.equal(saved[k], again[k]) for k in saved)


def test_latest_resolution(tmp_path):
    assert resolve_resume("latest", tmp_path) is None  # nothing yet: fresh start
    root = tmp_path / "checkpoints"
    for name, complete in (("checkpoint-2", True), ("checkpoint-10", True), ("checkpoint-12", False),
                           ("checkpoint-14.tmp", True)):
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / STATE).write_text("{}")
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 10]
    assert resolve_resume("latest", tmp_path).name == "checkpoint-10"
    with pytest.raises(Exception, match="not a complete checkpoint"):
        resolve_resume(str(root / "checkpoint-12"), tmp_path)


def test_heads_for_another_target_are_refused_naming_both_values(setup, tmp_path):
    final = train(config(setup, tmp_path, max_steps=1, eval_fraction=0.0))
    wide, _ = tiny_target("llama", hidden_size=32, intermediate_size=64)
    with pytest.raises(TargetError, match=r"hidden_size=64.*hidden_size=32"):
        load_heads(final, target=wide)
    from transformers import AutoModelForCausalLM

    bigger_vocab = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=500))
    with pytest.raises(TargetError, match=r"vocab_size=384.*vocab_size=500"):
        load_heads(final, target=bigger_vocab)


def test_medusa2_trains_an_adapter_the_decoder_can_load(setup, tmp_path):
    root, target_dir, _ = setup
    target, tok = load_target(str(target_dir), device="cpu")
    base = {k: v.clone() for k, v in target.state_dict().items()}
    final = fit(config(setup, tmp_path, kind="medusa2", max_steps=6, **{"lora.r": 4, "lora.heads_only_steps": 2,
                                                                         "lora.ramp_steps": 2}), target, tok)
    # the base weights under the adapter did not move
    for k, v in target.state_dict().items():  # peft injected LoRA layers into the target in place
        if "lora_" not in k:
            assert torch.equal(v, base[k.replace("base_layer.", "")]), k
    adapter = adapter_path(final)
    assert adapter is not None and (adapter / "adapter_config.json").is_file()
    # checkpoints hold the adapter and heads, not a copy of the target
    ckpt = complete_checkpoints(tmp_path)[-1][1]
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and all("lora_" in n or n.startswith("heads.") for n in names)

    merged, _ = load_target(str(target_dir), device="cpu", adapter=str(adapter))
    plain, _ = load_target(str(target_dir), device="cpu")
    diffs = [k for k, v in merged.state_dict().items() if not torch.equal(v, plain.state_dict()[k])]
    assert diffs and all("proj" in k for k in diffs)
    heads = load_heads(final, target=merged)
    assert heads.metadata["adapter"]["subfolder"] == "adapter"
    ev = heads.metadata["eval"]
    assert {"target_loss", "base_target_loss", "target_loss_cost"} <= set(ev)
    log = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    quality = [r["quality"] for r in log if "quality" in r]
    assert len(quality) == 6


def test_runs_with_different_precision_share_a_process(setup, tmp_path):
    for i, mp in enumerate(["bf16", "no"]):  # accelerate's state singleton would refuse the second
        assert train(config(setup, tmp_path / mp, max_steps=1, eval_fraction=0.0, mixed_precision=mp)).is_dir()


def test_progress_to_a_file_prints_a_line_every_log_step_with_rate_and_eta(setup, tmp_path, capsys):
    train(config(setup, tmp_path / "run", max_steps=6, log_every=2, progress=True, eval_fraction=0.0))
    out = capsys.readouterr().out  # captured: not a terminal
    lines = [x for x in out.splitlines() if x.startswith("train: ")]
    assert [x.split()[1] for x in lines] == ["2/6", "4/6", "6/6"], out
    for x in lines:
        assert "steps/s" in x and "tok/s" in x and "ETA" in x and "loss" in x


def test_accumulated_micro_batches_equal_one_big_batch(tmp_path):
    """accelerate's ``accumulate``: 2 micro-batches of 2 rows train exactly as 1 batch of 4 (equal
    row lengths, so the mean of micro-batch means is the batch mean)."""
    root = tmp_path / "u"
    target = save_tiny_target(root / "target")
    data = save_rows(root / "data", distilled_rows(24, 384, seed=3, uniform=True, max_len=16))
    setup = (root, target, data)
    kw = {"max_steps": 4, "eval_fraction": 0.0, "optim.max_grad_norm": 0.5}
    big = train(config(setup, tmp_path / "big", batch_size=4, **kw))
    acc = train(config(setup, tmp_path / "acc", batch_size=2, grad_accum=2, **kw))
    torch.testing.assert_close(torch.tensor([x for _, x in losses(acc.parent)]),
                               torch.tensor([x for _, x in losses(big.parent)]), rtol=1e-5, atol=1e-6)
    norms = [[r["grad_norm"] for r in map(json.loads, (f.parent / "log.jsonl").read_text().splitlines()) if "loss" in r]
             for f in (big, acc)]
    torch.testing.assert_close(torch.tensor(norms[1]), torch.tensor(norms[0]), rtol=1e-5, atol=1e-6)  # the same sum
    hb, ha = load_heads(big), load_heads(acc)
    for k, v in hb.state_dict().items():
        torch.testing.assert_close(ha.state_dict()[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("user_dir", [True, False])
def test_wandb_goes_to_wandb_dir_when_set_else_the_run_folder(setup, tmp_path, monkeypatch, user_dir):
    from headway.train.runlog import wandb_kwargs

    cfg = config(setup, tmp_path / "run")
    if user_dir:
        monkeypatch.setenv("WANDB_DIR", str(tmp_path / "mine"))
        assert "dir" not in wandb_kwargs("run", tmp_path / "run")  # wandb reads WANDB_DIR itself
    else:
        monkeypatch.delenv("WANDB_DIR", raising=False)
        assert wandb_kwargs("run", tmp_path / "run")["dir"] == str(tmp_path / "run")


def test_a_tracker_that_is_not_installed_is_one_line_and_the_run_trains(setup, tmp_path, monkeypatch, capsys):
    """report_to: wandb without wandb: training runs and saves its heads; one line says what to install."""
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # `import wandb` now raises ImportError
    out = tmp_path / "run"
    train(config(setup, out, report_to="wandb", max_steps=2))
    assert (out / "final" / "model.safetensors").is_file() and losses(out)
    notes = [x for x in capsys.readouterr().err.splitlines() if "wandb" in x]
    assert notes == ["headway train: report_to: wandb skipped: wandb is not installed (pip install wandb); "
                     "the run's log.jsonl has every record"]
