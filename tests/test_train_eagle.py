"""EAGLE-1 / EAGLE-3 through the shared loop: what trains and what must not, resume, a
mismatched target, online == offline features, 2 processes == 1, and learning to draft."""

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from headway.config import ConfigError, load_config
from headway.heads import Eagle1Drafter, Eagle3Drafter, HeadsError, load_heads
from headway.target import TargetError, load_target
from headway.testing import save_tiny_target, tiny_target
from headway.train.config import TrainConfig
from headway.train.errors import TrainError
from headway.train.eagle import Eagle1Task, Eagle3Task
from headway.train.recipe import fit, train

from train_utils import distilled_rows, free_port, online_and_offline_losses, run_cli, save_rows


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on a shared 2-core machine


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_train")
    target = save_tiny_target(root / "target")
    rows = [{**r, "index": i} for i, r in enumerate(distilled_rows(48, 384, seed=1))]  # + provenance, as distill
    data = save_rows(root / "data", rows)
    return root, target, data


def config(setup, out: Path, kind: str, **kw) -> TrainConfig:
    _, target, data = setup
    base = {"kind": kind, "target": str(target), "data": str(data), "output_dir": str(out), "batch_size": 4,
            "max_steps": 6, "log_every": 1, "save_every": 0, "eval_fraction": 0.25, "progress": False,
            "optim.lr": 3e-3, "eagle.ttt_steps": 3, "eagle.draft_vocab_size": 128}
    steps = kw.pop("max_steps", 6)
    return untrained_if_zero(load_config(TrainConfig, None, {**base, **kw, "max_steps": steps or 1}), steps)


def untrained_if_zero(cfg: TrainConfig, max_steps: int | None) -> TrainConfig:
    """max_steps=0: the heads a run starts from, saved without a step (for comparison). The config
    refuses 0 from users (it would save untrained heads as a finished run's `final`), so tests set
    it after the check."""
    if max_steps == 0:
        cfg.max_steps = 0
    return cfg


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_trains_every_drafter_tensor_and_leaves_target_bit_identical(setup, tmp_path, kind):
    target, tok = load_target(str(setup[1]), device="cpu")
    before = {k: v.clone() for k, v in target.state_dict().items()}
    init = load_heads(fit(config(setup, tmp_path / "init", kind, max_steps=0), target, tok))
    final = fit(config(setup, tmp_path / "run", kind), target, tok)
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), f"target tensor {k} changed"
    assert all(not p.requires_grad for p in target.parameters())

    heads = load_heads(final, target=target)
    assert isinstance(heads, Eagle1Drafter if kind == "eagle1" else Eagle3Drafter)
    for name, p in heads.named_parameters():
        assert not torch.equal(p, dict(init.named_parameters())[name]), f"drafter tensor {name} did not train"
    meta = json.loads((final / "config.json").read_text())["metadata"]
    assert meta["training"]["steps"] == 6
    ev = meta["eval"]
    assert 1.0 <= ev["tau"] <= 6.0 and ev["positions"] > 0 and len(ev["accept_rate_by_depth"]) == 5
    assert len(ev["top1"]) == 5 and sum(ev["accept_hist"]) == ev["positions"]
    assert 1.0 <= ev["tau_decode"] <= 6.0 and 0 < ev["decode_steps"] < ev["positions"]  # where steps start
    assert "Measured acceptance" in (final / "README.md").read_text()
    if kind == "eagle1":  # eagle.draft_vocab_size: decode-time rows of the target's lm_head, data not weights
        assert heads.draft_vocab_size == 128 and torch.equal(heads.d2t, init.d2t) and int(heads.t2d.sum()) == 128
        assert meta["draft_vocab"]["size"] == 128 and 0 < meta["draft_vocab"]["answer_token_coverage"] <= 1
        assert heads.logits(torch.randn(1, 2, 64)).shape == (1, 2, 128)  # loaded in eval mode: draft vocabulary
    if kind == "eagle3":
        assert heads.config.draft_vocab_size == 128 and int(heads.t2d.sum()) == 128
        assert torch.equal(heads.d2t, init.d2t)  # the draft vocabulary is data, not trained
        rows = target.get_output_embeddings().weight[init.to_target_ids(torch.arange(128))]
        assert torch.equal(init.lm_head.weight, rows)  # the draft lm_head starts as the target's rows
        assert meta["draft_vocab"]["size"] == 128 and 0 < meta["draft_vocab"]["answer_token_coverage"] <= 1
        assert 0 < ev["draft_vocab_coverage"] <= 1
        log = (tmp_path / "run" / "log.jsonl").read_text()
        assert all(f'"ce{j}"' in log and f'"acc{j}"' in log for j in range(3))


