"""benchmarks/objective/grid.py: the plan (runs, their overrides, data steps, expected minutes), and a
tiny grid run end to end: data step, sequential training runs, collection into grid.json / grid.md."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

from headway.data.features import FeaturesConfig, features
from headway.testing import save_tiny_target

from train_utils import distilled_rows, save_rows

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("objective_grid", ROOT / "benchmarks" / "objective" / "grid.py")
grid = importlib.util.module_from_spec(spec)
sys.modules["objective_grid"] = grid  # dataclasses look their module up
spec.loader.exec_module(grid)

pytestmark = pytest.mark.usefixtures("one_thread")


def write(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target, its data and features (training, held out), and base recipes of both kinds on them."""
    root = tmp_path_factory.mktemp("grid")
    target = save_tiny_target(root / "target")
    data = save_rows(root / "data", [{**r, "index": i} for i, r in enumerate(distilled_rows(24, 384, seed=4))])
    held = save_rows(root / "held", [{**r, "index": i} for i, r in enumerate(distilled_rows(8, 384, seed=5))])
    fkw = dict(target=str(target), layers=["0", "1", "2", "final"], store_dtype="float32", batch_size=4, shard_size=16)
    feats = features(FeaturesConfig(dataset=str(data), output=str(root / "feats"), **fkw))
    held_feats = features(FeaturesConfig(dataset=str(held), output=str(root / "held-feats"), **fkw))
    common = {"target": str(target), "data": str(data), "features": str(feats), "eval_features": str(held_feats),
              "eval_fraction": 0.0, "max_length": 20, "batch_size": 4, "max_steps": 2, "log_every": 1,
              "save_every": 0, "progress": False, "report_to": "none"}
    eagle3 = write(root / "eagle3.yaml", {**common, "kind": "eagle3",
                                          "eagle": {"ttt_steps": 2, "draft_vocab_size": 128}})
    dflash = write(root / "dflash.yaml", {**common, "kind": "dflash", "dflash": {"block_size": 4, "anchors": 4,
                                                                                  "eval_anchors": 4}})
    fconf = write(root / "features.yaml", {"dataset": str(data), "target": str(target), "store_dtype": "float32",
                                           "batch_size": 4, "shard_size": 16})
    dconf = write(root / "distill.yaml", {"source": "demo:train", "target": str(target), "limit": 6})
    return root, eagle3, dflash, fconf, dconf, str(feats), str(data)


def args_for(tiny, out, *extra):
    root, eagle3, dflash, fconf, dconf, _, _ = tiny
    return ["--out", str(out), "--eagle3-config", eagle3, "--dflash-config", dflash, "--features-config", fconf,
            "--distill-config", dconf, "--headway", f"{sys.executable} -m headway", *extra]


def test_the_plan_runs_each_option_alone_with_its_data_steps_and_minutes(tiny, tmp_path, capsys):
    _, eagle3, _, _, _, feats, data = tiny
    preps, runs = grid.plan(grid.parse(args_for(tiny, tmp_path / "g")))
    names = {(r.kind, r.name) for r in runs}
    assert {("eagle3", n) for n in ("baseline", "seed1", "hass", "griffin", "chain", "stored-topk", "samples2",
                                    "ttt1", "ttt3", "ttt7", "decay0.6", "decay1", "vocab4k", "vocab32k")} <= names
    assert ("eagle3", "ttt2") not in names and ("eagle3", "vocab8k") not in names  # the base recipe's own values
    assert ("dflash", "ttt1") not in names and ("dflash", "vocab16k") in names
    # the argmax cross-entropy toggled from each base's own (both tiny bases leave it at its default, off)
    assert ("eagle3", "hard1") in names and ("eagle3", "hard0") not in names
    by = {(r.kind, r.name): r for r in runs}
    assert by["dflash", "griffin"].overrides == {"dflash.align_topk": 3}
    assert by["eagle3", "hass"].overrides == {"eagle.topk_weight": 1.0, "eagle.topk_k": 10}
    assert by["dflash", "hard1"].overrides == {"dflash.hard_weight": 1.0}
    assert by["eagle3", "batch2"].overrides == {"batch_size": 2}  # half the tiny base's 4
    assert [r.name for r in grid.options("eagle3", None, None, {"batch_size": 16}) if r.name.startswith("batch")] \
        == ["batch8"]
    assert by["eagle3", "frozen-head"].overrides == {"eagle.train_lm_head": False}
    # --set moves the base the toggles start from: a grid around a frozen head plans no frozen-head run
    # (YAML values, so "false" is False) and one at batch 8 halves to 4
    _, around = grid.plan(grid.parse(args_for(tiny, tmp_path / "g2", "--set", "eagle.train_lm_head=false",
                                              "--set", "batch_size=8")))
    assert "frozen-head" not in {r.name for r in around} and ("eagle3", "batch4") in {(r.kind, r.name) for r in around}
    assert grid.main(args_for(tiny, tmp_path / "g3", "--set", "optim.lr=fast", "--dry-run")) == 2  # refused, named
    assert "'optim.lr' must be a number, got 'fast'" in capsys.readouterr().out
    frozen = grid.options("eagle3", None, None, {"eagle": {"train_lm_head": False}})
    assert "frozen-head" not in {r.name for r in frozen}  # a base that already freezes it
    assert ("dflash", "frozen-head") not in names
    # a base that names its fused layers and starts from a random layer plans the copy of the deepest's reader
    assert [r.overrides for r in grid.options("eagle3", None, None, {"eagle": {"aux_layers": [2, 15, 27]}})
            if r.name.startswith("init")] == [{"eagle.init_layer": 27}]
    assert not [r for r in grid.options("eagle3", None, None, {"eagle": {"aux_layers": [2, 15, 27], "init_layer": 27}})
                if r.name.startswith("init")]
    with_ce = grid.options("eagle3", None, None, {"eagle": {"hard_weight": 1.0}})
    assert [r.overrides for r in with_ce if r.name.startswith("hard")] == [{"eagle.hard_weight": 0.0}]
    assert by["eagle3", "ttt7"].cost > by["eagle3", "ttt3"].cost > 1 > by["eagle3", "ttt1"].cost
    cmd = grid.train_command(grid.parse(args_for(tiny, tmp_path / "g")), by["eagle3", "seed1"])
    assert cmd[-4:] == ["--config", eagle3, f"output_dir={tmp_path / 'g' / 'eagle3-seed1'}", "seed=1"]
    topk, samples = preps  # both needed, once each for both kinds
    assert topk.command[topk.command.index("--layers") + 1:topk.command.index("--topk_logits")] == ["0", "1", "2"]
    assert topk.output == f"{feats}-topk64" and by["dflash", "stored-topk"].overrides["features"] == topk.output
    assert samples.command[-2:] == ["--limit", "3"] and "--samples_per_prompt" in samples.command
    assert by["eagle3", "samples2"].overrides["data"] == f"{data}-s2"
    only, runs = grid.plan(grid.parse(args_for(tiny, tmp_path / "g", "--only", "baseline", "hass")))
    assert only == [] and [r.folder for r in runs] == ["eagle3-baseline", "eagle3-hass", "dflash-baseline",
                                                       "dflash-hass"]


