"""`headway train features=DIR`: offline training on stored hidden states equals online training,
never runs the target's decoder, and refuses features it cannot use before training starts."""

import json
import shlex
from pathlib import Path

import pytest
import torch

from headway.cli import main
from headway.config import load_config
from headway.data import features as features_mod
from headway.data.features import FeaturesConfig, FeatureStore, features
from headway.heads import load_heads
from headway.target import load_target
from headway.testing import save_tiny_target, tiny_target
from headway.train.batch import collate, collate_features
from headway.train.config import TrainConfig
from headway.train.errors import TrainError
from headway.train.recipe import fit
from headway.train.loaders import split_data, split_indices

from train_utils import distilled_rows, save_rows

KINDS = {"medusa": {"medusa.num_heads": 3, "medusa.kl_weight": 0.5},  # kl: the lm_head on stored `final`
         "eagle1": {},
         "eagle3": {"eagle.draft_vocab_size": 128}}  # draft vocabulary counted on the features' dataset


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on a shared 2-core machine


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny 2-layer target (EAGLE-3's default aux layers are then 0, 1, 2), its data, and float32
    features of every layer any kind reads."""
    root = tmp_path_factory.mktemp("offline")
    target = save_tiny_target(root / "target")
    rows = [{**r, "index": i} for i, r in enumerate(distilled_rows(48, 384, seed=1))]
    data = save_rows(root / "data", rows)
    feats = features(fcfg(data, root / "feat", target, ["0", "1", "2", "final"]))
    return root, target, data, feats


def fcfg(data, out, target, layers, **kw) -> FeaturesConfig:
    return FeaturesConfig(dataset=str(data), output=str(out), target=str(target), layers=list(layers),
                          store_dtype="float32", batch_size=4, shard_size=16, **kw)


def config(setup, out: Path, kind: str, **kw) -> TrainConfig:
    _, target, data, _ = setup
    base = {"kind": kind, "target": str(target), "data": str(data), "output_dir": str(out), "batch_size": 4,
            "max_steps": 4, "log_every": 1, "save_every": 0, "eval_fraction": 0.25, "progress": False,
            "max_length": 20, "optim.lr": 3e-3, "eagle.ttt_steps": 3, **KINDS.get(kind, {})}
    return load_config(TrainConfig, None, {**base, **kw})


def log_losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]


class DecoderCalls:
    """Counts forward calls of the target's decoder layers."""

    def __init__(self, target):
        self.n = 0
        self.handles = [layer.register_forward_pre_hook(self.hook) for layer in target.model.layers]

    def hook(self, *_):
        self.n += 1

    def remove(self):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("kind", list(KINDS))
def test_offline_training_equals_online_training(setup, tmp_path, kind):
    """Same rows, same seed: the loss log, the final heads and the held-out eval agree, and
    offline the target's decoder layers never run (training nor evaluation)."""
    _, target_dir, _, feats = setup
    target, tok = load_target(str(target_dir), device="cpu")
    calls = DecoderCalls(target)
    online = fit(config(setup, tmp_path / "online", kind), target, tok)
    online_calls, calls.n = calls.n, 0
    offline = fit(config(setup, tmp_path / "offline", kind, data="", features=str(feats)), target, tok)
    calls.remove()
    assert online_calls > 0 and calls.n == 0

    a, b = log_losses(tmp_path / "online"), log_losses(tmp_path / "offline")
    assert len(a) == len(b) == 4 and a[-1] != a[0]
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-4, atol=1e-4)
    ha, hb = load_heads(online).state_dict(), load_heads(offline).state_dict()
    assert ha.keys() == hb.keys()
    for k, v in ha.items():
        torch.testing.assert_close(hb[k], v, rtol=1e-4, atol=1e-4, msg=lambda m: f"{k}: {m}")
    ma, mb = (json.loads((p / "config.json").read_text())["metadata"] for p in (online, offline))
    assert ma["training"]["train_rows"] == mb["training"]["train_rows"] == 36  # the same rows held out
    assert mb["training"]["features"] == str(feats) and mb["training"]["data"] == ma["training"]["data"]
    assert mb["eval"]["positions"] == ma["eval"]["positions"] > 0
    assert mb["eval"]["tau"] == pytest.approx(ma["eval"]["tau"], abs=1e-3)
    if kind == "eagle3":  # counted on the features' dataset although data was empty
        assert mb["draft_vocab"] == ma["draft_vocab"]


