"""The demo pipeline runs the repository's recipes, not silent defaults."""

import json

import pytest

from headway.demo.pipeline import CONFIGS, DemoConfig, recipe, train_config
from headway.errors import HeadwayError


def fake_target(tmp_path, layers: int, vocab: int = 8192):
    folder = tmp_path / f"target-{layers}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": layers,
                                                    "vocab_size": vocab}))
    return folder


def test_the_demo_recipes_are_found_in_the_repository():
    assert (CONFIGS / "demo" / "eagle3.yaml").is_file()
    for name in ("demo/distill.yaml", "demo/medusa.yaml", "demo/eagle1.yaml", "demo/eagle3.yaml", "demo/dflash.yaml"):
        assert recipe(name) == CONFIGS / name


def test_a_missing_recipe_is_an_error_not_defaults():
    with pytest.raises(HeadwayError, match="demo recipe .*nope.yaml not found"):
        recipe("nope.yaml")


def test_each_kind_trains_with_its_recipe(tmp_path):
    """The regression: a wrong path made every kind train 1 epoch of batch 8 with no draft vocabulary."""
    target = fake_target(tmp_path, 8)
    eagle3 = train_config(DemoConfig(), "eagle3", target, tmp_path / "data", tmp_path / "out")
    assert eagle3.kind == "eagle3" and eagle3.epochs == 4 and eagle3.batch_size == 16
    assert eagle3.eagle.draft_vocab_size == 2048 and eagle3.eagle.hard_weight == 1.0
    assert eagle3.eagle.aux_layers == [2, 4, 5] and eagle3.max_steps is None
    assert eagle3.target == str(target) and eagle3.output_dir == str(tmp_path / "out")
    for kind in ("medusa", "eagle1"):
        assert train_config(DemoConfig(), kind, target, tmp_path / "data", tmp_path / "out").kind == kind
    dflash = train_config(DemoConfig(), "dflash", target, tmp_path / "data", tmp_path / "out")
    assert dflash.kind == "dflash" and dflash.epochs == 4 and dflash.dflash.block_size == 8
    assert dflash.dflash.aux_layers == [2, 3, 4, 5, 6] and dflash.dflash.draft_vocab_size == 2048
    assert "dflash" in DemoConfig().kinds


def test_quick_runs_keep_the_recipe_but_fit_a_shallow_target(tmp_path):
    """--quick's tiny target (4 layers, 1,024 tokens): the recipe's aux layers and 2,048-token draft
    vocabulary do not fit it (the regression: `make demo DEMO_ARGS=--quick` failed in EAGLE-3's build)."""
    tiny = fake_target(tmp_path, 4, vocab=1024)
    quick = train_config(DemoConfig(quick=True), "eagle3", tiny, tmp_path / "d", tmp_path / "o")
    assert quick.max_steps == 60 and quick.eagle.draft_vocab_size == 256  # a quarter, as the recipe's 2048 of 8192
    assert quick.eagle.aux_layers == []  # [2, 4, 5] names layers a 4-layer target lacks: the default instead
    block = train_config(DemoConfig(quick=True), "dflash", tiny, tmp_path / "d", tmp_path / "o")
    assert block.dflash.aux_layers == [] and block.dflash.draft_vocab_size == 256


def test_peagle_and_dspark_train_on_request_with_their_recipes(tmp_path):
    """`headway demo --kinds peagle dspark`: their recipes, fitted to --quick's shallow target as the
    others are; the default kinds stay the four."""
    target, tiny = fake_target(tmp_path, 8), fake_target(tmp_path, 4, vocab=1024)
    peagle = train_config(DemoConfig(kinds=["peagle"]), "peagle", target, tmp_path / "d", tmp_path / "o")
    assert peagle.kind == "peagle" and peagle.peagle.num_depths == 7 and peagle.peagle.aux_layers == [2, 4, 5]
    dspark = train_config(DemoConfig(kinds=["dspark"]), "dspark", target, tmp_path / "d", tmp_path / "o")
    assert dspark.kind == "dflash" and dspark.dflash.markov_rank > 0 and dspark.dflash.confidence_head
    quick = train_config(DemoConfig(quick=True), "peagle", tiny, tmp_path / "d", tmp_path / "o")
    assert quick.peagle.aux_layers == [] and quick.peagle.draft_vocab_size == 256
    assert "peagle" not in DemoConfig().kinds
    with pytest.raises(ValueError, match="choose from medusa, eagle1, eagle3, dflash, peagle, dspark"):
        DemoConfig(kinds=["pegle"])


def test_the_demo_finishes_without_matplotlib_and_says_what_the_plot_needs(tmp_path, monkeypatch, capsys):
    """``pip install headway`` (no plot extra) then ``headway demo``: every stage's work is kept, the
    plot is one line saying what to install, and the command succeeds (it once died at the very end)."""
    import sys

    from headway.bench import run as bench_run
    from headway.demo import pipeline
    from headway.demo.pipeline import demo_cli

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setattr(pipeline, "build_target", lambda cfg: tmp_path / "target")
    monkeypatch.setattr(pipeline, "distill_data", lambda cfg, target, run: tmp_path / "data")
    monkeypatch.setattr(pipeline, "train_kind", lambda cfg, kind, target, data, run: tmp_path / kind)
    report = {"methods": [{"name": "medusa", "temperature": 0.0, "speedup": 1.5, "accepted_per_depth": [0.6],
                           "exact_match": 1.0}], "repetition_rate": 0.1}
    monkeypatch.setattr(bench_run, "bench", lambda cfg: report)
    monkeypatch.setattr(bench_run, "render_table", lambda r: "the table")
    assert demo_cli(DemoConfig(run_dir=str(tmp_path / "run"), quick=True, kinds=["medusa"])) == 0
    out = capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "bench.json").read_text()) == report
    assert not (tmp_path / "run" / "bench.png").exists() and "the table" in out
    assert "plot skipped: matplotlib is not installed (pip install 'headway[plot]', or pip install matplotlib)" in out