def test_set_moves_every_run_to_another_base_and_seeds_adds_repeats(tiny, tmp_path):
    _, eagle3, _, _, _, _, _ = tiny
    args = grid.parse(args_for(tiny, tmp_path / "g", "--kinds", "eagle3", "--seeds", "3", "--set", "optim.lr=0.004",
                               "--set", "seed=7", "--only", "baseline", "seed1", "seed2", "hass"))
    _, runs = grid.plan(args)
    assert [r.name for r in runs] == ["baseline", "seed1", "seed2", "hass"]
    cmds = {r.name: grid.train_command(args, r) for r in runs}
    assert "optim.lr=0.004" in cmds["baseline"] and "optim.lr=0.004" in cmds["hass"]
    assert "seed=7" in cmds["baseline"] and cmds["seed2"][-1] == "seed=2"  # a run's own change wins
    assert "seed=7" not in cmds["seed2"]
    with pytest.raises(SystemExit):
        grid.parse(args_for(tiny, tmp_path / "g", "--set", "optim.lr"))


def test_dry_run_prints_the_plan_and_expected_minutes_and_runs_nothing(tiny, tmp_path, capsys):
    assert grid.main(args_for(tiny, tmp_path / "g", "--only", "baseline", "stored-topk", "--minutes",
                              "eagle3=10", "--dry-run")) == 0
    text = capsys.readouterr().out
    assert "1 data step(s), 4 training run(s)" in text and "--topk_logits 64" in text
    assert "eagle3 ~ 11.0 min  baseline" in text and "expected CPU minutes still to run: ~" in text
    assert not (tmp_path / "g").exists()


def test_a_tiny_grid_runs_one_run_at_a_time_and_collects_the_held_out_numbers(tiny, tmp_path, capsys):
    out = tmp_path / "g"
    assert grid.main(args_for(tiny, out, "--only", "baseline", "stored-topk", "--kinds", "eagle3")) == 0
    rows = json.loads((out / "grid.json").read_text())
    assert [(r["kind"], r["run"]) for r in rows] == [("eagle3", "baseline"), ("eagle3", "stored-topk")]
    for r in rows:
        assert r["complete"] and r["tau"] >= 1 and r["tau_decode"] >= 1 and len(r["top1"]) >= 2
        assert r["train_time_s"] > 0 and r["steps"] == 2 and r["positions"] > 0
    assert [r["options"]["eagle"]["soft_labels"] for r in rows] == ["lm_head", "stored_topk"]  # as trained
    assert rows[1]["tokens"] == rows[0]["tokens"]  # the same rows, only the soft labels differ
    md = (out / "grid.md").read_text().splitlines()
    assert md[0].startswith("| kind | run |") and len(md) == 2 + 2 and "| +0.000 |" in md[2]
    capsys.readouterr()
    assert grid.main(args_for(tiny, out, "--only", "baseline", "--kinds", "eagle3")) == 0  # finished: kept
    assert "(done)" in capsys.readouterr().out
    assert (out / "logs" / "eagle3-baseline.txt").read_text().count("$ ") == 1  # trained once


def test_collection_marks_a_run_that_did_not_finish(tmp_path):
    run = grid.Run("eagle3", "hass", "HASS")
    folder = tmp_path / "eagle3-hass"
    folder.mkdir()
    (folder / "log.jsonl").write_text(json.dumps({"event": "start", "step": 0}) + "\n")
    row = grid.collect(folder, run)
    assert not row["complete"] and "tau" not in row
    assert "| eagle3 | hass (incomplete) | HASS | — | — | — |" in grid.table([row])