def test_split_is_datasets_rule_for_arrow_and_feature_rows(setup):
    from datasets import Dataset

    for n, frac, seed in [(48, 0.25, 0), (7, 0.1, 3), (100, 0.05, 1)]:
        ds = Dataset.from_dict({"i": list(range(n))})
        parts = ds.train_test_split(test_size=max(1, round(frac * n)), seed=seed)
        train, held = split_indices(n, frac, seed)
        assert train == parts["train"]["i"][:] and held == parts["test"]["i"][:]
    _, _, data, feats = setup
    on = split_data(load_config(TrainConfig, None, {"target": "t", "data": str(data), "eval_fraction": 0.25}))
    off = split_data(load_config(TrainConfig, None, {"target": "t", "features": str(feats), "eval_fraction": 0.25}), ["final"])
    for a, b in zip(on, off):
        assert [list(r["input_ids"]) for r in a] == [r["input_ids"].tolist() for r in b]


def test_feature_rows_collate_like_dataset_rows(setup):
    _, _, data, feats = setup
    from datasets import load_from_disk

    rows = load_from_disk(str(data)).to_list()[:5]
    store = FeatureStore(feats)
    stored = [store.row(i, ["final", "hidden_states.1"], 16) for i in range(5)]
    a, b = collate(rows, pad_id=2, max_length=16), collate_features(stored, pad_id=2, max_length=16)
    for k in ("input_ids", "attention_mask", "loss_mask"):
        assert torch.equal(a[k], b[k]), k
    T = a["input_ids"].shape[1]
    assert b["features"]["final"].shape == (5, T, 64) and b["features"].keys() == {"final", "hidden_states.1"}
    n = len(rows[0]["input_ids"])
    assert torch.equal(b["features"]["final"][0, : min(n, 16)], store[0]["final"][:16])
    assert not b["features"]["final"][a["attention_mask"] == 0].any()  # zero padding


def test_cli_trains_eagle3_from_features_with_eval_features(setup, tmp_path):
    _, target, _, feats = setup
    out = tmp_path / "cli"
    rc = main(["train", "kind=eagle3", f"target={target}", f"features={feats}", f"eval_features={feats}",
               f"output_dir={out}", "max_steps=2", "batch_size=4", "progress=false", "save_every=0",
               "eagle.ttt_steps=2", "eagle.draft_vocab_size=64", "eval_max_batches=2"])
    assert rc == 0
    meta = json.loads((out / "final" / "config.json").read_text())["metadata"]
    assert meta["training"]["train_rows"] == 48 and meta["eval"]["positions"] > 0
    assert meta["draft_vocab"]["size"] == 64


# -- refusals, all before training starts -----------------------------------------------------
def refused(setup, tmp_path, kind, target=None, **kw) -> str:
    cfg = config(setup, tmp_path / "run", kind, **kw)
    if target is None:
        target, tok = load_target(str(setup[1]), device="cpu")
    else:
        tok = load_target(str(setup[1]), device="cpu")[1]
    with pytest.raises(TrainError) as e:
        fit(cfg, target, tok)
    assert not (tmp_path / "run" / "log.jsonl").exists(), "refused after training started"
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_medusa2_refuses_features(setup, tmp_path):
    msg = refused(setup, tmp_path, "medusa2", features=str(setup[3]))
    assert "medusa2 adapts the target" in msg


def test_features_of_a_target_with_another_shape_are_refused_naming_both_values(setup, tmp_path):
    wide, _ = tiny_target("llama", hidden_size=32, intermediate_size=64)
    msg = refused(setup, tmp_path, "eagle3", target=wide, features=str(setup[3]))
    assert "hidden_size=64" in msg and "hidden_size=32" in msg and "--layers 0 1 2 final" in msg


def test_features_of_another_model_are_refused(setup, tmp_path):
    root, target_dir, data, feats = setup
    other = save_tiny_target(tmp_path / "other")  # same shapes, another model
    model, tok = load_target(str(other), device="cpu")
    cfg = config(setup, tmp_path / "run", "medusa", target=str(other), features=str(feats), data="")
    with pytest.raises(TrainError, match=f"made by target '{target_dir}'.*target={target_dir}"):
        fit(cfg, model, tok)


