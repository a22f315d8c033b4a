"""Prompt sources: every format parses to the normalised ``Sample`` form; bad rows are located."""

import json
import sys
import types
from pathlib import Path

import pytest

from headway.data.errors import BadRowError, DataError
from headway.data.samples import Sample, normalize_row
from headway.data.sources import read_samples
from headway.errors import HeadwayError

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_prompt_messages_and_sharegpt(tmp_path):
    p = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "def f(x):"},
        {"id": "chat-1", "messages": CHAT},
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                           {"from": "gpt", "value": "Hello!"}]},
        {"prompt": "2 + 2 =", "completion": " 4"},
    ])
    s = read_samples(str(p)).samples
    assert s[0] == Sample("0", prompt="def f(x):")
    assert s[1] == Sample("chat-1", messages=CHAT)
    assert s[2] == Sample("2", messages=CHAT)  # ShareGPT roles mapped to OpenAI roles
    assert s[3] == Sample("3", prompt="2 + 2 =", completion=" 4")
    assert s[0].is_chat is False and s[1].is_chat and s[3].has_answers() and not s[0].has_answers()


def test_trl_conversational_prompt_and_content_parts():
    row = {"prompt": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
           "completion": [{"role": "assistant", "content": "Hello!"}]}
    assert normalize_row(row, 0, "x").messages == [{"role": "user", "content": "Hi"},
                                                   {"role": "assistant", "content": "Hello!"}]


def test_json_array_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "a = 1"}, {"prompt": "b = 2"}]
    (tmp_path / "p.json").write_text(json.dumps(rows))
    assert [s.prompt for s in read_samples(str(tmp_path / "p.json")).samples] == ["a = 1", "b = 2"]
    (tmp_path / "d.json").write_text(json.dumps({"data": rows}))
    assert len(read_samples(str(tmp_path / "d.json")).samples) == 2
    (tmp_path / "lines.json").write_text("\n".join(json.dumps(r) for r in rows))  # JSON lines in a .json
    assert len(read_samples(str(tmp_path / "lines.json")).samples) == 2
    pq.write_table(pa.Table.from_pylist([{"messages": CHAT}, {"messages": CHAT}]), tmp_path / "p.parquet")
    assert read_samples(str(tmp_path / "p.parquet")).samples[1].messages == CHAT


def test_datasets_folder_with_splits(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "x = 1"}] * 3),
                               "test": datasets.Dataset.from_list([{"prompt": "y = 2"}])})
    dd.save_to_disk(str(tmp_path / "ds"))
    assert [s.prompt for s in read_samples(str(tmp_path / "ds")).samples] == ["x = 1"] * 3
    assert read_samples(str(tmp_path / "ds"), split="test").samples[0].prompt == "y = 2"
    with pytest.raises(DataError, match="no split 'valid'.*train, test"):
        read_samples(str(tmp_path / "ds"), split="valid")


def test_limit(tmp_path):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    assert len(read_samples(str(p), limit=4).samples) == 4


def test_skip_takes_the_prompts_after_the_first_n(tmp_path):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    got = read_samples(str(p), skip=4, limit=3).samples
    assert [s.prompt for s in got] == ["p4", "p5", "p6"] and [s.id for s in got] == [s.id for s in
                                                                                     read_samples(str(p)).samples[4:7]]
    assert [s.prompt for s in read_samples(str(p), skip=8).samples] == ["p8", "p9"]
    first, rest = read_samples("chat:train", limit=5).samples, read_samples("chat:train", skip=5, limit=3).samples
    assert read_samples("chat:train", limit=8).samples == first + rest
    with pytest.raises(DataError, match="10 usable prompts; skip=10 leaves none"):
        read_samples(str(p), skip=10)
    with pytest.raises(DataError, match="skip must be >= 0"):
        read_samples(str(p), skip=-1)


def test_hub_name_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError) as e:
        read_samples("someorg/no-such-prompts")
    msg = str(e.value)
    assert "someorg/no-such-prompts" in msg and "cached" in msg and "\n" not in msg


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_samples(str(tmp_path / "nope.jsonl"))


