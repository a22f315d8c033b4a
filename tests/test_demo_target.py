import dataclasses
import hashlib
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import headway.demo.builder as dt
from headway.cli import main
from headway.config import ConfigError
from headway.demo.builder import (TargetBuildConfig, build_demo_target, cache_key, corpus_files, corpus_tokens,
                                 demo_prompts, read_metadata, repetition_rate, resolve_config, stdlib_root,
                                 target_dir)
from headway.target import load_target

# A few steps of the tiny preset: enough to move the weights and beat a uniform guess.
FAST = dict(preset="tiny", steps=30, warmup=5)


class Retrained(Exception):
    pass


def _no_training(*args, **kwargs):
    raise Retrained("the build trained when it should have come from the cache")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return build_demo_target(TargetBuildConfig(**FAST, cache_dir=str(tmp_path_factory.mktemp("cache"))),
                             progress=False)


def test_corpus_excludes_tests_vendored_and_codec_tables():
    root = stdlib_root()
    files = corpus_files("train") + corpus_files("heldout")
    parts = {part for p in files for part in p.relative_to(root).parts[:-1]}
    assert not parts & {"test", "tests", "idle_test", "site-packages", "dist-packages", "encodings", "lib2to3",
                        "__pycache__"}
    assert all(p.suffix == ".py" and p.is_file() for p in files)
    rels = {p.relative_to(root).as_posix() for p in files}
    assert {"json/decoder.py", "argparse.py"} <= rels  # ordinary stdlib code is in
    assert not any(r.startswith("encodings/") for r in rels)
    everything = {p.relative_to(root).as_posix() for p in root.rglob("*.py")}
    assert any(r.startswith("encodings/") for r in everything)  # there was something to exclude
    excluded = {"test", "tests", "idle_test", "site-packages", "dist-packages", "encodings", "lib2to3",
                "__pycache__", "pydoc_data"}
    assert rels == {r for r in everything if not excluded & set(r.split("/")[:-1])}


def test_split_is_deterministic_disjoint_and_hash_based():
    root = stdlib_root()
    train, held = corpus_files("train"), corpus_files("heldout")
    assert not set(train) & set(held)
    assert 0.02 < len(held) / (len(train) + len(held)) < 0.10
    for p in held:
        digest = int(hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest()[:8], 16)
        assert digest < 0.05 * 2**32
    dt._corpus.cache_clear()  # recompute from scratch: same answer
    assert corpus_files("train") == train and corpus_files("heldout") == held
    with pytest.raises(ConfigError):
        corpus_files("validation")


def test_preset_fills_unset_fields_and_explicit_values_win():
    cfg = resolve_config(TargetBuildConfig(preset="tiny", hidden_size=96, bf16=True))
    assert cfg.hidden_size == 96 and cfg.bf16 is True  # explicit
    assert cfg.num_layers == dt.PRESETS["tiny"]["num_layers"] and cfg.vocab_size == 1024  # from the preset
    demo = resolve_config(TargetBuildConfig())
    assert (demo.hidden_size, demo.num_layers, demo.num_heads, demo.num_kv_heads, demo.vocab_size) == (192, 8, 3, 1,
                                                                                                      8192)
    with pytest.raises(ConfigError, match="divisible"):
        resolve_config(TargetBuildConfig(preset="tiny", hidden_size=65))
    with pytest.raises(ConfigError):
        TargetBuildConfig(preset="huge")


def test_cache_key_follows_the_recipe_not_the_location(tmp_path):
    base = TargetBuildConfig(**FAST, cache_dir=str(tmp_path))
    moved = TargetBuildConfig(**FAST, cache_dir=str(tmp_path / "x"), force=True, out=str(tmp_path / "o"))
    assert cache_key(base) == cache_key(moved)
    assert cache_key(base) != cache_key(TargetBuildConfig(**FAST, cache_dir=str(tmp_path), seed=1))
    assert target_dir(base).parent == tmp_path / "targets" and target_dir(base).name.startswith("tiny-")


