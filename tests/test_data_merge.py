"""`headway merge`: distilled datasets and features folders merged in order, token counts summed,
shards linked, mismatches refused with both values named, and training reads a merged folder."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from headway.cli import main
from headway.config import load_config
from headway.data.distill import DistillConfig, distill, load_distilled
from headway.data.errors import DataError
from headway.data.features import FeaturesConfig, FeatureStore, features
from headway.data.merge import merge
from headway.data.vocab import load_token_counts, token_frequencies
from headway.train.config import TrainConfig
from headway.train.recipe import train

PROMPTS_A = ["def add(a, b):", "import os\nimport sys", "for i in range(10):", "x = [1, 2, 3]", "while True:"]
PROMPTS_B = ["class A(object):", "def main():\n    parser =", "with open(path) as f:"]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on a shared 2-core machine


def distil(root, name, prompts, target):
    (root / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return distill(DistillConfig(source=str(root / f"{name}.jsonl"), output=str(root / name), target=str(target),
                                 max_new_tokens=8, batch_size=4, shard_size=2))


def feats(data, out, layers=("0", "1", "2", "final"), **kw):
    return features(FeaturesConfig(dataset=str(data), output=str(out), layers=list(layers), store_dtype="float32",
                                   batch_size=2, shard_size=2, **kw))


@pytest.fixture(scope="module")
def parts(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    a, b = distil(root, "a", PROMPTS_A, llama_dir), distil(root, "b", PROMPTS_B, llama_dir)
    return root, a, b, feats(a, root / "fa"), feats(b, root / "fb")


def test_datasets_merge_in_order_with_summed_counts(parts, tmp_path):
    _, a, b, _, _ = parts
    out = merge([a, b], tmp_path / "ab")
    ds, da, db = load_distilled(out), load_distilled(a), load_distilled(b)
    assert len(ds) == len(PROMPTS_A) + len(PROMPTS_B)
    for col in ("input_ids", "loss_mask"):
        assert list(ds[col]) == list(da[col]) + list(db[col])
    counts = load_token_counts(out)
    assert torch.equal(counts, load_token_counts(a) + load_token_counts(b))
    assert torch.equal(counts, token_frequencies(ds, counts.numel()))  # what EAGLE-3's draft vocabulary reads
    m = json.loads((out / "headway_distill.json").read_text())
    assert m["complete"] and m["rows"] == 8 and m["settings"]["target"] == json.loads(
        (a / "headway_distill.json").read_text())["settings"]["target"]
    assert [(p["path"], p["rows"]) for p in m["settings"]["merged_from"]] == [(str(a), 5), (str(b), 3)]
    # a merged dataset is a dataset like any other: features of it
    store = FeatureStore(feats(out, tmp_path / "f"))
    assert [store[i]["input_ids"].tolist() for i in range(len(store))] == list(ds["input_ids"])


def test_features_merge_links_shards_and_merges_their_datasets(parts, tmp_path):
    _, a, b, fa, fb = parts
    out = merge([fa, fb], tmp_path / "fab")
    store, sa, sb = FeatureStore(out), FeatureStore(fa), FeatureStore(fb)
    assert len(store) == len(sa) + len(sb) == 8 and store.keys == sa.keys
    for i in range(len(store)):
        ref = sa[i] if i < len(sa) else sb[i - len(sa)]
        for k in ("input_ids", "loss_mask", *store.keys):
            assert torch.equal(store[i][k], ref[k])
    m = json.loads((out / "features.json").read_text())
    assert m["num_rows"] == 8 and m["num_tokens"] == sum(s["tokens"] for s in m["shards"])
    assert [s["file"] for s in m["shards"]] == [f"shard-{j:05d}.safetensors" for j in range(len(m["shards"]))]
    first = json.loads((fa / "features.json").read_text())["shards"][0]["file"]
    assert (out / "shard-00000.safetensors").stat().st_ino == (fa / first).stat().st_ino  # linked, not copied
    data = load_distilled(m["settings"]["dataset"])  # the merged rows' dataset, inside the output
    assert m["settings"]["dataset"] == str(out / "dataset")
    assert list(data["input_ids"]) == list(load_distilled(a)["input_ids"]) + list(load_distilled(b)["input_ids"])
    # stored features of the merged dataset agree with the merged features (other batches: float rounding)
    direct = FeatureStore(feats(out / "dataset", tmp_path / "direct"))
    for i in range(len(store)):
        torch.testing.assert_close(store[i]["final"], direct[i]["final"], rtol=1e-5, atol=1e-5)


def test_training_reads_merged_features(parts, llama_dir, tmp_path):
    """EAGLE-3 offline on a merged folder: the draft vocabulary is counted on the merged dataset."""
    _, _, _, fa, fb = parts
    out = merge([fa, fb], tmp_path / "fab")
    cfg = load_config(TrainConfig, None, {"kind": "eagle3", "target": str(llama_dir), "features": str(out),
                                          "output_dir": str(tmp_path / "run"), "batch_size": 4, "max_steps": 2,
                                          "save_every": 0, "eval_fraction": 0.25, "progress": False,
                                          "eagle.ttt_steps": 2, "eagle.draft_vocab_size": 32,
                                          "eagle.aux_layers": [0, 1, 2]})
    final = train(cfg)
    meta = json.loads((final / "config.json").read_text())["metadata"]
    assert meta["training"]["features"] == str(out) and meta["training"]["train_rows"] == 6  # 8 rows, 2 held out
    assert meta["draft_vocab"]["size"] == 32
    moved = tmp_path / "moved"  # renamed: its manifest names a dataset that is gone; data= names the copy inside
    out.rename(moved)
    again = train(replace(cfg, features=str(moved), data=str(moved / "dataset"), output_dir=str(tmp_path / "run2")))
    assert json.loads((again / "config.json").read_text())["metadata"]["draft_vocab"]["size"] == 32


def test_cli_takes_every_input(parts, tmp_path, capsys):
    _, a, b, _, _ = parts
    assert main(["merge", str(a), str(b), str(a), "--output", str(tmp_path / "aba")]) == 0
    assert "merged 3 datasets" in capsys.readouterr().err.replace("\n", " ")
    assert len(load_distilled(tmp_path / "aba")) == 13


def edited_copy(src: Path, dst: Path, manifest: str, edit) -> Path:
    """A copy of folder ``src`` whose JSON ``manifest`` went through ``edit`` (in place)."""
    shutil.copytree(src, dst)
    m = json.loads((dst / manifest).read_text())
    edit(m)
    (dst / manifest).write_text(json.dumps(m))
    return dst


def test_refusals_name_both_values_and_write_nothing(parts, tmp_path):
    root, a, b, fa, fb = parts
    out = tmp_path / "out"
    with pytest.raises(DataError, match="not a mix"):
        merge([a, fb], out)
    with pytest.raises(DataError, match="two or more"):
        merge([a], out)
    other = edited_copy(b, tmp_path / "other", "headway_distill.json",
                        lambda m: m["target_info"].update(vocab_size=999))
    with pytest.raises(DataError, match=r"vocab_size \d+ in .* but 999 in"):
        merge([a, other], out)
    unfinished = edited_copy(b, tmp_path / "unfinished", "headway_distill.json", lambda m: m.update(complete=False))
    with pytest.raises(DataError, match="unfinished"):
        merge([a, unfinished], out)
    f0 = feats(b, tmp_path / "f0", layers=("0", "final"))
    with pytest.raises(DataError, match=r"different keys: \['hidden_states.0', 'hidden_states.1', 'hidden_states.2', "
                                        r"'final'\] in .* but \['hidden_states.0', 'final'\]"):
        merge([fa, f0], out)
    fo = edited_copy(fb, tmp_path / "fother", "features.json", lambda m: m["target"].update(hidden_size=7))
    with pytest.raises(DataError, match=r"features of different targets: hidden_size \d+ in .* but 7 in"):
        merge([fa, fo], out)
    assert not out.exists() or not any(p.name != ".lock" for p in out.iterdir())
    merge([a, b], out)
    with pytest.raises(DataError, match="already holds"):
        merge([a, b], out)
    assert len(load_distilled(merge([b, a], out, overwrite=True))) == 8