def test_norm_output_trains_feeds_normed_states_back_and_decodes_exactly(setup, tmp_path):
    """eagle.norm_output (and speculators' other two norms): the flags reach the drafter (a different
    loss from the same seed), survive save/load, the decoder's output equals the target's greedy one,
    and the SGLang export refuses by name before writing anything (the vLLM exports carry them:
    test_heads_export_roundtrip.py; this 2-layer target's default aux layers cannot be exported at all)."""
    from headway.decode import Speculator
    from headway.heads.export import export_heads
    from headway.heads.export_layouts import ExportError

    target, tok = load_target(str(setup[1]), device="cpu")
    plain = fit(config(setup, tmp_path / "plain", "eagle3"), target, tok)
    norms = {"norm_output": True, "norm_before_fc": True, "norm_before_residual": True}
    normed = fit(config(setup, tmp_path / "normed", "eagle3", **{f"eagle.{k}": v for k, v in norms.items()}),
                 target, tok)
    assert losses(tmp_path / "normed")[0] != losses(tmp_path / "plain")[0]
    assert load_heads(plain, target=target).config.norm_output is False
    heads = load_heads(normed, target=target)
    assert {k: getattr(heads.config, k) for k in norms} == norms
    h = torch.randn(1, 3, 64)
    assert torch.equal(heads.logits(h), heads.lm_head(h))  # fed back normed: lm_head reads it as is
    ids = torch.tensor([[5, 17, 33, 80]])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                          pad_token_id=2)[0, 4:].tolist()
    assert Speculator(target, tok, heads, tree="chain-3").generate(ids, max_new_tokens=10).ids == ref
    with pytest.raises(ExportError, match="norm_output"):
        export_heads(normed, "sglang", tmp_path / "normed-sglang", target=target)
    assert not (tmp_path / "normed-sglang").exists()


@pytest.mark.parametrize("kind,optimizer", [("eagle1", "adamw"), ("eagle3", "adamw"), ("eagle3", "muon")])
def test_resume_reproduces_the_uninterrupted_run(setup, tmp_path, kind, optimizer):
    """Muon's momentum and AdamW's moments both come back from the checkpoint."""
    kw = {"max_steps": 6, "eval_fraction": 0.0, "save_every": 2, "optim.name": optimizer}
    full, part = tmp_path / "full", tmp_path / "part"
    train(config(setup, full, kind, **kw))
    assert train(config(setup, part, kind, stop_after=3, **kw)).name == "checkpoint-3"
    train(config(setup, part, kind, resume_from="latest", **kw))
    a, b = losses(full), losses(part)
    assert len(a) == len(b) == 6
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=1e-6)  # EAGLE-1 noise included
    ha, hb = load_heads(full / "final"), load_heads(part / "final")
    for k, v in ha.state_dict().items():
        torch.testing.assert_close(hb.state_dict()[k], v, rtol=1e-5, atol=1e-6)


def test_drafter_for_another_target_is_refused_naming_both_values(setup, tmp_path):
    final = train(config(setup, tmp_path, "eagle3", max_steps=1, eval_fraction=0.0))
    wide, _ = tiny_target("llama", hidden_size=32, intermediate_size=64)
    with pytest.raises(TargetError, match=r"hidden_size=64.*hidden_size=32"):
        load_heads(final, target=wide)


def test_init_from_starts_from_earlier_heads_and_refuses_other_settings(setup, tmp_path):
    target, tok = load_target(str(setup[1]), device="cpu")
    first = fit(config(setup, tmp_path / "a", "eagle3", eval_fraction=0.0), target, tok)
    same = fit(config(setup, tmp_path / "b", "eagle3", max_steps=0, init_from=str(first)), target, tok)
    a, b = load_heads(first), load_heads(same)
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())  # d2t / t2d included
    meta = json.loads((same / "config.json").read_text())["metadata"]
    assert meta["init_from"] == str(first) and meta["draft_vocab"] == a.metadata["draft_vocab"]
    fit(config(setup, tmp_path / "c", "eagle3", eval_fraction=0.0, init_from=str(first)), target, tok)
    fresh = losses(tmp_path / "a")
    assert losses(tmp_path / "c")[0] < fresh[0]  # it goes on from the trained weights, not from scratch

    with pytest.raises(TrainError, match=r"draft_vocab_size: 128 there, 64 in this recipe"):
        fit(config(setup, tmp_path / "d", "eagle3", init_from=str(first), **{"eagle.draft_vocab_size": 64}),
            target, tok)
    with pytest.raises(HeadsError, match=r"holds 'eagle3' heads, not 'eagle1'"):
        fit(config(setup, tmp_path / "e", "eagle1", init_from=str(first)), target, tok)
    with pytest.raises(ConfigError, match="init_layer"):
        config(setup, tmp_path / "f", "eagle3", init_from=str(first), **{"eagle.init_layer": 0})
    assert not (tmp_path / "d" / "final").exists() and not (tmp_path / "e" / "final").exists()