def test_build_trains_is_deterministic_and_second_call_is_a_cache_hit(built, tmp_path, monkeypatch):
    weights = load_file(built / "model.safetensors")
    init = dt._llama(resolve_config(TargetBuildConfig(**FAST))).state_dict()
    assert not torch.equal(weights["model.layers.0.mlp.up_proj.weight"], init["model.layers.0.mlp.up_proj.weight"])

    stamp = (built / dt.METADATA_FILE).stat().st_mtime_ns
    monkeypatch.setattr(dt, "_build_into", _no_training)  # a cache hit builds nothing: no tokenizer, no training
    assert build_demo_target(TargetBuildConfig(**FAST, cache_dir=str(built.parent.parent)), progress=False) == built
    assert (built / dt.METADATA_FILE).stat().st_mtime_ns == stamp
    monkeypatch.undo()

    # force: train again from scratch into the same folder; the same seed gives the same bits
    tokenizer = (built / "tokenizer.json").read_text()
    cfg = TargetBuildConfig(**FAST, cache_dir=str(built.parent.parent), force=True, out=str(tmp_path / "copy"))
    assert build_demo_target(cfg, progress=False) == built
    assert (built / dt.METADATA_FILE).stat().st_mtime_ns != stamp
    again = load_file(built / "model.safetensors")
    assert weights.keys() == again.keys() and all(torch.equal(weights[k], again[k]) for k in weights)
    assert (built / "tokenizer.json").read_text() == tokenizer
    assert (tmp_path / "copy" / "model.safetensors").read_bytes() == (built / "model.safetensors").read_bytes()
    assert not [p for p in built.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_folder_loads_as_a_normal_target(built):
    model, tok = load_target(str(built))
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.architectures == ["LlamaForCausalLM"]
    assert next(model.parameters()).dtype == torch.float32
    assert model.config.num_hidden_layers == 4 and model.config.tie_word_embeddings is False
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    ids = tok("def f(x):\n    return x", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], len(tok))
    stream = corpus_tokens(built, "heldout")
    assert stream.dtype == torch.int64 and int(stream.max()) < len(tok) and (stream == 1).sum() > 1


def test_metadata_records_the_measurements(built):
    meta = read_metadata(built)
    assert meta["steps_done"] == 30 and meta["tokens_seen"] == 30 * 16 * 128
    assert meta["stopped_by_time_cap"] is False
    assert 0 < meta["heldout_loss"] < math.log(1024)  # better than a uniform guess
    assert meta["heldout_perplexity"] == pytest.approx(math.exp(meta["heldout_loss"]))
    assert meta["parameters"] == sum(t.numel() for t in load_file(built / "model.safetensors").values())
    assert meta["tokens_per_second"] > 0 and meta["config"]["hidden_size"] == 64
    assert 0 <= meta["greedy_repetition_rate"] <= 1 and 0 <= meta["reference_repetition_rate"] < 0.5
    assert meta["sample"]["prompt"] and meta["sample"]["greedy_completion"]
    assert 0 < meta["layer_cost_ratio"]["flops"] < 1 and 0 < meta["layer_cost_ratio"]["timed_fp32"] < 1


def test_time_cap_stops_training_and_is_recorded(tmp_path, monkeypatch):
    cfg = TargetBuildConfig(**FAST, max_minutes=1e-6, eval_windows=2, repetition_prompts=1, cache_dir=str(tmp_path))
    meta = read_metadata(build_demo_target(cfg, progress=False))
    assert meta["stopped_by_time_cap"] is True and meta["steps_done"] < 30
    # a capped build is reused under the same cap, rebuilt when more time is allowed
    monkeypatch.setattr(dt, "_train", _no_training)
    build_demo_target(cfg, progress=False)
    with pytest.raises(Retrained):
        build_demo_target(dataclasses.replace(cfg, max_minutes=5), progress=False)
    monkeypatch.undo()
    folder = build_demo_target(dataclasses.replace(cfg, max_minutes=5), progress=False)
    meta = read_metadata(folder)
    assert meta["stopped_by_time_cap"] is False and meta["steps_done"] == 30


def test_demo_layer_costs_at_most_an_eighth_of_the_model():
    from transformers import LlamaConfig

    cfg = resolve_config(TargetBuildConfig())
    llama = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                        intermediate_size=cfg.intermediate_size)
    assert dt.flop_layer_ratio(llama, cfg.seq_len) <= 1 / 8
    # a one-layer model with no vocabulary would be all layer
    llama.num_hidden_layers, llama.vocab_size = 1, 0
    assert dt.flop_layer_ratio(llama, 16) == 1.0


def test_repetition_rate_counts_repeated_ngrams():
    assert repetition_rate([[1, 2, 3, 4, 1, 2, 3, 4]]) == pytest.approx(1 / 5)
    assert repetition_rate([[1, 2, 3, 4, 5, 6]]) == 0.0
    assert repetition_rate([[7] * 10]) == pytest.approx(6 / 7)
    # pooled per completion: a 4-gram in another completion is not a repeat
    assert repetition_rate([[1, 2, 3, 4], [1, 2, 3, 4]]) == 0.0
    assert repetition_rate([[1, 2]]) == 0.0


