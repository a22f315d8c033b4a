"""distill --features: the hidden states of the forwards that write the answers, stored as a features folder."""

import json
from pathlib import Path

import pytest
import torch

from headway.data import distill as distill_mod
from headway.data.distill import DistillConfig, distill, load_distilled
from headway.data.errors import DataError, ResumeMismatchError
from headway.data.features import FeaturesConfig, FeatureStore, features, target_features
from headway.data.generation import FeatureSpec, SamplingSettings, greedy_batch, sample_batch
from headway.data.merge import merge
from headway.testing import tiny_target
from headway.train.offline import features_manifest

PROMPTS = ["def add(a, b):", "import os\nimport sys\n\nclass Config:", "for i in range(10):", "x = [1, 2, 3]",
           "def main():\n    parser =", "while True:", "class A(object):"]
ZEPHYR = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content | trim }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
LAYERS = ["final", "1"]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on a shared 2-core machine


def unbatched(model, ids):
    """The row's features from one forward over it alone: what a features pass computes."""
    x = torch.tensor([ids])
    return {k: v[0] for k, v in target_features(model, x, torch.ones_like(x), ["final", 1]).items()}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_keeps_every_tokens_hidden_states(temperature):
    model, tok = tiny_target("llama")
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:5]]
    free = greedy_batch(model, prompts, 14, [-1], 2)
    stops = [free[0].tokens[2], free[1].tokens[6]]  # rows end at different steps; others hit the length cap
    spec = FeatureSpec({"final": model.config.num_hidden_layers, "hidden_states.1": 1}, torch.float32)
    settings = SamplingSettings(temperature=temperature, max_new_tokens=14)
    plain = sample_batch(model, prompts, settings, stops, 2, seed=3)
    kept = sample_batch(model, prompts, settings, stops, 2, seed=3, features=spec)
    assert kept == plain  # the same answers (one more forward per finished row changes no token)
    assert {a.stopped for a in kept} == {True, False}
    for p, a in zip(prompts, kept):
        row = p + a.tokens
        want = unbatched(model, row)
        assert set(a.features) == {"final", "hidden_states.1"}
        for k, f in a.features.items():  # every token, the last one written included
            assert f.shape == (len(row), model.config.hidden_size) and f.dtype == torch.float32
            torch.testing.assert_close(f, want[k], rtol=1e-5, atol=1e-5)
    assert all(a.features is None for a in plain)


def run(llama_dir, root: Path, rows, name="ds", feats="fused", **kw):
    src = root / "p.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = dict(source=str(src), output=str(root / name), target=str(llama_dir), max_new_tokens=10, batch_size=3,
                shard_size=3, feature_layers=LAYERS, feature_store_dtype="float32",
                features=str(root / feats) if feats else None)
    return DistillConfig(**{**base, **kw})


def rows_with_chat(tmp_path):
    (tmp_path / "t.jinja").write_text(ZEPHYR)
    conv = [{"role": "user", "content": "Write a loop"}, {"role": "assistant", "content": "OLD"},
            {"role": "user", "content": "Now a function"}]
    overlong = "x = 1\n" * 40  # dropped: shard 1 (rows 3-5) keeps no row
    return [{"prompt": p} for p in PROMPTS[:3]] + [{"prompt": overlong}] * 3 + [{"messages": conv}] + \
        [{"prompt": p} for p in PROMPTS[3:]]


def assert_same_store(a: FeatureStore, b: FeatureStore):
    assert len(a) == len(b) and a.keys == b.keys
    for i in range(len(a)):
        ra, rb = a[i], b[i]
        assert torch.equal(ra["input_ids"], rb["input_ids"]) and torch.equal(ra["loss_mask"], rb["loss_mask"])
        for k in a.keys:
            torch.testing.assert_close(ra[k], rb[k], rtol=1e-5, atol=1e-5)


def test_distilled_features_equal_a_features_pass_and_train_and_merge_read_them(llama_dir, tmp_path):
    cfg = run(llama_dir, tmp_path, rows_with_chat(tmp_path), chat_template=str(tmp_path / "t.jinja"),
              max_prompt_tokens=60)
    out = distill(cfg)
    ds = load_distilled(out)
    manifest = json.loads((out / "headway_distill.json").read_text())
    assert manifest["dropped"] == 3 and len(ds) == len(PROMPTS) + 1
    fused = FeatureStore(tmp_path / "fused")
    assert [s["rows"] for s in fused.manifest["shards"]] == [3, 0, 3, 2]  # one shard per distill shard
    assert fused.manifest["written_by"] == "headway distill" and not (out / "shards").exists()
    # a features pass over the finished rows (another batching) stores the same up to float rounding
    sep = FeatureStore(features(FeaturesConfig(dataset=str(out), output=str(tmp_path / "sep"), layers=LAYERS,
                                               store_dtype="float32", batch_size=2, shard_size=5)))
    assert_same_store(fused, sep)
    assert fused.manifest["settings"] == {**sep.manifest["settings"], "shard_size": 3}
    chat = next(i for i, r in enumerate(ds) if sum(r["loss_mask"]) and r["id"] == "6")
    assert len(fused[chat]["final"]) == len(ds[chat]["input_ids"])  # the multi-turn row: every turn's tokens
    # the command that would make the same folder finds it complete; offline training accepts it
    features(FeaturesConfig(dataset=str(out), output=str(tmp_path / "fused"), layers=LAYERS, store_dtype="float32",
                            shard_size=3))
    assert features_manifest("features", str(tmp_path / "fused"))["num_rows"] == len(ds)
    merged = merge([tmp_path / "fused", tmp_path / "sep"], tmp_path / "merged")
    assert len(FeatureStore(merged)) == 2 * len(ds)
    distill(cfg)  # a complete run: nothing to do