def test_init_from_into_a_frozen_lm_head_keeps_the_sources_rows_and_says_frozen(setup, tmp_path):
    """A run with ``eagle.train_lm_head=false`` warm-started from heads whose lm_head trained: the copied
    rows stay as they came, and the card says frozen (this run's choice, not the source's)."""
    target, tok = load_target(str(setup[1]), device="cpu")
    first = fit(config(setup, tmp_path / "a", "eagle3", eval_fraction=0.0), target, tok)
    src = load_heads(first, target=target)
    assert not torch.equal(src.lm_head.weight, target.get_output_embeddings().weight[src.draft_token_ids()])
    frozen = fit(config(setup, tmp_path / "b", "eagle3", eval_fraction=0.0, init_from=str(first),
                        **{"eagle.train_lm_head": False}), target, tok)
    heads = load_heads(frozen, target=target)
    assert torch.equal(heads.lm_head.weight, src.lm_head.weight)
    assert not torch.equal(heads.fc.weight, src.fc.weight)  # the rest trained on
    note = json.loads((frozen / "config.json").read_text())["metadata"]["draft_vocab"]["lm_head_init"]
    assert note == "target lm_head rows (frozen)"
    assert json.loads((first / "config.json").read_text())["metadata"]["draft_vocab"]["lm_head_init"] == \
        "target lm_head rows"


def greedy_copy(data: Path, out: Path, temperature: float = 0.0) -> Path:
    """The dataset with a distill manifest saying the target wrote it at ``temperature``."""
    shutil.copytree(data, out)
    (out / "headway_distill.json").write_text(json.dumps({"complete": True, "settings": {"temperature": temperature}}))
    return out


@pytest.mark.parametrize("task_cls,vocab,argmax_from", [
    (Eagle1Task, None, "logits"), (Eagle1Task, 128, "data"), (Eagle3Task, None, "logits"),
    (Eagle3Task, 128, "logits"), (Eagle3Task, 128, "data")])
def test_online_and_offline_features_give_identical_losses(setup, tmp_path, task_cls, vocab, argmax_from):
    """The same rows through the frozen target (online) and through `headway features` shards
    (offline, float32) give the same K training steps, loss for loss; offline, EAGLE-3 projects
    only its draft vocabulary's rows, as EAGLE-1 with one does (and with argmax_from=data no full
    projection at all)."""
    from headway.data.features import FeatureStore

    root, target_dir, data = setup
    target, _ = load_target(str(target_dir), device="cpu")
    if argmax_from == "data":
        data = greedy_copy(data, tmp_path / "greedy")
    cfg = config(setup, tmp_path, task_cls.kind, data=str(data),
                 **{"eagle.draft_vocab_size": vocab, "eagle.argmax_from": argmax_from})
    layers = [str(i) for i in sorted(set(Eagle3Drafter.for_target(target).feature_layers))]

    def only_the_draft_rows(tb) -> None:
        assert (tb.logit_rows is None) == (vocab is None)

    online, offline = online_and_offline_losses(task_cls, cfg, target_dir, data, tmp_path / "feat",
                                                ["final", *layers], steps=4, check_offline=only_the_draft_rows)
    store = FeatureStore(tmp_path / "feat")
    assert online[-1] != online[0]
    if argmax_from == "data":
        # the loop's module: training batches take the data's token, evaluation the target's argmax
        from headway.train.batch import collate_features, stored_keys
        from headway.train.module import TrainModule

        task = task_cls(cfg)
        heads = task.build(target)
        module = TrainModule(task, heads, target, adapted=False, offline=True)
        keys = stored_keys(task.feature_layers(heads), True)
        b = collate_features([{"input_ids": store[i]["input_ids"], "loss_mask": store[i]["loss_mask"],
                               "features": {k: store[i][k] for k in keys}} for i in range(4)])
        train_tb, eval_tb = module.target_batch(b, True), module.target_batch(b, True, evaluate=True)
        used = train_tb.loss_mask[:, 1:].bool()
        assert torch.equal(train_tb.top[:, :-1][used], train_tb.input_ids[:, 1:][used])
        full = target.get_output_embeddings()(b["features"]["final"]).argmax(-1)
        assert torch.equal(eval_tb.top[:, :-1][used], full[:, :-1][used])
        assert not torch.equal(eval_tb.top, train_tb.top)
    if argmax_from == "data" and task_cls is Eagle3Task:  # not the tiny target's greedy rows: other labels
        cfg = replace(cfg, eagle=replace(cfg.eagle, argmax_from="logits"))
        other, _ = online_and_offline_losses(task_cls, cfg, target_dir, data, tmp_path / "feat-logits",
                                             ["final", *layers], steps=1)
        assert other[0] != online[0]
    torch.testing.assert_close(torch.tensor(offline), torch.tensor(online), rtol=1e-6, atol=1e-6)