def test_demo_prompts_are_stripped_line_cut_and_from_the_right_split(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    held_texts = [p.read_text(encoding="utf-8", errors="replace") for p in corpus_files("heldout")]
    prompts = demo_prompts("heldout", 6, 48, tok, seed=3)
    assert len(prompts) == 6 and len(set(prompts)) == 6
    for p in prompts:
        assert p == p.rstrip() and p
        assert 24 <= len(tok.encode(p, add_special_tokens=False)) <= 48
        assert any(p in t and _cut_at_line_end(t, p) for t in held_texts)
    assert demo_prompts("heldout", 6, 48, tok, seed=3) == prompts
    assert demo_prompts("heldout", 6, 48, tok, seed=4) != prompts
    train = demo_prompts("train", 6, 48, tok, seed=3)
    assert sum(any(p in t for t in held_texts) for p in train) <= 1  # train prompts come from train files


def _cut_at_line_end(text: str, prompt: str) -> bool:
    """The prompt ends where a line ends (possibly with trailing blanks) in the file."""
    i = text.find(prompt)
    while i >= 0:
        rest = text[i + len(prompt):]
        if rest == "" or rest.split("\n", 1)[0].strip() == "":
            return True
        i = text.find(prompt, i + 1)
    return False


def test_cli_builds_and_prints_the_perplexity(tmp_path, capsys):
    args = ["target", "build", "--preset", "tiny", "--steps", "5", "--warmup", "2", "--eval_windows", "4",
            "--repetition_prompts", "1", "--cache_dir", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith("target training: ")]  # stdout captured: plain lines
    assert [x.split()[2] for x in lines] == ["1/5", "2/5", "3/5", "4/5", "5/5"]
    assert all("steps/s" in x and "tok/s" in x and "ETA" in x and "loss" in x for x in lines)
    folder = next((tmp_path / "targets").iterdir())
    meta = read_metadata(folder)
    assert "perplexity" in out and f"{meta['heldout_perplexity']:.1f}" in out and str(folder) in out
    assert meta["steps_done"] == 5 and meta["config"]["eval_windows"] == 4
    assert main(args) == 0
    assert "from cache" in capsys.readouterr().out


def test_cli_refuses_bad_config(capsys):
    assert main(["target", "build", "--preset", "tiny", "--num_heads", "3"]) == 2
    assert "divisible" in capsys.readouterr().err


def test_shipped_yaml_spells_out_the_demo_preset():
    from headway.config import load_config

    path = Path(__file__).resolve().parents[1] / "configs" / "demo" / "target.yaml"
    from_yaml = resolve_config(load_config(TargetBuildConfig, path))
    assert from_yaml == resolve_config(TargetBuildConfig())
    explicit = {k for k, v in vars(load_config(TargetBuildConfig, path)).items() if v is not None}
    # every preset value is written out, not inherited, except bf16: the preset's follows the CPU
    assert set(dt.PRESETS["demo"]) - {"bf16"} <= explicit and "bf16" not in explicit


def test_temps_of_killed_builds_are_removed_and_live_ones_kept(tmp_path):
    """A killed `target build` leaves `<name>.tmp<pid>` in the cache; the next build clears it,
    but never the temp of a writer that is still running."""
    import subprocess
    import sys

    from headway.publish import remove_dead_temps

    final = tmp_path / "demo-abc"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for name in (f"demo-abc.tmp{dead.pid}", f"demo-abc.tmp{alive.pid}", "demo-abc.tmpx", "demo-abcd.tmp1"):
            (tmp_path / name).mkdir()
            (tmp_path / name / "model.safetensors").write_bytes(b"partial")
        assert remove_dead_temps(final) == [tmp_path / f"demo-abc.tmp{dead.pid}"]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [f"demo-abc.tmp{alive.pid}", "demo-abc.tmpx", "demo-abcd.tmp1"])
    finally:
        alive.kill()
        alive.wait()


def test_the_default_assistant_is_the_demo_recipe_with_fewer_layers(tmp_path, monkeypatch):
    """``target.default_assistant`` reaches the demo room's builder through its entry point: the
    target's recorded recipe, ``layers`` deep, cached beside the target."""
    import json

    from headway.target import DEMO_METADATA_FILE, default_assistant

    folder = tmp_path / "cache" / "targets" / "tiny-abc"
    folder.mkdir(parents=True)
    recipe = {"preset": "tiny", "num_layers": 4, "steps": 7, "not_a_field": 1}
    (folder / DEMO_METADATA_FILE).write_text(json.dumps({"config": recipe, "max_minutes": 3.0}))
    asked = []
    monkeypatch.setattr(dt, "build_demo_target", lambda cfg, progress: asked.append(cfg) or tmp_path / "small")
    path, note = default_assistant(str(folder), 2, False)
    assert path == str(tmp_path / "small") and "with 2 of 4 layers" in note
    (cfg,) = asked
    assert (cfg.preset, cfg.num_layers, cfg.steps, cfg.max_minutes) == ("tiny", 2, 7, 3.0)
    assert cfg.cache_dir == str(tmp_path / "cache")
    with pytest.raises(ConfigError, match="not a demo target.*--assistant"):
        default_assistant(str(tmp_path), 2, False)
