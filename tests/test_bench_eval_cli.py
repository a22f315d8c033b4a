"""``headway eval`` on the command line: bad input is one line (rc 2) before any target is built or
loaded; ``headway tune`` refuses the reporting split (chat:test)."""

import json

import pytest

from headway.cli import main
from headway.config import ConfigError

ROWS = [{"question_id": 1, "category": "qa", "turns": ["who?"]}]


@pytest.fixture
def no_target(monkeypatch):
    """Any attempt to build or load a target fails the test: every check comes first."""
    import headway.target

    monkeypatch.setattr(headway.target, "resolve_target_path", lambda *a: pytest.fail("built the target"))
    monkeypatch.setattr(headway.target, "load_target", lambda *a, **k: pytest.fail("loaded the target"))


@pytest.fixture
def heads(tmp_path):
    from headway.heads import Eagle3Drafter
    from headway.testing import tiny_target

    model, _ = tiny_target("llama", seed=0)
    return str(Eagle3Drafter.for_target(model, draft_vocab_size=50).save_pretrained(tmp_path / "heads"))


def run(argv, capsys):
    rc = main(["eval", *argv])
    err = capsys.readouterr().err.strip()
    return rc, err


def test_a_missing_suite_file_says_where_to_get_it_and_its_format(tmp_path, no_target, heads, capsys, monkeypatch):
    from headway.bench import suites

    monkeypatch.setattr(suites, "installed_file", lambda *a: None)
    rc, err = run(["gsm8k", "--target", "demo", "--heads", heads], capsys)
    assert rc == 2 and "\n" not in err
    assert err.startswith("headway eval: error: no gsm8k questions found: pass suite_file=PATH, a file of JSON lines")
    assert "https://raw.githubusercontent.com/openai/grade-school-math/" in err and "(MIT;" in err
    rc, err = run(["spec-bench", "--target", "demo", "--heads", heads, f"suite_file={tmp_path / 'q.jsonl'}"], capsys)
    assert rc == 2 and err.startswith(f"headway eval: error: suite_file not found: {tmp_path / 'q.jsonl'}; "
                                      "spec-bench needs JSON lines")


@pytest.mark.parametrize("args, message", [
    (["mmlu"], "'suite' must be one of mt-bench, spec-bench, humaneval, gsm8k"),
    ([], "'heads' needs one or more heads checkpoints"),
    (["HEADS", "--categories", "qa", "rag"], "spec-bench has no category 'rag'; its categories: qa"),
    (["HEADS", "--per-category", "-1"], "'per_category' must be >= 0"),
    (["HEADS", "--engine", "vllm", "--temperature", "1"], "--engine vllm compares greedy chains"),
    (["HEADS", "--engine", "vllm", "--vllm-python", "/nope/python"], "vLLM python /nope/python does not exist"),
    (["HEADS", "--engine", "vllm", "--tolerance", "2"], "'tolerance' must be a rate between 0 and 1"),
    (["HEADS", "--tree", "chain-x"], "cannot parse tree 'chain-x'"),
    (["HEADS", "--baselines", "hf-nothing"], "'baselines' must be one of"),
    (["HEADS", "--chat-template", "/nope/t.jinja"], "chat template file not found: /nope/t.jinja"),
])
def test_bad_arguments_are_one_line_before_the_target(args, message, tmp_path, no_target, heads, capsys, monkeypatch):
    monkeypatch.delenv("HEADWAY_VLLM_PYTHON", raising=False)
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    suite = [] if args[:1] == ["mmlu"] else ["spec-bench"]
    argv = [a if a != "HEADS" else "--heads" for a in args]
    argv = [x for a in argv for x in ([a, heads] if a == "--heads" else [a])]
    rc, err = run([*suite, *argv, "--target", "demo", f"suite_file={tmp_path / 'q.jsonl'}"], capsys)
    assert rc == 2 and err.startswith("headway eval: error: ") and message in err and "\n" not in err, err


def test_a_heads_folder_that_is_not_one_is_refused_first(tmp_path, no_target, capsys):
    (tmp_path / "q.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    (tmp_path / "junk").mkdir()
    rc, err = run(["spec-bench", "--target", "demo", "--heads", str(tmp_path / "junk"),
                   f"suite_file={tmp_path / 'q.jsonl'}"], capsys)
    assert rc == 2 and "has no config.json; is it a headway heads checkpoint?" in err


def test_help_lists_the_suites(capsys):
    assert main(["eval", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: headway eval") and "mt-bench, spec-bench, humaneval, gsm8k" in out
    for flag in ("--suite-file", "--per-category", "--engine", "--vllm-python", "--tolerance", "--card"):
        assert flag in out, flag


@pytest.mark.parametrize("prompts", ["chat:test", "{path: chat:test, sample: 4}", "[chat:dev, chat:test]"])
def test_tune_refuses_the_reporting_split(prompts):
    from headway.bench.configs import TuneConfig
    from headway.config import from_dict

    with pytest.raises(ConfigError, match=r"'prompts' reads chat:test, the split reported numbers are measured on"):
        from_dict(TuneConfig, {"target": "t", "heads": "h", "prompts": prompts})
    assert from_dict(TuneConfig, {"target": "t", "heads": "h", "prompts": "chat:dev"}).prompts == "chat:dev"