def test_missing_layers_are_refused_with_the_command_that_stores_them(setup, tmp_path):
    root, target, data, _ = setup
    only_final = features(fcfg(data, tmp_path / "final", target, ["final"]))
    msg = refused(setup, tmp_path, "eagle3", features=str(only_final), data="")
    assert "lack hidden_states.0, hidden_states.1, hidden_states.2 that kind eagle3 reads" in msg
    cmd = msg.split("make them with: ")[1]
    assert f"--layers 0 1 2 final --output {only_final}-eagle3" in cmd and "--store_dtype float32" in cmd
    assert main(shlex.split(cmd)[1:]) == 0  # the suggested command makes features that train
    fit(config(setup, tmp_path / "ok", "eagle3", features=f"{only_final}-eagle3", data="", max_steps=1,
               eval_fraction=0.0), *load_target(str(target), device="cpu"))

    no_final = features(fcfg(data, tmp_path / "l1", target, ["1"]))
    msg = refused(setup, tmp_path, "eagle1", features=str(no_final))
    assert "lack final (the lm_head reads it for the soft labels) that kind eagle1 reads" in msg
    assert "--layers final" in msg


def test_an_unfinished_features_folder_is_refused_with_the_command_that_finishes_it(setup, tmp_path, monkeypatch):
    root, target, data, _ = setup
    real = features_mod.write_feature_shard

    def die_after_first(folder, j, tensors):
        if j > 0:
            raise KeyboardInterrupt
        return real(folder, j, tensors)

    monkeypatch.setattr(features_mod, "write_feature_shard", die_after_first)
    part = tmp_path / "part"
    with pytest.raises(KeyboardInterrupt):
        features(fcfg(data, part, target, ["final"]))
    monkeypatch.setattr(features_mod, "write_feature_shard", real)
    msg = refused(setup, tmp_path, "medusa", features=str(part))
    assert "unfinished (1 of 3 shards)" in msg
    cmd = msg.split("finish it with: ")[1]
    assert main(shlex.split(cmd)[1:]) == 0  # the same settings: it resumes rather than refusing
    assert len(FeatureStore(part)) == 48


def test_data_that_is_not_the_features_dataset_is_refused_but_a_copy_of_it_is_not(setup, tmp_path):
    import shutil

    other = save_rows(tmp_path / "other", distilled_rows(8, 384, seed=5))
    msg = refused(setup, tmp_path, "medusa", data=str(other), features=str(setup[3]))
    assert f"data={other} but features" in msg and str(setup[2]) in msg
    copy = shutil.copytree(setup[2], tmp_path / "copy")  # features and data moved to another machine
    fit(config(setup, tmp_path / "ok", "eagle3", data=str(copy), features=str(setup[3]), max_steps=1),
        *load_target(str(setup[1]), device="cpu"))


def test_a_dataset_given_as_features_is_refused(setup, tmp_path):
    msg = refused(setup, tmp_path, "medusa", features=str(setup[2]))
    assert "is a dataset, not a features folder" in msg


def test_eagle3_shorthand_stores_what_offline_eagle3_reads(setup, tmp_path):
    """`headway features --layers eagle3 final` on an 8-layer target stores (2, 4, 5) + final,
    exactly EAGLE-3's default aux layers and the lm_head's input: offline EAGLE-3 trains on it."""
    _, _, data, _ = setup
    deep = save_tiny_target(tmp_path / "deep", num_hidden_layers=8)
    out = tmp_path / "feat8"
    assert main(["features", str(data), "--layers", "eagle3", "final", "--output", str(out), "--target", str(deep),
                 "--shard_size", "16", "--batch_size", "8"]) == 0
    assert FeatureStore(out).keys == ["hidden_states.2", "hidden_states.4", "hidden_states.5", "final"]
    final = fit(config(setup, tmp_path / "run", "eagle3", target=str(deep), features=str(out), data="", max_steps=1,
                       eval_fraction=0.0), *load_target(str(deep), device="cpu"))
    assert load_heads(final).config.aux_layers == [2, 4, 5]