def test_an_interrupted_distill_with_features_resumes_to_the_same_store(llama_dir, tmp_path, monkeypatch):
    rows = [{"prompt": p} for p in PROMPTS]
    full = distill(run(llama_dir, tmp_path, rows, name="full", feats="full-f"))
    real_write, real_store, written = distill_mod.write_shard, distill_mod.write_features, []

    def write_then_die(folder, j, rows, stats, feats=None):
        if len(written) == 1:
            raise KeyboardInterrupt
        written.append(j)
        return real_write(folder, j, rows, stats, feats)

    def store_then_die(shards, folder, *args):  # killed while linking the features into their folder
        real_store({0: shards[0]}, folder, *args)
        raise KeyboardInterrupt

    monkeypatch.setattr(distill_mod, "write_shard", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        distill(run(llama_dir, tmp_path, rows))
    monkeypatch.setattr(distill_mod, "write_shard", real_write)
    monkeypatch.setattr(distill_mod, "write_features", store_then_die)
    with pytest.raises(KeyboardInterrupt):
        distill(run(llama_dir, tmp_path, rows))
    assert not json.loads((tmp_path / "ds" / "headway_distill.json").read_text())["complete"]
    monkeypatch.setattr(distill_mod, "write_features", real_store)
    out = distill(run(llama_dir, tmp_path, rows))
    assert load_distilled(out).to_list() == load_distilled(full).to_list()
    assert_same_store(FeatureStore(tmp_path / "fused"), FeatureStore(tmp_path / "full-f"))  # kernels: timed choice


def test_features_options_are_checked_before_any_generation(llama_dir, tmp_path):
    rows = [{"prompt": p} for p in PROMPTS[:4]]
    with pytest.raises(DataError, match="--engine vllm returns no hidden states"):
        run(llama_dir, tmp_path, rows, engine="vllm")
    with pytest.raises(DataError, match="is the output folder itself"):
        distill(run(llama_dir, tmp_path, rows, feats="ds"))
    with pytest.raises(DataError, match="layer 9 is not a hidden_states index"):
        distill(run(llama_dir, tmp_path, rows, feature_layers=["9"]))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="not empty"):
        distill(run(llama_dir, tmp_path, rows, feats="junk"))
    assert (tmp_path / "junk" / "notes.txt").read_text() == "mine"
    other = distill(run(llama_dir, tmp_path, rows, name="other", feats="other-f"))
    with pytest.raises(DataError, match=f"features of another dataset \\({other.resolve()}\\)"):
        distill(run(llama_dir, tmp_path, rows, feats="other-f"))


def test_a_finished_dataset_without_features_points_to_headway_features(llama_dir, tmp_path):
    rows = [{"prompt": p} for p in PROMPTS[:4]]
    distill(run(llama_dir, tmp_path, rows, feats=None))
    with pytest.raises(ResumeMismatchError) as e:
        distill(run(llama_dir, tmp_path, rows))
    message = str(e.value)
    assert "feature_layers=null" in message and f"headway features {tmp_path / 'ds'} --layers final 1" in message
    distill(run(llama_dir, tmp_path, rows, name="with", feats="with-f"))
    for p in (tmp_path / "with-f").iterdir():  # the features folder lost after the run finished
        p.unlink()
    with pytest.raises(DataError, match="make them with: headway features .* --layers final 1 --output"):
        distill(run(llama_dir, tmp_path, rows, name="with", feats="with-f"))


def test_cli_config_keeps_features_unless_told_none(llama_dir, tmp_path):
    from headway.cli import main

    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    (tmp_path / "d.yaml").write_text(f"source: {src}\ntarget: {llama_dir}\nmax_new_tokens: 5\nshard_size: 2\n"
                                     f"features: {tmp_path / 'f'}\nfeature_layers: [final]\n")
    config = ["distill", "--config", str(tmp_path / "d.yaml")]
    assert main(config + [f"output={tmp_path / 'a'}", "--features", "none"]) == 0
    assert len(load_distilled(tmp_path / "a")) == 3 and not (tmp_path / "f").exists()
    assert main(config + [f"output={tmp_path / 'b'}"]) == 0
    store = FeatureStore(tmp_path / "f")
    assert len(store) == 3 and store.keys == ["final"] and store.manifest["dtype"] == "bfloat16"