def test_argmax_from_data_needs_greedy_distilled_data(setup, tmp_path):
    """The data's next token is the target's argmax only where the target wrote the answers
    greedily: data without a distill manifest, or distilled at a temperature, is refused."""
    from headway.train.errors import TrainError

    _, target_dir, data = setup
    target, _ = load_target(str(target_dir), device="cpu")
    with pytest.raises(TrainError, match="holds no headway_distill.json; use argmax_from=logits"):
        Eagle3Task(config(setup, tmp_path, "eagle3", **{"eagle.argmax_from": "data"})).build(target)
    hot = greedy_copy(data, tmp_path / "hot", temperature=0.7)
    with pytest.raises(TrainError, match="distilled at temperature 0.7"):
        Eagle3Task(config(setup, tmp_path, "eagle3", data=str(hot), **{"eagle.argmax_from": "data"})).build(target)
    merged = greedy_copy(data, tmp_path / "merged")  # `headway merge` lists each run's settings
    (merged / "headway_distill.json").write_text(json.dumps({"complete": True, "settings": {"merged_from": [
        {"settings": {"temperature": 0.0}}, {"settings": {"temperature": 1.0}}]}}))
    with pytest.raises(TrainError, match="temperature 1.0"):
        Eagle3Task(config(setup, tmp_path, "eagle3", data=str(merged), **{"eagle.argmax_from": "data"})).build(target)
    twice = {"settings": {"merged_from": [{"settings": {"temperature": 0.0}}]}}  # a merge of a merge and a run
    (merged / "headway_distill.json").write_text(json.dumps({"complete": True, "settings": {"merged_from": [
        twice, {"settings": {"temperature": 0.0}}]}}))
    nested = config(setup, tmp_path, "eagle3", data=str(merged), **{"eagle.argmax_from": "data"})
    assert Eagle3Task(nested).build(target).draft_vocab_size == 128
    twice["settings"]["merged_from"].append({"settings": {"temperature": 0.5}})
    (merged / "headway_distill.json").write_text(json.dumps({"complete": True, "settings": {"merged_from": [
        twice, {"settings": {"temperature": 0.0}}]}}))
    with pytest.raises(TrainError, match="temperature 0.5"):
        Eagle3Task(config(setup, tmp_path, "eagle3", data=str(merged), **{"eagle.argmax_from": "data"})).build(target)
    greedy = greedy_copy(data, tmp_path / "greedy")
    cfg = config(setup, tmp_path, "eagle3", data=str(greedy), **{"eagle.argmax_from": "data"})
    heads = Eagle3Task(cfg).build(target)
    assert heads.draft_vocab_size == 128


@pytest.mark.parametrize("kind", ["eagle1", "medusa"])
def test_offline_draft_vocab_is_counted_on_the_features_dataset(setup, tmp_path, kind):
    """features=DIR with data empty: the draft vocabulary comes from the dataset the features were
    made from, the same ids as online training picks."""
    from headway.data.features import FeaturesConfig, features

    root, target_dir, data = setup
    target, tok = load_target(str(target_dir), device="cpu")
    feats = features(FeaturesConfig(dataset=str(data), output=str(tmp_path / "feat"), layers=["final"],
                                    store_dtype="float32", target=str(target_dir), batch_size=4, shard_size=16))
    vocab = {"eagle.draft_vocab_size": 96, "medusa.draft_vocab_size": 96, "medusa.num_heads": 2}
    online = fit(config(setup, tmp_path / "online", kind, max_steps=0, **vocab), target, tok)
    offline = fit(config(setup, tmp_path / "offline", kind, max_steps=2, data="", features=str(feats), **vocab),
                  target, tok)
    a, b = load_heads(online, target=target), load_heads(offline, target=target)
    assert b.draft_vocab_size == 96 and torch.equal(a.d2t, b.d2t) and torch.equal(a.t2d, b.t2d)
    assert b.metadata["draft_vocab"] == a.metadata["draft_vocab"]
    assert 1.0 <= b.metadata["eval"]["tau"]



