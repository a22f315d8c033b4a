import json

import torch

from headway.cli import main
from headway.decode import Speculator
from headway.decode.shapes import StaticShape, chain
from headway.bench.methods import tree_spec
from headway.bench.tune import TuneConfig, expected_accepted, interpolate, shape_spec, tune
from headway.decode.shapes import parse_shape
from headway.heads import Eagle1Drafter, MedusaHeads
from headway.testing import sample_texts


def test_expected_accepted_and_interpolation():
    acc = [[0.5, 0.2], [0.4, 0.1]]
    shape = StaticShape([(0,), (1,), (0, 0)])
    assert abs(expected_accepted(shape, acc) - (0.5 + 0.2 + 0.5 * 0.4)) < 1e-9
    assert interpolate({1: 1.0, 5: 3.0}, 3) == 2.0 and interpolate({1: 1.0, 5: 3.0}, 10) == 6.0


def test_shape_spec_round_trip():
    for shape in (chain(3), StaticShape([(0,), (1,), (0, 2)])):
        assert parse_shape(shape_spec(shape)).paths == shape.paths
    assert shape_spec(parse_shape("dynamic-4-5-16")) == "dynamic-4-5-16"
    # a chain is stored by name, and one written out as a static path is named a chain in reports
    assert shape_spec(chain(2)) == shape_spec(parse_shape("static:[[0,0]]")) == "chain-2"
    assert tree_spec(parse_shape("static:[[0]]")) == "chain-1"
    # a static tree is reported by its paths (two of them in one bench stay apart), which read back
    assert tree_spec(parse_shape("static: [[0], [1]]")) == "static:[[0],[1]]"
    assert parse_shape(tree_spec(parse_shape("static:[[0],[1,0]]"))).paths == [(0,), (1,), (1, 0)]


def test_tune_stores_the_fastest_tree_and_generate_uses_it(tmp_path, llama_dir, capsys):
    from headway.target import load_target

    model, tok = load_target(str(llama_dir))
    torch.manual_seed(0)
    for heads in (MedusaHeads.for_target(model, num_heads=3), Eagle1Drafter.for_target(model)):
        hdir = heads.save_pretrained(tmp_path / heads.kind)
        prompts = tmp_path / "p.jsonl"
        text = sample_texts(20_000)[0]
        prompts.write_text("".join(json.dumps({"prompt": text[i * 300:i * 300 + 200]}) + "\n" for i in range(3)))
        cfg = TuneConfig(target=str(llama_dir), heads=str(hdir), prompts=str(prompts), num_prompts=3,
                         max_new_tokens=12, probe_depth=3, probe_rank=3, sizes=[2, 4], finalists=1, repeats=1,
                         temperatures=[0.0, 1.0], json_out=str(tmp_path / "tune.json"))
        report = tune(cfg, log=lambda m: None)
        lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("tune: ")]  # not a terminal
        runs = 2 * 3 * len(report["mean_tokens_per_s"])  # temperatures x prompts x trees
        assert lines and lines[-1].split()[1] == f"{runs}/{runs}" and all("runs/s" in x and "ETA" in x for x in lines)
        runs = report["side_by_side"]
        assert set(runs) == {"0.0", "1.0"} or set(runs) == {0.0, 1.0} or len(runs) == 2
        means = {n: sum(r[n]["tokens_per_s"] for r in runs.values()) / len(runs) for n in next(iter(runs.values()))}
        assert report["chosen"] == max(means, key=means.get)  # the fastest measured tree wins
        assert len(report["acceptance"]) == 3 and all(0 <= a <= 1 for row in report["acceptance"] for a in row)
        assert json.loads((hdir / "config.json").read_text())["metadata"]["decode"]["tree"] == report["tree"]
        spec = Speculator.from_pretrained(str(llama_dir), str(hdir))
        assert shape_spec(spec.tree) == shape_spec(spec._default_tree(report["tree"], spec.new_proposer()))


def test_tune_cli_bad_heads_path_is_one_line_error(capsys, llama_dir):
    assert main(["tune", "--target", str(llama_dir), "--heads", "/nonexistent/heads"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("headway tune: error:") and "not found" in err[-1]


def test_tune_measures_every_chain_and_stores_fitted_calibration(tmp_path, llama_dir):
    """The stored tree is the measured best of candidates that include chain-1 .. chain-D, so it is
    never slower than the best chain on the same prompts; ``calibration_data`` fits temperatures
    for heads that have none, and they are stored with the tree (and used by generate)."""
    from headway.target import load_target
    from train_utils import distilled_rows, save_rows

    model, _ = load_target(str(llama_dir))
    torch.manual_seed(0)
    hdir = Eagle1Drafter.for_target(model).save_pretrained(tmp_path / "eagle1")
    data = save_rows(tmp_path / "data", distilled_rows(6, 384, seed=1))
    prompts = tmp_path / "p.jsonl"
    text = sample_texts(20_000)[0]
    prompts.write_text("".join(json.dumps({"prompt": text[i * 300:i * 300 + 200]}) + "\n" for i in range(2)))
    cfg = TuneConfig(target=str(llama_dir), heads=str(hdir), prompts=str(prompts), num_prompts=2, max_new_tokens=8,
                     probe_depth=3, probe_rank=2, sizes=[2, 4], finalists=1, repeats=1, calibration_data=str(data))
    report = tune(cfg, log=lambda m: None)
    speed = report["mean_tokens_per_s"]
    assert {"chain-1", "chain-2", "chain-3"} <= set(speed) and any(n.startswith("dynamic-") for n in speed)
    assert report["chosen"] == max(speed, key=speed.get)
    assert speed[report["chosen"]] >= max(v for n, v in speed.items() if n.startswith("chain-"))
    assert report["best_chain"] in speed and report["calibrated"]
    temps = report["calibration"]["temperature_by_depth"]
    assert len(temps) == 3 and len(report["calibration"]["summary"]["ece"]) == 3
    meta = json.loads((hdir / "config.json").read_text())["metadata"]
    assert meta["decode"]["tree"] == report["tree"] and meta["decode"]["calibrated"]
    assert meta["calibration"]["temperature_by_depth"] == temps and "summary" not in meta["calibration"]
    assert meta["calibration"]["fitted_on"] == str(data)
    assert Speculator.from_pretrained(str(llama_dir), str(hdir)).new_proposer().temperatures == temps
