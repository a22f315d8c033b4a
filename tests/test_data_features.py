"""Target features: one function online and offline, sharded safetensors store, layer specs, resume."""

import json

import pytest
import torch

from headway.data import features as features_mod
from headway.data.distill import DistillConfig, distill, load_distilled
from headway.data.errors import DataError, ResumeMismatchError
from headway.heads import default_aux_layers
from headway.data.features import (FeaturesConfig, FeatureStore, eagle3_layers, features, parse_layers,
                                   right_pad, target_features)
from headway.config import load_config, parse_args
from headway.target import load_target

PROMPTS = ["def add(a, b):", "import os\nimport sys\n\nclass Config:", "for i in range(10):", "x = [1, 2, 3]",
           "def main():\n    parser =", "while True:", "class A(object):"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on a shared 2-core machine


@pytest.fixture(scope="module")
def distilled(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("feat")
    (root / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return distill(DistillConfig(source=str(root / "p.jsonl"), output=str(root / "ds"), target=str(llama_dir),
                                 max_new_tokens=10, batch_size=4, shard_size=4))


def fcfg(distilled, out, **kw):
    return FeaturesConfig(**{**dict(dataset=str(distilled), output=str(out), layers=["final", "1"],
                                    store_dtype="float32", batch_size=3, shard_size=3), **kw})


def test_offline_features_equal_online_features(distilled, llama_dir, tmp_path):
    store = FeatureStore(features(fcfg(distilled, tmp_path / "f")))
    ds = load_distilled(distilled)
    model, _ = load_target(str(llama_dir))
    assert len(store) == len(ds) == len(PROMPTS) and store.keys == ["final", "hidden_states.1"]
    rows = ds.to_list()
    for b in range(0, len(rows), 3):  # the same batches as offline: bit-identical
        batch = rows[b: b + 3]
        ids, mask = right_pad([r["input_ids"] for r in batch], 2, torch.device("cpu"))
        online = target_features(model, ids, mask, ["final", 1])
        for i, r in enumerate(batch):
            stored = store[b + i]
            n = len(r["input_ids"])
            assert stored["input_ids"].tolist() == r["input_ids"] and stored["loss_mask"].tolist() == r["loss_mask"]
            for k in store.keys:
                assert torch.equal(stored[k], online[k][i, :n])
    for i, r in enumerate(rows):  # one row at a time, no padding: equal up to float rounding
        ids = torch.tensor([r["input_ids"]])
        online = target_features(model, ids, torch.ones_like(ids), ["final", 1])
        full = model(ids, output_hidden_states=True).hidden_states
        torch.testing.assert_close(store[i]["final"], online["final"][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(online["final"][0], full[-1][0], rtol=0, atol=0)  # post-norm final state
        torch.testing.assert_close(store[i]["hidden_states.1"], full[1][0], rtol=1e-5, atol=1e-5)


def test_manifest_and_bytes_per_token(distilled, tmp_path, capsys):
    capsys.readouterr()
    out = features(fcfg(distilled, tmp_path / "f", store_dtype="bfloat16", layers=["0", "2"]))
    # stderr is captured, not a terminal: a plain line per batch of 3 rows (7 < 20), with rates and an ETA
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("features: ")]
    assert [x.split()[1] for x in lines] == ["3/7", "6/7", "7/7"]
    assert all("rows/s" in x and "tok/s" in x and "ETA" in x for x in lines)
    m = json.loads((out / "features.json").read_text())
    assert m["layers"] == ["0", "2"] and m["keys"] == ["hidden_states.0", "hidden_states.2"]
    assert m["dtype"] == "bfloat16" and m["feature_bytes_per_token"] == 2 * 64 * 2
    assert [s["rows"] for s in m["shards"]] == [3, 3, 1] and m["rows_per_shard"] == 3
    assert m["num_tokens"] == sum(len(r) for r in load_distilled(distilled)["input_ids"])
    assert m["bytes_per_token"] >= m["feature_bytes_per_token"] and m["target"]["hidden_size"] == 64
    assert FeatureStore(out)[6]["hidden_states.2"].dtype == torch.bfloat16


def test_interrupted_features_resume_and_refuse_other_settings(distilled, tmp_path, monkeypatch):
    whole = FeatureStore(features(fcfg(distilled, tmp_path / "whole")))
    real, calls = features_mod.write_feature_shard, []

    def die_on_second(folder, j, tensors):
        if calls:
            raise KeyboardInterrupt
        calls.append(j)
        return real(folder, j, tensors)

    monkeypatch.setattr(features_mod, "write_feature_shard", die_on_second)
    with pytest.raises(KeyboardInterrupt):
        features(fcfg(distilled, tmp_path / "part"))
    with pytest.raises(ResumeMismatchError, match="store_dtype"):
        features(fcfg(distilled, tmp_path / "part", store_dtype="float16"))
    with pytest.raises(DataError, match="unfinished"):
        FeatureStore(tmp_path / "part")
    first = tmp_path / "part" / "shard-00000.safetensors"
    stamp = first.stat().st_mtime_ns
    written = []

    def record(folder, j, tensors):
        written.append(j)
        return real(folder, j, tensors)

    monkeypatch.setattr(features_mod, "write_feature_shard", record)
    part = FeatureStore(features(fcfg(distilled, tmp_path / "part")))
    assert written == [1, 2] and first.stat().st_mtime_ns == stamp  # the finished shard is kept, not redone
    for i in range(len(whole)):
        assert all(torch.equal(part[i][k], v) for k, v in whole[i].items())
    from safetensors import safe_open

    for s in whole.shards:  # identical shards (tensors and metadata), as if never interrupted
        with safe_open(str(tmp_path / "part" / s["file"]), "pt") as a, \
                safe_open(str(tmp_path / "whole" / s["file"]), "pt") as b:
            assert a.metadata() == b.metadata() and sorted(a.keys()) == sorted(b.keys())
            assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
    m = json.loads((tmp_path / "part" / "features.json").read_text())
    assert m["complete"] and m["bytes_per_token"] > 0


def test_auto_dtype_follows_the_cpu_and_a_resume_elsewhere_is_refused(distilled, tmp_path, monkeypatch):
    from headway.hardware import ENV

    monkeypatch.setenv(ENV, "1")  # a CPU with native bf16: auto runs the target in bf16, and records so
    fast = features(fcfg(distilled, tmp_path / "fast", dtype="auto"))
    m = json.loads((fast / "features.json").read_text())
    assert m["settings"]["dtype"] == "bfloat16"
    as_bf16 = FeatureStore(features(fcfg(distilled, tmp_path / "bf16", dtype="bfloat16")))
    assert all(torch.equal(FeatureStore(fast)[0][k], v) for k, v in as_bf16[0].items())
    monkeypatch.setenv(ENV, "0")  # the same folder resumed on a CPU without: its auto is float32, refused by name
    with pytest.raises(ResumeMismatchError, match="dtype"):
        features(fcfg(distilled, tmp_path / "fast", dtype="auto", overwrite=False))
    slow = features(fcfg(distilled, tmp_path / "slow", dtype="auto"))
    assert json.loads((slow / "features.json").read_text())["settings"]["dtype"] == "float32"


def test_layer_specs():
    assert parse_layers(["final"], 32) == ["final"]
    assert parse_layers(["eagle3"], 32) == [2, 16, 29] == eagle3_layers(32)
    # EAGLE-3's offline training reads its aux layers and `final` (the lm_head's input)
    cfg = load_config(FeaturesConfig, None, parse_args(FeaturesConfig, ["ds", "--layers", "eagle3", "final"])[1])
    assert parse_layers(cfg.layers, 30) == [2, 15, 27, "final"]
    assert parse_layers(["final", "eagle3"], 30) == ["final", 2, 15, 27]
    assert parse_layers([0, "32"], 32) == [0, 32]
    # a shallow target gets the layers the heads themselves default to (one rule: feature_layers.py)
    assert parse_layers(["eagle3"], 4) == [1, 2, 3] == default_aux_layers(4)
    with pytest.raises(DataError, match="at least 2 layers"):
        parse_layers(["eagle3"], 1)
    with pytest.raises(DataError, match="0..2"):
        parse_layers(["3"], 2)
    with pytest.raises(DataError, match="unknown layer"):
        parse_layers(["last"], 2)
    with pytest.raises(DataError, match="repeat"):
        parse_layers(["1", "1"], 2)


def test_features_of_an_unfinished_dataset_are_refused(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "headway_distill.json").write_text(json.dumps({"settings": {}, "complete": False}))
    with pytest.raises(DataError, match="unfinished"):
        features(FeaturesConfig(dataset=str(tmp_path / "ds"), output=str(tmp_path / "f")))


def test_partial_rows_and_a_pickled_store(distilled, tmp_path):
    """``row`` reads only the asked keys and tokens; a pickled store (DataLoader workers) reads the same rows."""
    import pickle

    store = FeatureStore(features(fcfg(distilled, tmp_path / "f", layers=["0", "1", "2", "final"])))
    assert store.keys == ["hidden_states.0", "hidden_states.1", "hidden_states.2", "final"]
    copy = pickle.loads(pickle.dumps(store))
    row = store.row(3, ["final"], max_length=5)
    assert list(row["features"]) == ["final"] and row["features"]["final"].shape == (5, 64)
    assert torch.equal(copy.row(3, ["final"], 5)["features"]["final"], row["features"]["final"])
    assert torch.equal(copy[3]["hidden_states.1"], store[3]["hidden_states.1"])


def test_a_second_writer_of_a_features_folder_is_refused(distilled, tmp_path):
    import fcntl

    out = tmp_path / "f"
    out.mkdir()
    with open(out / ".lock", "w") as f:  # another writer holds the lock (flock: per open file, even in-process)
        f.write("4242\n")
        f.flush()
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(DataError, match=r"is being written by another headway process \(pid 4242\)"):
            features(fcfg(distilled, out))
    assert len(FeatureStore(features(fcfg(distilled, out)))) == len(PROMPTS)  # released: it runs