@pytest.mark.slow
# One kind per distinct distributed path (each run costs ~30 s of two accelerate processes): EAGLE-1
# and EAGLE-3 go through the same trainer, DDP wrapping and eval gathering (a trainable drafter on a
# frozen target); EAGLE-3 also runs the TTT unroll, so it covers EAGLE-1's path and more.
# test_train_cli covers the other path (medusa2: LoRA on the target trained across processes).
@pytest.mark.parametrize("kind", ["eagle3"])
def test_two_processes_match_one_process(tmp_path, kind):
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    assert accelerate, "accelerate launcher not installed next to this python"
    target = save_tiny_target(tmp_path / "target")
    # equal-length, fully supervised rows and the full vocabulary: every process averages over the
    # same number of positions, so the 2-process mean of means equals the 1-process mean
    data = save_rows(tmp_path / "data", distilled_rows(40, 384, seed=2, uniform=True, max_len=16))
    # EAGLE-1's input noise is drawn per process, so it cannot match a 1-process run: off here
    args = ["train", f"kind={kind}", f"target={target}", f"data={data}", "max_steps=4", "log_every=1",
            "eval_fraction=0.25", "progress=false", "save_every=0", "eagle.noise=0", "eagle.ttt_steps=3"]
    one = run_cli(args + [f"output_dir={tmp_path / 'one'}", "batch_size=4"], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_cli(args[1:] + [f"output_dir={tmp_path / 'two'}", "batch_size=2"], tmp_path, timeout=600,
                  launcher=[accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                            "--main_process_port", str(free_port()), "--mixed_precision", "no",
                            "--dynamo_backend", "no", "-m", "headway", "train"],
                  extra_env={"ACCELERATE_USE_CPU": "1"})
    assert two.returncode == 0, two.stderr[-3000:]
    l1, l2 = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(l1) == len(l2) == 4
    torch.testing.assert_close(torch.tensor(l2), torch.tensor(l1), rtol=1e-4, atol=1e-5)
    h1, h2 = load_heads(tmp_path / "one" / "final"), load_heads(tmp_path / "two" / "final")
    for k, v in h1.state_dict().items():
        torch.testing.assert_close(h2.state_dict()[k], v, rtol=1e-4, atol=1e-5)
    e1, e2 = h1.metadata["eval"], h2.metadata["eval"]
    assert e1["positions"] == e2["positions"] and e1["accept_hist"] == e2["accept_hist"]


@pytest.fixture(scope="module")
def greedy_text(tmp_path_factory):
    """Text the tiny target writes greedily (its output head is scaled up, so greedy choices are
    decided and partly learnable): the drafter's training data, like a distilled dataset."""
    root = tmp_path_factory.mktemp("greedy")
    target_dir = save_tiny_target(root / "target")
    model, _ = tiny_target("llama")

    def rows(n, seed):
        prompts = torch.randint(3, 384, (n, 4), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=28,
                                 min_new_tokens=28, do_sample=False, pad_token_id=2)
        return [{"input_ids": r.tolist(), "loss_mask": [0] * 4 + [1] * 28} for r in out]

    return target_dir, save_rows(root / "train", rows(128, 0)), save_rows(root / "eval", rows(24, 1))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_a_briefly_trained_drafter_beats_its_untrained_self(greedy_text, tmp_path, kind):
    target, train_data, eval_data = greedy_text
    base = {"kind": kind, "target": str(target), "data": str(train_data), "eval_data": str(eval_data),
            "batch_size": 8, "log_every": 50, "save_every": 0, "progress": False, "optim.lr": 3e-3,
            "optim.warmup_steps": 10, "eagle.ttt_steps": 2, "eagle.draft_vocab_size": 256}
    before = load_heads(train(untrained_if_zero(load_config(TrainConfig, None, {**base, "max_steps": 1, "output_dir":
                                                                                str(tmp_path / "untrained")}), 0)))
    after = load_heads(train(load_config(TrainConfig, None, {**base, "max_steps": 200,
                                                             "output_dir": str(tmp_path / "trained")})))
    e0, e1 = before.metadata["eval"], after.metadata["eval"]
    print(kind, "untrained", e0, "trained", e1)
    assert e0["tau"] < 1.1 and e1["tau"] > e0["tau"] + 0.3
    # greedy-distilled data is the target's argmax chain (up to cached-vs-full-forward near-ties)
    assert e1["tau_greedy"] == pytest.approx(e1["tau"], abs=0.02)
