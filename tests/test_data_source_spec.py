"""Prompt sources as users hold them: Hub datasets with a config, split and data_files (read offline
from the Hub cache), column mappings and row formats, seeded shuffles and samples, weighted mixes,
streaming, presets; and every one-string source of before still means what it meant."""

import json
from pathlib import Path

import pytest
import yaml

from headway.cli import main
from headway.config import ConfigError, load_config
from headway.data.configs import DistillConfig
from headway.data.errors import BadRowError, DataError
from headway.data.source_spec import PRESETS, SourceSpec, parse_sources
from headway.data.sources import check_source, read_samples

ROOT = Path(__file__).resolve().parents[1]
SHA = "0123456789abcdef0123456789abcdef01234567"
CARD = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
  - split: test
    path: data/test-*
- config_name: alpaca
  data_files:
  - split: train
    path: alpaca/train-*
---
"""


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """``org/chat`` as a download leaves it in the Hub cache (``datasets--org--chat/refs/main`` +
    ``snapshots/<sha>/``): two configs, parquet files; the tests run with HF_DATASETS_OFFLINE=1."""
    import datasets
    import huggingface_hub.constants
    import pyarrow as pa
    import pyarrow.parquet as pq

    assert datasets.config.HF_DATASETS_OFFLINE  # conftest: nothing here may reach the network
    repo = tmp_path / "hub" / "datasets--org--chat"
    snap = repo / "snapshots" / SHA
    for sub in ("data", "alpaca"):
        (snap / sub).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    (snap / "README.md").write_text(CARD)
    train = [{"id": f"t{i}", "prompt": f"train prompt {i}"} for i in range(12)]
    train[5]["prompt"] = ""  # a bad row: an empty prompt
    pq.write_table(pa.Table.from_pylist(train), snap / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist([{"id": "x", "prompt": "test prompt"}]),
                   snap / "data" / "test-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist([{"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
                                         {"instruction": "Name a colour.", "input": "", "output": "Blue"}]),
                   snap / "alpaca" / "train-00000-of-00001.parquet")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    return "org/chat"


# -- the forms ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["chat:train", "chat:dev", "demo:heldout", "prompts.jsonl", "/abs/p.parquet",
                                  "~/p.json", "./folder", "org/name", "runs/smollm2-prompts/prompts.jsonl"])
def test_one_string_sources_mean_what_they_meant(text):
    assert parse_sources(text) == [SourceSpec(path=text)]


def test_every_shipped_config_source_is_the_string_it_was():
    configs = [p for p in sorted((ROOT / "configs").glob("*/*.yaml")) if "source" in (yaml.safe_load(p.read_text()) or {})]
    assert len(configs) >= 7
    for p in configs:
        raw = yaml.safe_load(p.read_text())["source"]
        assert isinstance(raw, str) and parse_sources(raw) == [SourceSpec(path=raw)], p.name
        if p.name.startswith("distill"):
            assert load_config(DistillConfig, p).source == raw


def test_command_line_shorthand_flow_mappings_and_presets():
    assert parse_sources("org/chat:alpaca@test") == [SourceSpec(path="org/chat", config="alpaca", split="test")]
    assert parse_sources("org/chat@test") == [SourceSpec(path="org/chat", split="test")]
    assert parse_sources("{path: org/chat, sample: 5, shuffle: true, columns: {prompt: q}}") == [
        SourceSpec(path="org/chat", sample=5, shuffle=True, columns={"prompt": "q"})]
    ultra = parse_sources("preset:ultrachat")[0]
    assert (ultra.path, ultra.split, ultra.format, ultra.preset) == ("HuggingFaceH4/ultrachat_200k", "train_sft",
                                                                     "messages", "ultrachat")
    share = parse_sources({"preset": "sharegpt", "sample": 100, "split": "train"})[0]
    assert (share.path, share.data_files, share.format, share.sample) == (
        PRESETS["sharegpt"]["path"], PRESETS["sharegpt"]["data_files"], "sharegpt", 100)
    mix = parse_sources("[chat:train, {path: a.jsonl, weight: 3}]")
    assert [(s.path, s.weight) for s in mix] == [("chat:train", 1.0), ("a.jsonl", 3.0)]


@pytest.mark.parametrize("value, message", [
    ({"path": "a.jsonl", "splt": "x"}, "unknown key 'source.splt'. Did you mean 'source.split'?"),
    ({"path": "a.jsonl", "format": "alpacca"}, "'source.format' must be one of auto, prompt, messages"),
    ({"path": "a.jsonl", "weight": 2}, "'weight' is a source's share of a mix"),
    ([{"path": "a.jsonl", "weight": 0}, "b.jsonl"], "'weight' must be a finite number > 0"),
    ({"path": "a.jsonl", "sample": 0}, "'sample' must be >= 1"),
    ({"path": "a.jsonl", "columns": {"question": "q"}}, "'columns' maps unknown field 'question'"),
    ({"path": "a.jsonl", "format": "sharegpt", "columns": {"prompt": "q"}}, "which format sharegpt does not read"),
    ({"path": "chat:train", "columns": {"prompt": "q"}}, "chat:train is a built-in source"),
    ({"preset": "alpaca"}, "unknown source preset 'alpaca'; presets: sharegpt, ultrachat"),
    ({"split": "train"}, "a prompt source needs a path"),
    ([], "an empty list of prompt sources"),
    ("{path: [unclosed", "cannot parse the prompt source"),
])
def test_a_bad_spec_is_one_line_naming_the_fault(value, message):
    with pytest.raises(ConfigError, match=None) as e:
        parse_sources(value)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_bad_spec_stops_the_command_before_the_target_loads(monkeypatch, capsys):
    import headway.target

    monkeypatch.setattr(headway.target, "resolve_target_path", lambda *a: pytest.fail("resolved the target"))
    assert main(["distill", "{path: p.jsonl, splt: test}", "--target", "demo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("headway distill: error: ") and "Did you mean 'source.split'?" in err and err.count("\n") == 1


# -- the Hub, offline ----------------------------------------------------------------------------------
def test_a_hub_dataset_by_config_split_and_files_is_read_offline_from_the_hub_cache(hub):
    res = read_samples(hub, skip_bad_rows=True)
    assert [s.id for s in res.samples] == [f"t{i}" for i in range(12) if i != 5]
    assert res.bad == ["org/chat[5]: empty prompt"]  # the bad row, named by its source and row
    assert [s.prompt for s in read_samples(f"{hub}@test").samples] == ["test prompt"]
    assert read_samples(hub, split="test").samples[0].id == "x"
    alpaca = read_samples(f"{hub}:alpaca").samples
    assert [(s.prompt, s.completion) for s in alpaca] == [("Translate to French.\n\nGood morning", "Bonjour"),
                                                          ("Name a colour.", "Blue")]
    files = read_samples({"path": hub, "data_files": ["alpaca/*.parquet"]}).samples
    assert [s.prompt for s in files] == [s.prompt for s in alpaca]
    with pytest.raises(DataError, match="cannot load Hub dataset 'org/chat:french'.*french"):
        read_samples(f"{hub}:french")
    with pytest.raises(BadRowError, match=r"org/chat\[5\]: empty prompt \(pass --skip-bad-rows"):
        read_samples(hub)


def test_a_hub_dataset_that_is_not_cached_says_so_offline(hub):
    with pytest.raises(DataError, match="'org/other' is neither a local file or folder nor a cached Hub dataset"):
        read_samples("org/other")


def test_streaming_reads_the_same_rows_lazily(hub):
    spec = {"path": hub, "streaming": True}
    assert read_samples(spec, limit=4).samples == read_samples(hub, limit=4).samples
    shuffled = read_samples({**spec, "shuffle": True, "seed": 1}, skip_bad_rows=True).samples
    assert sorted(s.id for s in shuffled) == sorted(s.id for s in read_samples(hub, skip_bad_rows=True).samples)
    assert [s.id for s in shuffled] == [s.id for s in read_samples({**spec, "shuffle": True, "seed": 1},
                                                                   skip_bad_rows=True).samples]


# -- columns and formats ---------------------------------------------------------------------------------
def test_columns_map_a_dataset_s_own_names(tmp_path):
    rows = [{"uid": "a", "question": "What is 2 + 2?"}, {"uid": "b", "question": "Name a prime."}]
    p = write_jsonl(tmp_path / "q.jsonl", rows)
    got = read_samples({"path": str(p), "columns": {"prompt": "question", "id": "uid"}}).samples
    assert [(s.id, s.prompt) for s in got] == [("a", "What is 2 + 2?"), ("b", "Name a prime.")]
    turns = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]
    p = write_jsonl(tmp_path / "s.jsonl", [{"turns": turns}])
    got = read_samples({"path": str(p), "format": "sharegpt", "columns": {"conversations": "turns"}}).samples
    assert got[0].messages == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    p = write_jsonl(tmp_path / "m.jsonl", [{"dialog": [{"role": "user", "content": "Hi"}]}])
    assert read_samples({"path": str(p), "columns": {"messages": "dialog"}}).samples[0].messages[0]["content"] == "Hi"


def test_alpaca_rows_are_read_without_a_mapping(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "Summarise:", "input": "A long text.", "output": "Short."},
                                           {"instruction": "Say hi.", "input": ""}, {"instruction": "  ", "input": "x"}])
    res = read_samples(str(p), skip_bad_rows=True)
    assert [(s.prompt, s.completion) for s in res.samples] == [("Summarise:\n\nA long text.", "Short."),
                                                               ("Say hi.", None)]
    assert res.bad == [f"{p}:3: empty instruction"]


def test_an_explicit_format_makes_other_rows_bad_rows_naming_it(tmp_path):
    p = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "plain"}, {"messages": [{"role": "user", "content": "Hi"}]}])
    res = read_samples({"path": str(p), "format": "messages"}, skip_bad_rows=True)
    assert [s.is_chat for s in res.samples] == [True]
    assert res.bad[0].startswith(f"{p}:1: no 'messages' field, which format messages reads")


# -- shuffle, sample, mix --------------------------------------------------------------------------------
def test_a_seeded_shuffle_and_sample_is_a_random_sample_that_keeps_row_ids(tmp_path):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(50)])
    spec = {"path": str(p), "shuffle": True, "seed": 3, "sample": 10}
    a, b = read_samples(spec).samples, read_samples(spec).samples
    assert a == b and len(a) == 10 and all(s.prompt == f"p{s.id}" for s in a)  # ids: the rows' own
    assert [s.id for s in a] != [str(i) for i in range(10)]  # not the prefix
    assert a != read_samples({**spec, "seed": 4}).samples
    whole = read_samples({**spec, "sample": None}).samples
    assert a == whole[:10] and sorted(int(s.id) for s in whole) == list(range(50))
    assert read_samples(spec, limit=4).samples == a[:4]  # limit takes a prefix of the sample
    chat = read_samples({"path": "chat:heldout", "shuffle": True, "sample": 5}).samples
    assert len(chat) == 5 and chat != read_samples("chat:heldout", limit=5).samples


def test_bad_rows_keep_their_line_after_a_shuffle(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": ""}\n{"prompt": "d"}\n')
    res = read_samples({"path": str(p), "shuffle": True, "seed": 0}, skip_bad_rows=True)
    assert sorted(s.prompt for s in res.samples) == ["a", "b", "d"] and res.bad == [f"{p}:3: empty prompt"]


def test_a_weighted_mix_holds_its_shares_in_every_prefix_and_ends_with_a_source(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}"} for i in range(20)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}"} for i in range(4)])
    mix = [{"path": str(a), "weight": 2}, {"path": str(b)}]
    got = read_samples(mix, limit=9).samples
    assert [s.prompt for s in got] == ["a0", "a1", "b0", "a2", "a3", "b1", "a4", "a5", "b2"]
    assert got[2].id == f"{b}:0" and got[2].meta["source"] == str(b)
    assert read_samples(mix, skip=3, limit=3).samples == got[3:6]  # skip and limit cut the same mix
    whole = read_samples(mix).samples  # the mix ends at the first row it needs from b once b has none left
    assert [s.prompt for s in whole if s.prompt.startswith("b")] == ["b0", "b1", "b2", "b3"]
    assert [s.prompt for s in whole][-3:] == ["b3", "a8", "a9"] and len(whole) == 14
    sampled = read_samples([{"path": str(a), "sample": 3}, {"path": "chat:train"}]).samples
    assert len(sampled) == 6 and [s.meta["source"] for s in sampled[:2]] == [str(a), "chat:train"]


def test_a_mix_reports_each_bad_row_with_its_source(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a0"}, {"text": "no prompt"}, {"prompt": "a2"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "b0"}, {"prompt": ""}, {"prompt": "b2"}])
    res = read_samples([str(a), str(b)], skip_bad_rows=True)
    assert [s.prompt for s in res.samples] == ["a0", "b0", "a2", "b2"]
    assert res.bad[0].startswith(f"{a}:2: no 'prompt'") and res.bad[1] == f"{b}:2: empty prompt"
    with pytest.raises(BadRowError, match=f"{a}:2: no 'prompt'"):
        read_samples([str(a), str(b)])


def test_check_source_reads_specs_and_refuses_a_missing_file_in_a_mix(tmp_path):
    check_source([{"path": "chat:train"}, {"path": "org/name", "split": "x"}])
    with pytest.raises(DataError, match="prompt source not found"):
        check_source(["chat:train", str(tmp_path / "missing.jsonl")])
    with pytest.raises(DataError, match="unknown key 'source.colums'"):
        check_source({"path": "a.jsonl", "colums": {}})


def test_a_distill_config_takes_a_spec_and_records_it_as_written(tmp_path):
    (tmp_path / "d.yaml").write_text("source:\n  - {path: chat:train, weight: 3}\n  - preset: ultrachat\n"
                                     "    sample: 500\n    weight: 1\ntarget: demo\n")
    cfg = load_config(DistillConfig, tmp_path / "d.yaml")
    assert cfg.source == [{"path": "chat:train", "weight": 3}, {"preset": "ultrachat", "sample": 500, "weight": 1}]
    assert [s.path for s in parse_sources(cfg.source)] == ["chat:train", "HuggingFaceH4/ultrachat_200k"]
    cli = load_config(DistillConfig, None, ["org/chat:alpaca@train", "target=demo"])
    assert cli.source == "org/chat:alpaca@train"  # a command-line string stays a string (recorded as given)
    assert load_config(DistillConfig, None, ["p #1.jsonl", "target=demo"]).source == "p #1.jsonl"  # not YAML'd
    with pytest.raises(ConfigError, match="'columns' maps unknown field 'question'"):
        load_config(DistillConfig, None, {"source": {"path": "a.jsonl", "columns": {"question": "q"}},
                                          "target": "demo"})