@pytest.mark.slow
def test_offline_two_processes_match_one_process(tmp_path):
    """Offline rows are sharded over processes like Arrow rows: 2 processes x 2 rows == 1 x 4."""
    import shutil
    import socket
    import sys

    from train_utils import run_cli

    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    assert accelerate, "accelerate launcher not installed next to this python"
    target = save_tiny_target(tmp_path / "target")
    # equal-length, fully supervised rows: the 2-process mean of means equals the 1-process mean
    rows = [{**r, "index": i} for i, r in enumerate(distilled_rows(40, 384, seed=2, uniform=True, max_len=16))]
    feats = features(fcfg(save_rows(tmp_path / "data", rows), tmp_path / "feat", target, ["0", "1", "2", "final"]))
    args = ["train", "kind=eagle3", f"target={target}", f"features={feats}", "max_steps=4", "log_every=1",
            "eval_fraction=0.25", "progress=false", "save_every=0", "eagle.noise=0", "eagle.ttt_steps=3"]
    one = run_cli(args + [f"output_dir={tmp_path / 'one'}", "batch_size=4"], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    two = run_cli(args[1:] + [f"output_dir={tmp_path / 'two'}", "batch_size=2"], tmp_path, timeout=600,
                  launcher=[accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                            "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no",
                            "-m", "headway", "train"],
                  extra_env={"ACCELERATE_USE_CPU": "1"})
    assert two.returncode == 0, two.stderr[-3000:]
    l1, l2 = log_losses(tmp_path / "one"), log_losses(tmp_path / "two")
    assert len(l1) == len(l2) == 4
    torch.testing.assert_close(torch.tensor(l2), torch.tensor(l1), rtol=1e-4, atol=1e-5)
    h1, h2 = load_heads(tmp_path / "one" / "final"), load_heads(tmp_path / "two" / "final")
    for k, v in h1.state_dict().items():
        torch.testing.assert_close(h2.state_dict()[k], v, rtol=1e-4, atol=1e-5)
    assert h1.metadata["eval"]["positions"] == h2.metadata["eval"]["positions"] > 0



def test_length_windows_sort_each_window_longest_first():
    from headway.train.loaders import length_windows

    lengths = [5, 9, 1, 9, 3, 7, 2]
    order = [6, 0, 3, 2, 5, 1, 4]  # windows of 3: [6 0 3] [2 5 1] [4]
    assert length_windows(order, lengths, 3) == [3, 0, 6, 1, 5, 2, 4]
    assert length_windows([1, 5, 3], lengths, 3) == [1, 3, 5]  # a tie keeps the seeded order
    assert length_windows(order, lengths, 0) == order and length_windows(order, None, 3) == order


def test_group_by_length_pads_less_and_offline_still_equals_online(setup, tmp_path):
    """Grouped, each epoch is still a permutation of the rows, batches pad less, the order is the
    same for Arrow rows and feature rows, and offline training still equals online training."""
    from headway.train.loaders import EpochView
    from headway.train.rows import row_lengths

    _, target_dir, _, feats = setup
    on, _ = split_data(config(setup, tmp_path / "x", "eagle1", eval_fraction=0.0))
    off, _ = split_data(config(setup, tmp_path / "x", "eagle1", eval_fraction=0.0, features=str(feats)), ["final"])
    lengths = row_lengths(on, 20)
    assert lengths == row_lengths(off, 20) and min(lengths) < 20 == max(lengths)

    def padded(view, batch=4):
        order = [view._perm(e)[i] for e in range(view.epochs) for i in range(view.n)]
        assert all(sorted(order[e * view.n:(e + 1) * view.n]) == list(range(view.n)) for e in range(view.epochs))
        return sum(len(b) * max(lengths[i] for i in b) for b in (order[a:a + batch] for a in range(0, len(order), batch)))

    plain, grouped = EpochView(on, 0, 2), EpochView(on, 0, 2, lengths, 4 * 4)
    assert padded(grouped) < 0.95 * padded(plain)
    assert [grouped._perm(e) for e in range(2)] == [EpochView(off, 0, 2, row_lengths(off, 20), 16)._perm(e)
                                                      for e in range(2)]

    target, tok = load_target(str(target_dir), device="cpu")
    kw = {"group_by_length": 4}
    online = fit(config(setup, tmp_path / "online", "eagle1", **kw), target, tok)
    offline = fit(config(setup, tmp_path / "offline", "eagle1", data="", features=str(feats), **kw), target, tok)
    a, b = log_losses(tmp_path / "online"), log_losses(tmp_path / "offline")
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-4, atol=1e-4)
    assert a != log_losses_plain(setup, tmp_path, target, tok)  # the grouped order is another order


def log_losses_plain(setup, tmp_path, target, tok):
    fit(config(setup, tmp_path / "plain", "eagle1"), target, tok)
    return log_losses(tmp_path / "plain")
