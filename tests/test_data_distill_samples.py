"""``headway distill --samples_per_prompt N``: N sampled answers per prompt, each row keeping its
prompt's id and its sample index, seeded by its place (a resumed run redraws it), N x (P / N)
rows costing what P x 1 do."""

import json

import pytest
import torch

from headway.data.distill import DistillConfig, distill, load_distilled
from headway.data.errors import DataError, ResumeMismatchError

from test_data_distill import PROMPTS, cfg_for, interrupt_after_one_shard, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")
SAMPLED = dict(temperature=1.0, seed=3)


def test_each_prompt_gets_n_sampled_answers_with_its_id_and_sample_index(llama_dir, tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "id": f"q{i}"} for i, p in enumerate(PROMPTS)])
    rows = load_distilled(distill(cfg_for(llama_dir, src, tmp_path / "n2", limit=5, samples_per_prompt=2,
                                          **SAMPLED))).to_list()
    assert len(rows) == 10 and [r["index"] for r in rows] == list(range(10))
    assert [r["id"] for r in rows] == [f"q{i // 2}" for i in range(10)] and [r["sample"] for r in rows] == [0, 1] * 5
    for i in range(5):
        a, b = rows[2 * i: 2 * i + 2]
        start = a["loss_mask"].index(1)
        assert a["input_ids"][:start] == b["input_ids"][:start] and b["loss_mask"].index(1) == start  # one prompt
        assert a["input_ids"] != b["input_ids"]  # two sampled answers
    manifest = json.loads((tmp_path / "n2" / "headway_distill.json").read_text())
    assert manifest["settings"]["samples_per_prompt"] == 2 and manifest["rows"] == 10
    one = load_distilled(distill(cfg_for(llama_dir, src, tmp_path / "n1", limit=10, **SAMPLED))).to_list()
    assert "sample" not in one[0] and len(one) == len(rows)  # 2 x 5 prompts: as many answers as 1 x 10


def test_a_resumed_run_redraws_the_same_answers_and_other_settings_are_refused(llama_dir, tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    cfg = dict(limit=5, samples_per_prompt=2, **SAMPLED)  # 10 rows, shards of 4: a sample pair across a shard end
    full = load_distilled(distill(cfg_for(llama_dir, src, tmp_path / "full", **cfg))).to_list()
    interrupt_after_one_shard(monkeypatch, lambda: distill(cfg_for(llama_dir, src, tmp_path / "part", **cfg)))
    torch.rand(100)
    with pytest.raises(ResumeMismatchError, match="samples_per_prompt=2.*samples_per_prompt=3"):
        distill(cfg_for(llama_dir, src, tmp_path / "part", **{**cfg, "samples_per_prompt": 3}))
    assert load_distilled(distill(cfg_for(llama_dir, src, tmp_path / "part", **cfg))).to_list() == full


def test_several_greedy_answers_are_refused(llama_dir, tmp_path):
    with pytest.raises(DataError, match="samples_per_prompt 2 at temperature 0"):
        DistillConfig(source="demo:train", target=str(llama_dir), samples_per_prompt=2)
    with pytest.raises(DataError, match="samples_per_prompt must be >= 1"):
        DistillConfig(source="demo:train", target=str(llama_dir), samples_per_prompt=0, temperature=1.0)