def test_demo_source_calls_demo_prompts(monkeypatch):
    calls = []

    def demo_prompts(split, n, prompt_tokens, tokenizer, seed):
        calls.append((split, n, prompt_tokens, seed))
        return [f"{split} prefix {i}" for i in range(n)]

    fake = types.ModuleType("headway.data.stdlib_corpus")
    fake.demo_prompts = demo_prompts
    monkeypatch.setitem(sys.modules, "headway.data.stdlib_corpus", fake)
    s = read_samples("demo:heldout", limit=3, tokenizer=object(), prompt_tokens=32, seed=7).samples
    assert [x.prompt for x in s] == ["heldout prefix 0", "heldout prefix 1", "heldout prefix 2"]
    assert s[0].id == "demo:heldout:0" and calls == [("heldout", 3, 32, 7)]
    read_samples("demo:train", tokenizer=object())
    assert calls[-1][:2] == ("train", 256)


def test_chat_source_needs_no_tokenizer_and_ignores_the_seed():
    s = read_samples("chat:heldout", limit=4, seed=3).samples
    assert len(s) == 4 and all(x.prompt and x.id.startswith("chat:heldout:") for x in s)
    assert [x.id for x in read_samples("chat:heldout", limit=4).samples] == [x.id for x in s]
    with pytest.raises(DataError, match="unknown built-in chat corpus"):
        read_samples("chat:valid")


# ------------------------------------------------------------------ bad input

def test_malformed_jsonl_line_reports_file_and_line(tmp_path):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, "", '{"prompt": "broken', {"prompt": "ok too"}])
    with pytest.raises(BadRowError) as e:
        read_samples(str(p))
    msg = str(e.value)
    assert msg.startswith(f"{p}:3: invalid JSON") and "--skip-bad-rows" in msg and "\n" not in msg
    assert isinstance(e.value, HeadwayError)
    res = read_samples(str(p), skip_bad_rows=True)
    assert [s.prompt for s in res.samples] == ["ok", "ok too"] and len(res.bad) == 1
    assert res.bad[0].startswith(f"{p}:3:")


@pytest.mark.parametrize("row, reason", [
    ({"prompt": "   "}, "empty prompt"),
    ({"messages": []}, "empty conversation"),
    ({"messages": [{"role": "user", "content": ""}]}, "empty user message"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "unknown role 'bot'"),
    ({"conversations": [{"from": "robot", "value": "hi"}]}, "unknown role 'robot'"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "conversation has no user message"),
    ({"text": "hello"}, "no 'prompt', 'messages', 'conversations' or 'instruction' field"),
    ({"prompt": 3}, "'prompt' must be a string"),
    (["not", "an", "object"], "expected a JSON object"),
])
def test_bad_rows_are_reported_with_location(tmp_path, row, reason):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "fine"}, row])
    with pytest.raises(BadRowError) as e:
        read_samples(str(p))
    assert str(e.value).startswith(f"{p}:2: {reason}")
    assert len(read_samples(str(p), skip_bad_rows=True).bad) == 1


def test_resolve_target_path(monkeypatch, tmp_path):
    import headway.demo.builder as demo
    from headway.target import resolve_target_path

    built = []
    monkeypatch.setattr(demo, "build_demo_target", lambda cfg: built.append(cfg.preset) or tmp_path / "demo-x")
    assert resolve_target_path("demo") == str(tmp_path / "demo-x") and built == ["demo"]
    assert resolve_target_path(str(tmp_path)) == str(tmp_path.resolve())
    assert resolve_target_path("org/model") == "org/model"


def test_bad_settings_are_config_errors():
    from headway.config import ConfigError, parse_cli
    from headway.data.distill import DistillConfig

    with pytest.raises(ConfigError, match="temperature must be >= 0"):
        parse_cli(DistillConfig, ["p.jsonl", "--target", "demo", "temperature=-1"])
    with pytest.raises(ConfigError, match="overlong"):
        parse_cli(DistillConfig, ["p.jsonl", "--target", "demo", "--overlong", "explode"])
